"""Launch plans of a split-K GEMM, on any machine: what a plan hands Triton's C launcher for the
partial GEMM and for the fixed-order sum equals what Triton's own launch path hands it for the
full path's call, argument for argument (same compiled kernels, same arguments: same bits).

No GPU is needed: both kernels are compiled for sm_90 by Triton's own compiler and ptxas (the
metadata Triton's launcher reads, e.g. which descriptors became CUtensorMaps), then launched
through stand-ins whose C launcher only records its arguments; the CUtensorMap encoder is
replaced by one that records what it was asked to encode. The `gpu` tests in
test_triton_splitk.py run the same plans on the H200 and compare bits.
"""
import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import triton

from tests.batch_invariant.triton._util import randn

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
kernel_mod = importlib.import_module("zmrl.batch_invariant.triton._gemm_kernel")
configs = importlib.import_module("zmrl.batch_invariant.triton._gemm_config")
splitk = importlib.import_module("zmrl.batch_invariant.triton._splitk")
gemm_plan = importlib.import_module("zmrl.batch_invariant.triton._gemm_plan")
launch = importlib.import_module("zmrl.batch_invariant.triton._launch")

BF16 = torch.bfloat16
M, N, K = 5, 48, 3000  # K ranges of 1024 (the GPU alignment): 3 splits hold data
CFG = configs.MMConfig(16, 32, 32, num_warps=4, num_stages=1, split_k=3)
PLAIN = configs.MMConfig(16, 32, 32, num_warps=4, num_stages=1)  # no split-K: its plans serve any M
SUB_TILES = configs.MMConfig(16, 16, 32, num_warps=4, num_stages=1, sub_n=3)  # one 48-column tile: 3 x 16
BASE_ARGS = 13  # grid x/y/z, stream, function, cooperative, PDL, 2 scratch, packed metadata, launch metadata, 2 hooks


# Compiles both kernels for sm_90 and prints what Triton's launcher reads from each. It runs in a
# child process: under TRITON_INTERPRET=1 (this folder's CPU mode) Triton's own language helpers
# are interpreter functions, which its compiler cannot inline.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zmrl.batch_invariant.triton._gemm_kernel import _mm_kernel
from zmrl.batch_invariant.triton._splitk import _splitk_sum

def build(kernel, signature, constexprs, **options):
    c = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    m = c.metadata
    return dict(signature=signature, tensordesc_meta=m.tensordesc_meta, packed_metadata=list(c.packed_metadata),
                global_scratch_size=m.global_scratch_size, profile_scratch_size=m.profile_scratch_size,
                launch_cooperative_grid=m.launch_cooperative_grid, launch_pdl=m.launch_pdl)

spec = json.loads(sys.argv[1])
print(json.dumps([build(_mm_kernel, *spec["main"], num_warps=4, num_stages=1),
                  build(_splitk_sum, *spec["sum"], num_warps=4),
                  build(_mm_kernel, *spec["plain"], num_warps=4, num_stages=1),
                  build(_mm_kernel, *spec["sub_tiles"], num_warps=4, num_stages=1)]))
"""


@pytest.fixture(scope="module")
def compiled(compiled_all):
    return compiled_all[:2]


@pytest.fixture(scope="module")
def compiled_plain(compiled_all):
    return compiled_all[2]


@pytest.fixture(scope="module")
def compiled_sub_tiles(compiled_all):
    return compiled_all[3]


@pytest.fixture(scope="module")
def compiled_all():
    """(partial GEMM, sum) for CFG and the GEMMs of PLAIN and SUB_TILES, compiled for an H200
    without one: what Triton's launcher reads from each compiled kernel."""
    consts = dict(BM=CFG.block_m, BN=CFG.block_n, BK=CFG.block_k, GROUP_M=CFG.group_m, NUM_PROGS=1 << 30,
                  B_KMAJOR=True, HAS_BIAS=False, PRECISION=None, UPCAST=False, FLATTEN=False, TMA_STORE=True,
                  SPLIT_K=CFG.split_k, SPLIT_INLINE=False, A_3D=False, B_3D=False, SUB_N=CFG.sub_n)
    sig = {"a_desc": "tensordesc<bf16[16, 32]>", "b_desc": "tensordesc<bf16[32, 32]>",
           "c_desc": "tensordesc<fp32[1, 16, 32]>", "c_ptr": "*fp32", "bias_ptr": "*fp32"}
    sig.update({name: "i32" for name in ("M", "N", "K", "k_chunk", "b_batch_rows", "num_batches", "stride_cb",
                                         "stride_cm")})
    sig.update({name: "constexpr" for name in consts})
    sum_consts = dict(SPLITS=CFG.split_k, BLOCK=splitk.SUM_BLOCK, HAS_BIAS=True)
    sum_sig = {"ws_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*bf16", "total": "i32", "N": "i32",
               **{name: "constexpr" for name in sum_consts}}
    plain_consts = dict(consts, BM=PLAIN.block_m, BN=PLAIN.block_n, BK=PLAIN.block_k, SPLIT_K=1)
    plain_sig = dict(sig, c_desc="tensordesc<bf16[1, 16, 32]>", c_ptr="*bf16", bias_ptr="*bf16")
    sub_consts = dict(plain_consts, BN=SUB_TILES.block_n, SUB_N=SUB_TILES.sub_n)
    sub_sig = dict(plain_sig, b_desc="tensordesc<bf16[16, 32]>", c_desc="tensordesc<bf16[1, 16, 16]>")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    spec = json.dumps(dict(main=[sig, consts], sum=[sum_sig, sum_consts], plain=[plain_sig, plain_consts],
                           sub_tiles=[sub_sig, sub_consts]))
    done = subprocess.run([sys.executable, "-c", _COMPILE, spec], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(types.SimpleNamespace(**k) for k in json.loads(done.stdout.strip().splitlines()[-1]))


def _stand_in(kernel, calls: list, tensordesc_meta="as compiled"):
    """A CompiledKernel as Triton's CUDA driver builds it (its `launch` wraps the C launcher in
    Triton's own descriptor expansion exactly when the kernel has descriptor arguments), with a
    C launcher that records its arguments."""
    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    meta = kernel.tensordesc_meta if tensordesc_meta == "as compiled" else tensordesc_meta
    raw = functools.partial(lambda *args: calls.append(args))  # like the C launcher: no __code__
    run = types.SimpleNamespace(
        launch=wrap_handle_tensordesc(raw, kernel.signature, meta), global_scratch_size=kernel.global_scratch_size,
        profile_scratch_size=kernel.profile_scratch_size, launch_cooperative_grid=kernel.launch_cooperative_grid,
        launch_pdl=kernel.launch_pdl)
    return types.SimpleNamespace(run=run, metadata=types.SimpleNamespace(tensordesc_meta=meta),
                                 function="cu_function", packed_metadata=tuple(kernel.packed_metadata))


def test_triton_does_not_wrap_a_kernel_without_descriptors(compiled):
    main, total = compiled
    assert total.tensordesc_meta in ([], None)  # the sum kernel: plain pointers only
    assert len(main.tensordesc_meta) == 3 and launch.has_tma_meta(_stand_in(main, []))
    assert isinstance(_stand_in(total, []).run.launch, functools.partial)  # the C launcher itself


def test_both_kernels_of_a_split_k_call_get_a_direct_launcher(compiled):
    main, total = compiled
    assert launch.DirectKernel.make(_stand_in(main, []), "t_gemm") is not None
    assert launch.DirectKernel.make(_stand_in(total, []), "t_sum") is not None
    assert launch.direct_launch_status()["t_sum"] == "direct"
    # control: the same GEMM whose descriptors were not lowered to CUtensorMaps is refused
    assert launch.DirectKernel.make(_stand_in(main, [], tensordesc_meta=[]), "t_gemm_unlowered") is None
    assert "not lowered" in launch.direct_launch_status()["t_gemm_unlowered"]


class _RecordingJit:
    """Stands for a @triton.jit kernel: records `kernel[grid](*args, **kwargs)`."""

    def __init__(self, params: list[str], returns):
        self.params, self.returns, self.calls = params, returns, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound = list(args) + [kwargs[p] for p in self.params[len(args):]]  # the kernel's parameter order
            self.calls.append((grid[0], bound))
            return self.returns
        return run


def _triton_launch(stand_in, grid: int, bound: list) -> None:
    """What Triton's CudaLauncher hands its `launch` for one `kernel[grid](...)` call (tensors
    reach the C launcher as objects it reads data_ptr() from: here, the address)."""
    args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in bound]
    stand_in.run.launch(grid, 1, 1, 0, stand_in.function, stand_in.run.launch_cooperative_grid,
                        stand_in.run.launch_pdl, None, None, stand_in.packed_metadata, None, None, None, *args)


def _record_launches(monkeypatch) -> tuple[_RecordingJit, _RecordingJit]:
    """Triton's JIT launches of the GEMM and the split-K sum recorded instead of run, and the
    CUtensorMap encoder replaced by one that records what it was asked -> (gemm, sum) recorders."""
    def fill_tma_descriptor(ptr, swizzle, elem_size, dtype, block, shape, strides, padding):
        return ("CUtensorMap", ptr, swizzle, elem_size, dtype, tuple(block), tuple(shape), tuple(strides), padding)

    driver = types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill_tma_descriptor))
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)
    monkeypatch.setattr(gemm_plan, "current_stream", lambda device_index: 0)
    launch.clear_tensor_maps()
    jit_main = _RecordingJit(list(kernel_mod._mm_kernel.arg_names), "compiled gemm")
    jit_sum = _RecordingJit(list(splitk._splitk_sum.arg_names), "compiled sum")
    monkeypatch.setattr(kernel_mod, "_mm_kernel", jit_main)
    monkeypatch.setattr(splitk, "_splitk_sum", jit_sum)
    monkeypatch.setattr(kernel_mod, "INTERPRET", False)
    monkeypatch.setattr(configs, "INTERPRET", False)
    return jit_main, jit_sum


def _full_and_plan(monkeypatch, compiled, x, b, bias, key):
    """One call of CFG through launch_config (Triton's own launch path, stand-in launchers) and
    the plan built from it, run on the same operands -> (full path's args for the GEMM and the
    sum, the plan's, the full path's workspace and output, the plan and the plan's output)."""
    main, total = compiled
    jit_main, jit_sum = _record_launches(monkeypatch)
    out_full = torch.empty(1, M, N, dtype=BF16)
    launched = kernel_mod.launch_config(x, b, bias, CFG, False, out_full)
    assert launched.direct and launched.splits == 3 and launched.total == "compiled sum"
    (main_grid, main_bound), = jit_main.calls
    (sum_grid, sum_bound), = jit_sum.calls

    # the full path through Triton's own launch (descriptor expansion included)
    full_main, full_sum, plan_main, plan_sum = [], [], [], []
    _triton_launch(_stand_in(main, full_main), main_grid, main_bound)
    _triton_launch(_stand_in(total, full_sum), sum_grid, sum_bound)

    stand_ins = dataclasses.replace(launched, main=_stand_in(main, plan_main), total=_stand_in(total, plan_sum))
    gemm_plan.remember(key, stand_ins, BF16, x.device)
    plan = gemm_plan.PLANS.pop(key)
    assert plan is not None, launch.direct_launch_status()
    out_plan = plan.run(x, b, bias, plan.out_shape)
    assert out_plan.shape == out_full.shape and out_plan.dtype == out_full.dtype
    assert plan_main[0][0] == main_grid and plan_sum[0][0] == sum_grid
    return full_main, full_sum, plan_main, plan_sum, (main_bound[3], out_full), plan, out_plan


_WS = BASE_ARGS + 1 + 2 * 2 + 1 + 2 * 2  # the workspace's descriptor: after a's and b's expanded ones


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_split_k_plan_launches_what_the_full_path_launches(compiled, monkeypatch, with_bias):
    x = randn(1, M, K, dtype=BF16, seed=1)
    w = randn(N, K, dtype=BF16, seed=2)
    bias = randn(N, dtype=BF16, seed=3) if with_bias else None
    full_main, full_sum, plan_main, plan_sum, (ws_full, out_full), plan, out_plan = _full_and_plan(
        monkeypatch, compiled, x, w.t()[None], bias, ("split-k plan test", with_bias))
    ws_plan = plan_main[0][_WS]
    assert ws_plan[0] == "CUtensorMap"
    names = {ws_full.data_ptr(): "workspace", ws_plan[1]: "workspace", out_full.data_ptr(): "out",
             out_plan.data_ptr(): "out"}

    def named(args):
        return [named(a) if isinstance(a, tuple) else names.get(a, a) if isinstance(a, int) else a for a in args]

    # the workspaces are fresh allocations: equal shapes, every other argument identical
    assert named(plan_main[0]) == named(full_main[0])
    assert named(plan_sum[0]) == named(full_sum[0])
    # control: the comparison sees an argument that differs (another operand address)
    other = randn(1, M, K, dtype=BF16, seed=4)
    plan.run(other, w.t()[None], bias, plan.out_shape)
    assert named(plan_main[1]) != named(full_main[0])
    launch.clear_tensor_maps()


def test_a_plan_copies_the_operands_the_full_path_copied(compiled, monkeypatch):
    """A [M, K] read through a transpose and a weight whose row pitch TMA cannot address: the full
    path copies both; the plan copies them again the same way (same descriptor shapes and strides,
    the same values), and every other argument is the full path's."""
    x = randn(K, M, dtype=BF16, seed=1).t()[None]  # [1, M, K], column-major rows
    w = randn(N, K + 1, dtype=BF16, seed=2)[:, :K]  # row pitch K + 1 elements: not 16-byte aligned
    full_main, full_sum, plan_main, plan_sum, (ws_full, out_full), plan, out_plan = _full_and_plan(
        monkeypatch, compiled, x, w.t()[None], None, "copying plan test")
    assert plan.prep_a is not None and plan.prep_b is not None
    a_copy, b_copy = plan.prep_a(x), plan.prep_b(w.t()[None])
    assert torch.equal(a_copy, x[0]) and torch.equal(b_copy[:, :K], w)
    a_at, b_at, ws_at = BASE_ARGS, BASE_ARGS + 1 + 2 * 2, _WS  # each descriptor's CUtensorMap

    def masked(args):  # the copies' addresses are fresh allocations; out and the workspace too
        args = list(args)
        for i in (a_at, b_at, ws_at):
            assert args[i][0] == "CUtensorMap"
            args[i] = args[i][:1] + args[i][2:]
        return [a for a in args if not isinstance(a, int) or a < 1 << 20]  # raw addresses left out

    for i in (a_at, b_at):  # operands read from copies, never from the caller's tensors
        assert plan_main[0][i][1] not in (x.data_ptr(), w.data_ptr())
        assert full_main[0][i][1] not in (x.data_ptr(), w.data_ptr())
    assert masked(plan_main[0]) == masked(full_main[0])
    # control: a plan that used A in place would hand the kernel x's own address
    monkeypatch.setattr(plan, "prep_a", None)
    plan.run(x, w.t()[None], None, plan.out_shape)
    assert plan_main[1][a_at][1] == x.data_ptr()
    launch.clear_tensor_maps()



# (config, M the plan was made at, M it is used at), 4 SMs in this mode (num_sms without a GPU): up
# to 4 tiles one program each, past that 4 persistent programs. PLAIN's tiles of 16 x 32 make two
# column tiles over N = 48; SUB_TILES' one tile of 3 x 16 columns makes one.
@pytest.mark.parametrize("cfg_name, m_made, m_used", [
    ("plain", 5, 20), ("plain", 32, 7), ("plain", 40, 100), ("plain", 100, 33),
    ("sub_tiles", 5, 20), ("sub_tiles", 32, 7), ("sub_tiles", 80, 100), ("sub_tiles", 100, 70)])
def test_a_plan_made_at_one_row_count_launches_what_the_full_path_launches_at_another(
        request, monkeypatch, cfg_name, m_made, m_used):
    """A trainer's minibatches rarely repeat a token count: a plan serves every M of its row
    family (same config, same persistence), with the M-dependent arguments (M, the output's batch
    stride, the descriptors' row counts, the grid) those the full path computes for that M."""
    cfg = {"plain": PLAIN, "sub_tiles": SUB_TILES}[cfg_name]
    compiled_kernel = request.getfixturevalue(f"compiled_{cfg_name}")
    jit_main, _ = _record_launches(monkeypatch)
    monkeypatch.setattr(kernel_mod, "num_sms", lambda device_index: 4)  # as without a GPU, on every machine
    w = randn(N, K, dtype=BF16, seed=2).t()[None]
    bias = randn(N, dtype=BF16, seed=3)
    x_made, x_used = randn(1, m_made, K, dtype=BF16, seed=1), randn(1, m_used, K, dtype=BF16, seed=4)

    def family(x):
        key = mm._plan_key(x, w, bias, None, False)
        return key, gemm_plan.family_key(key, cfg, kernel_mod.persistent_at(cfg, x.shape[1], N, 1, None))

    key_made, family_made = family(x_made)
    launched = kernel_mod.launch_config(x_made, w, bias, cfg, False, torch.empty(1, m_made, N, dtype=BF16))
    plan_calls = []
    gemm_plan.remember(key_made, dataclasses.replace(launched, main=_stand_in(compiled_kernel, plan_calls)), BF16,
                       x_made.device, family_made)
    key_used, family_used = family(x_used)
    assert family_used == family_made and key_used != key_made
    plan = gemm_plan.for_rows(key_used, family_used, m_used)
    assert plan is not None and gemm_plan.PLANS[key_used] is plan
    out_plan = plan.run(x_used, w, bias, plan.out_shape)
    assert out_plan.shape == (1, m_used, N)

    # the full path's call at m_used: the same constexprs (the same compiled kernel), and the same
    # arguments through Triton's own launch
    out_full = torch.empty(1, m_used, N, dtype=BF16)
    launched_used = kernel_mod.launch_config(x_used, w, bias, cfg, False, out_full)
    assert launched_used.consts == launched.consts
    grid, bound = jit_main.calls[-1]
    full_calls = []
    _triton_launch(_stand_in(compiled_kernel, full_calls), grid, bound)
    outs = {out_full.data_ptr(): "out", out_plan.data_ptr(): "out"}

    def named(args):
        return [named(a) if isinstance(a, tuple) else outs.get(a, a) if isinstance(a, int) else a for a in args]

    assert named(plan_calls[0]) == named(full_calls[0])
    # control: the plan as made (its own M) run on the new rows hands the kernel other arguments
    gemm_plan.PLANS[key_made].run(x_used, w, bias, (1, m_used, N))
    assert named(plan_calls[1]) != named(full_calls[0])
    gemm_plan.clear()
    launch.clear_tensor_maps()


def test_a_row_family_is_one_config_and_one_persistence(monkeypatch):
    """Rows with another tile count class (persistent programs or not) or another config are
    another family: no plan is derived across them."""
    monkeypatch.setattr(kernel_mod, "num_sms", lambda device_index: 4)  # as without a GPU, on every machine
    w = randn(N, K, dtype=BF16, seed=2).t()[None]
    key = mm._plan_key(randn(1, 5, K, dtype=BF16), w, None, None, False)
    one_pass = gemm_plan.family_key(key, PLAIN, kernel_mod.persistent_at(PLAIN, 5, N, 1, None))
    persistent = gemm_plan.family_key(key, PLAIN, kernel_mod.persistent_at(PLAIN, 100, N, 1, None))
    other_cfg = gemm_plan.family_key(key, CFG, False)
    assert len({one_pass, persistent, other_cfg}) == 3
    assert gemm_plan.for_rows(key, persistent, 100) is None  # nothing remembered for that family


def test_a_split_k_plan_keeps_its_workspace_between_calls(compiled, monkeypatch):
    """Outside a capture a planned split-K call writes its partials to the buffer kept for its
    stream (no allocation per call): the GEMM stores to it and the sum reads it, call after call;
    the buffer must hold the partials' [splits, M, N] fp32. While a graph is captured each call
    gets a fresh workspace and nothing is kept."""
    workspace = importlib.import_module("zmrl.batch_invariant.triton._workspace")
    workspace.release()
    x, w = randn(1, M, K, dtype=BF16, seed=1), randn(N, K, dtype=BF16, seed=2)
    monkeypatch.setattr(workspace, "_may_keep", lambda device: True)  # a CUDA call outside a capture
    *_, plan_main, plan_sum, _, plan, _ = _full_and_plan(monkeypatch, compiled, x, w.t()[None], None, "kept ws")
    plan.run(x, w.t()[None], None, plan.out_shape)
    (kept,) = workspace._KEPT.values()
    assert kept.dtype == torch.float32 and kept.numel() >= CFG.split_k * M * N
    for main_args, sum_args in zip(plan_main, plan_sum):  # both calls: the GEMM's c_desc and c_ptr, the sum's input
        assert main_args[_WS][1] == kept.data_ptr() and sum_args[BASE_ARGS] == kept.data_ptr()
    # control: during a capture the plan allocates a workspace per call and keeps none
    workspace.release()
    monkeypatch.setattr(workspace, "_may_keep", lambda device: False)
    plan.run(x, w.t()[None], None, plan.out_shape)
    assert not workspace._KEPT
    launch.clear_tensor_maps()


def test_the_ladder_switch_is_part_of_every_plan_key(monkeypatch):
    """A call made after ZMRL_GEMM_LADDER changes selects its config afresh, never through a plan
    made under the other setting."""
    x, w = randn(M, K, dtype=BF16, seed=1), randn(N, K, dtype=BF16, seed=2)
    monkeypatch.delenv("ZMRL_GEMM_LADDER", raising=False)
    keys = (mm._plan_key(x[None], w.t()[None], None, None, False), mm._linear_key(x, w, None))
    assert keys == (mm._plan_key(x[None], w.t()[None], None, None, False), mm._linear_key(x, w, None))
    monkeypatch.setenv("ZMRL_GEMM_LADDER", "off")
    off = (mm._plan_key(x[None], w.t()[None], None, None, False), mm._linear_key(x, w, None))
    assert off[0] != keys[0] and off[1] != keys[1]


def test_a_row_split_plan_launches_each_part_as_the_full_path_does(monkeypatch, compiled_plain, compiled_sub_tiles):
    """A row split (whole waves of one tile, the rest through another, into one output) is planned
    per part: its plan launches each part with that part's rows of A and of the output, argument for
    argument what the full path launched for it, from a [1, M, K] operand and from linear's 2-D one."""
    jit_main, _ = _record_launches(monkeypatch)
    monkeypatch.setattr(kernel_mod, "num_sms", lambda device_index: 4)  # as without a GPU, on every machine
    m = 40  # 3 x 2 tiles of PLAIN on 4 SMs: 32 rows fill one wave, 8 rows are the tail
    split = dataclasses.replace(PLAIN, tail=SUB_TILES)
    parts = configs.row_parts(m, N, split, 4)
    assert [(lo, hi, cfg) for lo, hi, cfg in parts] == [(0, 32, PLAIN), (32, 40, SUB_TILES)]
    x, w, bias = randn(1, m, K, dtype=BF16, seed=1), randn(N, K, dtype=BF16, seed=2).t()[None], randn(N, dtype=BF16)
    out_full = torch.empty(1, m, N, dtype=BF16)
    full_calls, plan_calls, part_plans = [], [], []
    for lo, hi, cfg in parts:  # as matmul's row split calls gemm for each part
        kernel = compiled_plain if cfg is PLAIN else compiled_sub_tiles
        rows_x, rows_out = kernel_mod.row_views(x, out_full, lo, hi)
        launched = kernel_mod.launch_config(rows_x, w, bias, cfg, False, rows_out)
        _triton_launch(_stand_in(kernel, full_calls), *jit_main.calls[-1])
        gemm_plan.remember(("part", lo), dataclasses.replace(launched, main=_stand_in(kernel, plan_calls)), BF16,
                           x.device)
        part_plans.append((lo, hi, gemm_plan.PLANS.pop(("part", lo))))
    gemm_plan.remember_row_split("row split", part_plans, (1, m, N), K, BF16, x.device)
    plan = gemm_plan.PLANS.pop("row split")
    outs = [plan.run(x, w, bias, plan.out_shape), plan.run(x[0], w, bias, plan.out_2d)]
    assert outs[0].shape == (1, m, N) and outs[1].shape == (m, N)
    rows = {}
    for out in (out_full, *outs):
        rows.update({out.data_ptr() + lo * N * out.element_size(): f"out row {lo}" for lo, _, _ in parts})

    def named(args):
        return [named(a) if isinstance(a, tuple) else rows.get(a, a) if isinstance(a, int) else a for a in args]

    assert len(full_calls) == 2 and len(plan_calls) == 4
    assert [named(c) for c in plan_calls] == [named(c) for c in full_calls] * 2
    # control: a plan whose tail starts at row 0 hands its launch other rows of A and of the output
    wrong = gemm_plan.RowSplitPlan([part_plans[0], (0, 8, part_plans[1][2])], (1, m, N), K, BF16, x.device)
    out_wrong = wrong.run(x, w, bias, wrong.out_shape)
    rows.update({out_wrong.data_ptr() + lo * N * out_wrong.element_size(): f"out row {lo}" for lo, _, _ in parts})
    assert named(plan_calls[-2]) == named(full_calls[0]) and named(plan_calls[-1]) != named(full_calls[1])
    launch.clear_tensor_maps()
