"""KeyedLaunch on any machine: the grouped expert GEMM's calls after the first of a kind reach
Triton's C launcher with exactly the arguments Triton's own launch path hands it (descriptors
expanded to CUtensorMap, shape and strides; tensors as addresses; the constexprs), and a call
whose specialization differs goes back through Triton's JIT.

No GPU: the JIT kernel is a stand-in that records its calls and returns a compiled kernel whose
C launcher records its arguments, wrapped by Triton's own descriptor expansion
(`wrap_handle_tensordesc`); the CUtensorMap encoder records what it was asked to encode. The
`gpu` test in tests/batch_invariant/triton/test_triton_moe_lora.py compares bits on the H200.
"""
import functools
import importlib
import types

import pytest
import torch
import triton

from tests.batch_invariant.triton._util import randn
from tests.batch_invariant.triton.test_triton_moe_schedule import torch_groups
from tests.bitwise import assert_bitwise

launch = importlib.import_module("zmrl.batch_invariant.triton._launch")
grouped = importlib.import_module("zmrl.batch_invariant.triton.grouped")
moe = importlib.import_module("zmrl.batch_invariant.triton.moe")

BF16 = torch.bfloat16
BASE_ARGS = 13  # grid x/y/z, stream, function, cooperative, PDL, 2 scratch, packed metadata, launch metadata, 2 hooks


def _signature(kernel, args, consts) -> dict:
    """The kernel's parameter types as Triton's launcher reads them (descriptors by block shape)."""
    sig = {}
    for name, a in zip(kernel.arg_names, args):
        if isinstance(a, launch.TensorDescriptor):
            sig[name] = f"tensordesc<bf16{list(a.block_shape)}>"
        elif isinstance(a, torch.Tensor):
            sig[name] = "*i32" if a.dtype == torch.int32 else "*bf16"
        else:
            sig[name] = "fp32" if isinstance(a, float) else "i32"
    sig.update({name: "constexpr" for name in consts})
    return sig


class _StandInJit:
    """Stands for the @triton.jit kernel: records every `kernel[grid](...)` and returns a compiled
    kernel whose C launcher records its arguments (Triton's descriptor expansion in front)."""

    def __init__(self, kernel):
        self.arg_names, self.constexprs = list(kernel.arg_names), []  # constexprs: as the JIT's, once called
        self.jit_calls, self.raw_calls = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            consts = {k: v for k, v in kwargs.items() if k in self.arg_names}
            self.constexprs = sorted(self.arg_names.index(k) for k in consts)
            meta = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=list(a.block_shape), fp4_padded=False)
                    for a in args if isinstance(a, launch.TensorDescriptor)]
            compiled = self._compiled(_signature(self, args, consts), meta)
            self.jit_calls.append((grid, args, consts))
            # what Triton's CudaLauncher then hands its `launch` (tensors: their addresses)
            bound = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args] + list(consts.values())
            compiled.run.launch(grid[0], grid[1], 1, 0, compiled.function, False, False, None, None,
                                compiled.packed_metadata, None, None, None, *bound)
            return compiled
        return run

    def _compiled(self, signature, meta):
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        raw = functools.partial(lambda *a: self.raw_calls.append(a))  # like the C launcher: no __code__
        run = types.SimpleNamespace(launch=wrap_handle_tensordesc(raw, signature, meta), global_scratch_size=0,
                                    profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
        return types.SimpleNamespace(run=run, metadata=types.SimpleNamespace(tensordesc_meta=meta),
                                     function="cu_function", packed_metadata=("packed",))


@pytest.fixture
def stand_in(monkeypatch):
    def fill_tma_descriptor(ptr, swizzle, elem_size, dtype, block, shape, strides, padding):
        return ("CUtensorMap", ptr, swizzle, elem_size, dtype, tuple(block), tuple(shape), tuple(strides), padding)

    driver = types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill_tma_descriptor))
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)
    monkeypatch.setattr(launch, "current_stream", lambda device_index: 0)
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "_KEYED", {})
    launch.clear_tensor_maps()
    jit = _StandInJit(grouped._rows_forward_kernel)
    monkeypatch.setattr(grouped, "_rows_forward_kernel", jit)
    return jit


def _operands(tokens: int, seed: int):
    """x [tokens * k rows grouped by expert, K], gate and up [E, N, K], the Groups of random ids."""
    g = torch.Generator().manual_seed(seed)
    e, n, k, top = 4, 32, 48, 2
    ids = torch.stack([torch.randperm(e, generator=g)[:top].sort().values for _ in range(tokens)])
    groups = torch_groups(ids, e, 16)  # torch ops: the stand-in launcher must see only rows_forward's launches
    return randn(tokens * top, k, seed=seed), randn(e, n, k, seed=seed + 1), randn(e, n, k, seed=seed + 2), groups


def _jit_then_direct(stand_in, first, second):
    grouped.rows_forward(first[0], first[1], first[3], w2=first[2])
    out = grouped.rows_forward(second[0], second[1], second[3], w2=second[2])
    return (*stand_in.raw_calls, out)


def _named_output(args: tuple, out: torch.Tensor) -> list:
    """The launcher's arguments with the call's own output address named (each call allocates one)."""
    return ["out" if x == out.data_ptr() else x for x in args[BASE_ARGS:]]


def test_a_repeated_call_reaches_the_c_launcher_with_tritons_own_arguments(stand_in):
    a = _operands(9, seed=1)
    b = _operands(13, seed=5)  # new row count, new addresses: the same specialization (no int is 1 or 16k)
    jit_args, direct_args, direct_out = _jit_then_direct(stand_in, a, b)
    assert len(stand_in.jit_calls) == 1  # the second call did not go through the JIT
    assert launch.direct_launch_status()["rows_forward"] == "direct"
    # what Triton's own launch would hand the C launcher for the second call
    stand_in.raw_calls.clear()
    launcher = next(iter(launch._KEYED.values()))
    launcher.plans.clear()
    triton_out = grouped.rows_forward(b[0], b[1], b[3], w2=b[2])
    (triton_args,) = stand_in.raw_calls
    assert len(stand_in.jit_calls) == 2
    assert direct_args[0] == triton_args[0] and direct_args[1] == triton_args[1]  # the grid
    assert _named_output(direct_args, direct_out) == _named_output(triton_args, triton_out)
    # control: the first call's arguments (other rows and addresses) differ from the second's
    assert jit_args[BASE_ARGS:] != triton_args[BASE_ARGS:]
    # the expansion holds each descriptor's CUtensorMap of the second call's operand
    maps = [x for x in direct_args[BASE_ARGS:] if isinstance(x, tuple) and x[0] == "CUtensorMap"]
    assert [m[1] for m in maps] == [b[0].data_ptr(), b[1].data_ptr(), b[2].data_ptr()]


def test_a_call_with_another_specialization_goes_through_the_jit(stand_in):
    a = _operands(9, seed=1)
    grouped.rows_forward(a[0], a[1], a[3], w2=a[2])
    x, gate, up, groups = _operands(8, seed=2)  # 8 tokens x 2 slots = 16 rows: divisible by 16
    grouped.rows_forward(x, gate, groups, w2=up)
    assert len(stand_in.jit_calls) == 2
    launcher = next(iter(launch._KEYED.values()))
    assert len(launcher.plans) == 2


def test_a_call_that_names_its_constexprs_out_of_order_gets_no_direct_launch(stand_in):
    a = _operands(9, seed=1)
    grouped.rows_forward(a[0], a[1], a[3], w2=a[2])
    (grid, args, consts), = stand_in.jit_calls
    keyed = launch.KeyedLaunch(stand_in, "rows_forward_shuffled")
    shuffled = dict(reversed(list(consts.items())))
    keyed(grid, args, shuffled)
    keyed(grid, args, shuffled)
    assert len(stand_in.jit_calls) == 3  # both calls through the JIT
    assert "constexpr" in launch.direct_launch_status()["rows_forward_shuffled"]


def _cuda_operands(tokens: int, seed: int):
    """The small preset's expert shapes (64 experts, top-6, hidden 1024, intermediate 256), bf16."""
    g = torch.Generator().manual_seed(seed)
    e, top, d, inter = 64, 6, 1024, 256
    ids = torch.stack([torch.randperm(e, generator=g)[:top].sort().values for _ in range(tokens)]).cuda()
    block_m = grouped.config_for(d, inter, BF16).block_m
    rows = tokens * top
    return dict(groups=moe.Groups(ids, e, block_m), xs=randn(rows, d, dtype=BF16, device="cuda", seed=seed),
                gate=randn(e, inter, d, dtype=BF16, device="cuda", seed=seed + 1, scale=d ** -0.5),
                up=randn(e, inter, d, dtype=BF16, device="cuda", seed=seed + 2, scale=d ** -0.5),
                down_t=randn(e, inter, d, dtype=BF16, device="cuda", seed=seed + 3, scale=inter ** -0.5),
                dy=randn(rows, d, dtype=BF16, device="cuda", seed=seed + 4))


def _grouped_calls(o) -> list[torch.Tensor]:
    """One call of each grouped kernel: the gated forward, an input gradient, a weight gradient."""
    h = grouped.rows_forward(o["xs"], o["gate"], o["groups"], w2=o["up"])
    dh = grouped.rows_backward(o["dy"], o["down_t"].transpose(1, 2), o["groups"])
    dw = grouped.expert_wgrad(dh, o["xs"], o["groups"], 64)
    return [h, dh, dw]


def _poison_the_allocator() -> None:
    """The caching allocator's free blocks filled with NaN: an output no kernel wrote shows."""
    torch.cuda.synchronize()
    block = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device="cuda")
    del block


@pytest.mark.gpu
def test_direct_launches_give_the_bits_of_tritons_launches_on_cuda():
    made_at, other = _cuda_operands(301, seed=0), _cuda_operands(517, seed=10)  # 1,806 and 3,102 rows
    launch.clear_keyed()
    _grouped_calls(made_at)  # Triton's JIT launches; the direct launchers are made from them
    plans = [p for launcher in launch._KEYED.values() for p in launcher.plans.values()]
    assert len(plans) == 3 and all(p is not None for p in plans), launch.direct_launch_status()
    _poison_the_allocator()
    direct = [_grouped_calls(made_at), _grouped_calls(other)]  # another row count, other addresses
    assert sum(len(launcher.plans) for launcher in launch._KEYED.values()) == 3  # no new key: all direct
    launch.clear_keyed()
    _poison_the_allocator()
    jit = [_grouped_calls(made_at)]
    launch.clear_keyed()
    jit.append(_grouped_calls(other))
    for ops, (d_outs, j_outs) in zip(("made at", "other"), zip(direct, jit)):
        for name, d, j in zip(("rows_forward", "rows_backward", "expert_wgrad"), d_outs, j_outs):
            assert not d.isnan().any(), f"{name} ({ops}): the direct launch left unwritten rows"
            assert_bitwise(d, j, f"{name} ({ops} rows)")
