"""Split-K GEMM (narrow shapes) and the launch plans: row invariance, the fixed summation
order, and equality of planned launches with the full path.

On CPU the kernels run under the interpreter on scaled-down shapes (BLOCK_K 32 there, so K
ranges of 96 columns); the `gpu` tests run the configured narrow shapes on the H200.
"""
import dataclasses
import importlib
import inspect

import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant._paths import use_path

from tests.batch_invariant.triton._util import randn, rel_err, variant_rows

mm = importlib.import_module("zmrl.batch_invariant.triton.matmul")
splitk = importlib.import_module("zmrl.batch_invariant.triton._splitk")
gemm_plan = importlib.import_module("zmrl.batch_invariant.triton._gemm_plan")
configs = importlib.import_module("zmrl.batch_invariant.triton._gemm_config")
ladder = importlib.import_module("zmrl.batch_invariant.triton._gemm_ladder")
kernel_mod = importlib.import_module("zmrl.batch_invariant.triton._gemm_kernel")

BF16 = torch.bfloat16
SIZES = (1, 2, 3, 15, 16, 17, 33)  # one, two and three 16-row tiles (the interpreter's BLOCK_M)
N, K = 48, 200  # three K ranges of 96, 96, 8 columns at BLOCK_K 32


def _cfg(split: int, dtype: torch.dtype = torch.float32) -> mm.MMConfig:
    """The data's own dtype's config (an fp32 GEMM in a bf16 config's tiles overflows shared
    memory on an H200) with the split forced."""
    return dataclasses.replace(mm.config_for(N, K, dtype), split_k=split)


def test_k_chunk_reads_only_k_and_covers_it():
    assert list(inspect.signature(splitk.k_chunk).parameters) == ["k", "splits", "align"]
    for k in (1, 7, 200, 1536, 7168, 7169):
        for splits in (1, 2, 3, 4, 7):
            for align in (16, 32, 64, 1024):
                chunk = splitk.k_chunk(k, splits, align)
                eff = splitk.effective_splits(k, splits, align)
                assert chunk % align == 0 and 1 <= eff <= splits
                assert (eff - 1) * chunk < k <= eff * chunk  # every split holds data; together all of K
    assert splitk.effective_splits(7168, 4, 1024) == 4 and splitk.k_chunk(7168, 4, 1024) == 2048


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_split_k_matches_float64_with_bias(dev, dtype):
    x = randn(17, K, dtype=dtype, device=dev, seed=1)
    w = randn(N, K, dtype=dtype, device=dev, seed=2, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, device=dev, seed=3)
    got = mm.gemm(x[None], w.t()[None], bias, _cfg(3, dtype))[0]
    ref = (x.double() @ w.double().t()).to(dtype).double() + bias.double()
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_split_k_bmm_n_major_matches_float64(dev):
    # batched, N-major B: K is zero-padded per batch entry to a BLOCK_K multiple
    a = randn(3, 5, K - 3, seed=4, device=dev)
    b = randn(3, K - 3, N, seed=5, device=dev)
    got = mm.gemm(a, b, None, _cfg(3))
    assert rel_err(got, a.double() @ b.double()) < 1e-5


def test_partials_are_summed_in_one_fixed_order(dev):
    # the sum kernel against the same additions done by torch in the order p0 + p1 + p2; p1 and
    # p2 nearly cancel, so the other grouping p0 + (p1 + p2) gives other bits
    p = randn(3, 5, N, seed=6, device=dev)
    p[1] = p[1] * 1e8
    p[2] = p[2] - p[1]
    out = torch.empty(1, 5, N, device=dev)
    splitk.sum_partials(p, out, None, 3)
    assert torch.equal(out[0], (p[0] + p[1]) + p[2])
    assert not torch.equal(out[0], p[0] + (p[1] + p[2])), "the data cannot tell the orders apart"


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_rows_are_batch_invariant(dev, split, dtype):
    pool = randn(24, K, dtype=dtype, device=dev, seed=7)
    w = randn(N, K, dtype=dtype, device=dev, seed=8, scale=0.1)
    cfg = dataclasses.replace(mm.config_for(N, K, dtype), split_k=split)
    bad = variant_rows(lambda x: mm.gemm(x[None], w.t()[None], None, cfg)[0], pool, SIZES)
    assert not bad, "\n".join(bad[:5])


def test_negative_control_a_split_count_that_depends_on_m_is_batch_variant(dev):
    # fp32 output: a changed summation order shows in the last bits (bf16 rounding hides most)
    f32 = torch.float32
    pool = randn(24, K, dtype=f32, device=dev, seed=7)
    w = randn(N, K, dtype=f32, device=dev, seed=8, scale=0.1)
    cfgs = {s: dataclasses.replace(mm.config_for(N, K, f32), split_k=s) for s in (1, 3)}
    by_m = lambda x: mm.gemm(x[None], w.t()[None], None, cfgs[1 if x.shape[0] == 1 else 3])[0]  # noqa: E731
    assert variant_rows(by_m, pool, SIZES), "splitting K did not change a single bit: the test cannot see order"


def test_public_linear_takes_the_shapes_split_and_stays_invariant(dev, monkeypatch):
    split_cfg = _cfg(3)
    monkeypatch.setattr(ladder, "config_for", lambda n, k, dtype: split_cfg)
    pool = randn(24, K, device=dev, seed=9)  # fp32: the split's other order shows in the last bits
    w = randn(N, K, device=dev, seed=10, scale=0.1)
    with use_path("triton"):
        import zmrl.batch_invariant as bi

        bad = variant_rows(lambda x: bi.linear(x, w), pool, SIZES)
        assert not bad, "\n".join(bad[:5])
        assert torch.equal(bi.linear(pool, w), mm.gemm(pool[None], w.t()[None], None, split_cfg)[0])
        assert not torch.equal(bi.linear(pool, w), mm.gemm(pool[None], w.t()[None], None, _cfg(1))[0])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (torch.equal alone would take -0.0 for +0.0)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_an_in_program_split_gives_the_two_kernel_splits_bits(dev, dtype):
    # one program reducing the K ranges one after another vs one program per range plus the sum
    # kernel: the same fp32 additions in the same order
    x = randn(17, K, dtype=dtype, device=dev, seed=11)
    w = randn(N, K, dtype=dtype, device=dev, seed=12, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, device=dev, seed=13)
    inline = lambda split: dataclasses.replace(_cfg(split, dtype), split_inline=True)  # noqa: E731
    for split in (2, 3):
        for b in (None, bias):
            two_kernels = mm.gemm(x[None], w.t()[None], b, _cfg(split, dtype))
            assert torch.equal(_bits(mm.gemm(x[None], w.t()[None], b, inline(split))), _bits(two_kernels))
    a3 = randn(3, 5, K - 3, dtype=dtype, device=dev, seed=14)  # batched, N-major B (K padded per entry)
    b3 = randn(3, K - 3, N, dtype=dtype, device=dev, seed=15)
    assert torch.equal(_bits(mm.gemm(a3, b3, None, inline(3))), _bits(mm.gemm(a3, b3, None, _cfg(3, dtype))))
    if dtype == torch.float32:  # control: in-program ranges of another split count give other bits
        assert not torch.equal(mm.gemm(x[None], w.t()[None], None, inline(2)),
                               mm.gemm(x[None], w.t()[None], None, _cfg(3)))


def test_in_program_split_rows_are_batch_invariant(dev):
    pool = randn(24, K, device=dev, seed=16)
    w = randn(N, K, device=dev, seed=17, scale=0.1)
    cfg = dataclasses.replace(_cfg(3), split_inline=True)
    bad = variant_rows(lambda x: mm.gemm(x[None], w.t()[None], None, cfg)[0], pool, SIZES)
    assert not bad, "\n".join(bad[:5])


def _sub_tiled(cfg: mm.MMConfig, sub_n: int) -> mm.MMConfig:
    """cfg's tile as sub_n side-by-side sub-tiles of 16 columns (N = 48: one tile of 3, or one
    full and one half-empty tile of 2)."""
    return dataclasses.replace(cfg, block_n=16, sub_n=sub_n)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("sub_n", [2, 3])
def test_column_sub_tiles_give_the_one_tile_bits(dev, dtype, sub_n):
    # a program computing 2 or 3 sub-tiles that share each A tile vs one sub-tile per program:
    # unsplit, K ranges by separate programs and in one program, with and without the bias, a
    # batched N-major B, and N = 40 (a last tile partly past N)
    x = randn(17, K, dtype=dtype, device=dev, seed=70)
    bias = randn(N, dtype=dtype, device=dev, seed=72)
    for n in (N, 40):
        w = randn(n, K, dtype=dtype, device=dev, seed=71, scale=K ** -0.5)
        for split, inline in ((1, False), (3, False), (3, True)):
            one = dataclasses.replace(_cfg(split, dtype), block_n=16, split_inline=inline)
            for b in (None, bias[:n]):
                want = mm.gemm(x[None], w.t()[None], b, one)
                got = mm.gemm(x[None], w.t()[None], b, _sub_tiled(one, sub_n))
                assert torch.equal(_bits(got), _bits(want)), (n, split, inline, b is None)
    a3 = randn(3, 5, K - 3, dtype=dtype, device=dev, seed=73)
    b3 = randn(3, K - 3, N, dtype=dtype, device=dev, seed=74)
    one = dataclasses.replace(_cfg(3, dtype), block_n=16)
    assert torch.equal(_bits(mm.gemm(a3, b3, None, _sub_tiled(one, sub_n))), _bits(mm.gemm(a3, b3, None, one)))
    if dtype == torch.float32:  # control: the same sub-tiles over another partition of K give other bits
        w = randn(N, K, dtype=dtype, device=dev, seed=71, scale=K ** -0.5)
        other = _sub_tiled(dataclasses.replace(_cfg(2, dtype), block_n=16), sub_n)
        assert not torch.equal(mm.gemm(x[None], w.t()[None], None, other),
                               mm.gemm(x[None], w.t()[None], None, _sub_tiled(one, sub_n)))


def test_column_sub_tile_rows_are_batch_invariant(dev):
    pool = randn(24, K, device=dev, seed=75)
    w = randn(N, K, device=dev, seed=76, scale=0.1)
    cfg = _sub_tiled(dataclasses.replace(_cfg(3), split_inline=True), 3)
    bad = variant_rows(lambda x: mm.gemm(x[None], w.t()[None], None, cfg)[0], pool, SIZES)
    assert not bad, "\n".join(bad[:5])


@pytest.mark.parametrize("sub_n", [0, 4])
def test_a_sub_tile_count_the_kernel_lacks_is_refused(sub_n):
    bad = mm.MMConfig(16, 16, 32, sub_n=sub_n)
    with pytest.raises(ValueError, match=f"sub_n={sub_n}: the GEMM kernel computes 1, 2 or 3"):
        mm.gemm(randn(1, 4, K), randn(1, K, N), None, bad)
    with pytest.raises(ValueError, match=f"sub_n={sub_n}"):
        configs.banded(mm.MMConfig(16, 32, 32, split_k=3, k_align=32), [(None, bad)])


def test_sub_tiles_count_as_their_columns_in_the_fill_rule_and_the_grid(monkeypatch):
    wide = mm.MMConfig(64, 64, 64, sub_n=3)
    assert configs.tile_n(wide) == 192 and configs.tile_name(wide) == "64x(3x64)x64"
    # 576 columns: 3 tiles of 192 per row tile against 9 of 64; the rule's 4/5 of 132 SMs takes 106
    # tiles: 36 row tiles of the wide tile, where 12 of the 64-column tile would do
    assert configs._fills(36 * 64, 576, wide, 132) and not configs._fills(35 * 64, 576, wide, 132)
    assert configs._fills(12 * 64, 576, dataclasses.replace(wide, sub_n=1), 132)
    # persistent once the tiles outnumber the SMs: 44 row tiles x 3 = 132 tiles do not, 45 x 3 do
    # (counted as 64-column tiles, 44 x 9 would)
    monkeypatch.setattr(kernel_mod, "num_sms", lambda device_index: 132)
    assert not kernel_mod.persistent_at(wide, 44 * 64, 576, 1, None)
    assert kernel_mod.persistent_at(wide, 44 * 64 + 1, 576, 1, None)


def test_the_ladder_reduces_in_program_where_the_tiles_fill_the_sms_unsplit():
    base = mm.MMConfig(64, 128, 64, num_warps=4, num_stages=4, split_k=4)
    for m in (1, 16, 32, 128, 256):  # few rows: the split's parallelism is what fills the SMs
        assert not configs._rung_for(m, 1536, base, 132).split_inline, m
    rung = configs._rung_for(1024, 1536, base, 132)  # 16 x 12 tiles of 64x128 fill 132 SMs unsplit
    assert rung.split_inline and rung.split_k == 4 and (rung.block_m, rung.block_n) == (64, 128)
    assert not configs._rung_for(1024, 1536, dataclasses.replace(base, split_k=1), 132).split_inline
    for n, sms in ((1536, 132), (576, 132), (576, 78), (24576, 132)):
        for split in (2, 4):
            b = dataclasses.replace(base, split_k=split)
            plan = mm.ladder_plan(n, b, sms)
            for m in range(1, 9000, 7):
                rung = configs._rung_for(m, n, b, sms)
                owners = [cfg for cfg, lo, hi in plan if lo <= m and (hi is None or m <= hi)]
                assert owners == ([] if rung == b else [rung]), (n, sms, split, m)


def test_the_ladder_keeps_a_shapes_split():
    base = mm.MMConfig(128, 128, 64, num_warps=4, num_stages=4, split_k=4)
    for m in (1, 16, 17, 32, 33, 64, 256, 1024, 8192):
        rung = configs._rung_for(m, 1536, base, 132)
        assert rung.split_k == 4, (m, rung)
    for cfg, lo, hi in mm.ladder_plan(1536, base, 132):
        assert cfg.split_k == 4 and cfg != base
    # every rung's BLOCK_K divides the K range, so rungs split K where the fixed config does
    align = configs.split_align(BF16, base) if not tri.INTERPRET else 1024
    assert all(align % c.block_k == 0 for c in configs._LADDER + configs._SMALL_LADDER + configs._MID_LADDER)


def _banded_small() -> mm.MMConfig:
    """A measured-bands entry on the interpreter's scale: ranges of 96, 96 and 8 columns (32-
    aligned), each band's rung another tile or reduction (separate programs, then one program
    over tiles of two 16-column sub-tiles).
    BLOCK_K stays 32: the interpreter's dot sums a whole K block in numpy's order, so there, unlike
    in a GPU's 16-deep tensor-core steps, a deeper block is another order."""
    base = mm.MMConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1, split_k=3, k_align=32)
    return configs.banded(base, [
        (2, mm.MMConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=1)),
        (16, mm.MMConfig(16, 64, 32, group_m=2, num_warps=4, num_stages=1)),
        (None, mm.MMConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=1, split_inline=True, sub_n=2)),
    ])


def test_measured_bands_pick_one_rung_per_m_and_keep_the_split():
    base = _banded_small()
    plan = mm.ladder_plan(N, base, 132)
    assert [(lo, hi) for _, lo, hi in plan] == [(1, 2), (3, 16), (17, None)]
    for m in range(1, 300):
        rung = configs._rung_for(m, N, base, 132)
        owners = [cfg for cfg, lo, hi in plan if lo <= m and (hi is None or m <= hi)]
        assert owners == [rung] and rung.split_k == 3 and rung.k_align == 32, m
        assert configs.split_align(torch.float32, rung) == 32
    assert configs._rung_for(17, N, base, 132).split_inline and not configs._rung_for(16, N, base, 132).split_inline


def test_a_band_that_runs_the_fixed_tile_is_not_a_rung():
    base = mm.MMConfig(16, 32, 32, split_k=3, k_align=96)
    small = mm.MMConfig(16, 16, 32)
    entry = configs.banded(base, [(8, small), (16, base), (None, small)])
    assert [(lo, hi) for _, lo, hi in mm.ladder_plan(N, entry, 132)] == [(1, 8), (17, None)]  # nothing to self-check
    assert configs._rung_for(12, N, entry, 132) is entry  # the public path takes the fixed config as it is
    assert configs._rung_for(8, N, entry, 132) != entry and configs._rung_for(17, N, entry, 132) != entry  # control


@pytest.mark.parametrize("bands,error", [
    ([(16, mm.MMConfig(16, 16, 32))], "end with None"),
    ([(16, mm.MMConfig(16, 16, 32)), (8, mm.MMConfig(16, 32, 32)), (None, mm.MMConfig(16, 16, 32))], "ascend"),
    ([(None, mm.MMConfig(16, 16, 64))], "BLOCK_K 64 does not divide the K alignment 96"),
])
def test_measured_bands_reject_a_bad_table(bands, error):
    base = mm.MMConfig(16, 32, 32, split_k=3, k_align=96)
    with pytest.raises(ValueError, match=error):
        configs.banded(base, bands)


@pytest.mark.parametrize("k_align", [0, 48])
def test_measured_bands_need_a_split_base_with_a_k_alignment(k_align):
    base = mm.MMConfig(16, 32, 32, split_k=3, k_align=k_align)
    with pytest.raises(ValueError, match=f"a split base needs a K alignment .*k_align={k_align}"):
        configs.banded(base, [(None, mm.MMConfig(16, 16, 16))])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_every_bands_rung_gives_the_fixed_configs_bits(dev, dtype):
    base = _banded_small()
    x = randn(40, K, dtype=dtype, device=dev, seed=60)
    w = randn(N, K, dtype=dtype, device=dev, seed=61, scale=K ** -0.5)
    fixed = mm.gemm(x[None], w.t()[None], None, base)
    for m in (1, 2, 3, 16, 17, 40):
        rung = configs._rung_for(m, N, base, 132)
        got = mm.gemm(x[None, :m], w.t()[None], None, rung, configs.pads_rows(m, rung))
        assert torch.equal(_bits(got), _bits(fixed[:, :m])), m
    if dtype == torch.float32:  # control: another partition of K (2 ranges) gives other bits
        other = dataclasses.replace(base, split_k=2, bands=())
        assert not torch.equal(mm.gemm(x[None], w.t()[None], None, other), fixed)


def test_the_narrow_table_entries_split_k_alike_in_every_band():
    for (dtype, n, k), base in configs.TUNED.items():
        for hi, rung in base.bands:
            assert (rung.split_k, rung.k_align) == (base.split_k, base.k_align), (n, k, hi)
            if base.split_k > 1:
                assert base.k_align % rung.block_k == 0 and base.k_align % base.block_k == 0
                assert splitk.effective_splits(k, base.split_k, base.k_align) == base.split_k, (n, k)
                if not rung.split_inline:
                    assert configs._split_smem(rung, rung.num_stages) <= configs._SPLIT_SMEM_BUDGET


# ----------------------------------------------------------------------------- GPU
NARROW = [(576, 7168), (1536, 7168), (24576, 1536)]
GPU_M = (1, 2, 3, 8, 16, 17, 31, 32, 33, 64, 100, 150, 255, 256, 257, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", NARROW)
def test_gpu_narrow_linear_is_invariant(n, k):
    pool = randn(64, k, dtype=BF16, device="cuda", seed=20)
    w = randn(n, k, dtype=BF16, device="cuda", seed=21, scale=k ** -0.5)
    bad = variant_rows(lambda x: tri.linear(x, w), pool, GPU_M)
    assert not bad, "\n".join(bad[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [576, 1536])
def test_gpu_in_program_split_gives_the_two_kernel_splits_bits(n):
    k = 7168
    base = dataclasses.replace(mm.MMConfig(64, 128, 64, num_warps=4, num_stages=4), split_k=4)
    x = randn(1024, k, dtype=BF16, device="cuda", seed=22)
    w = randn(n, k, dtype=BF16, device="cuda", seed=23, scale=k ** -0.5)
    bias = randn(n, dtype=BF16, device="cuda", seed=24)
    rung = configs._rung_for(1024, n, base, torch.cuda.get_device_properties(0).multi_processor_count)
    assert rung.split_inline, rung
    for m in (1024, 300, 64):
        for b in (None, bias):
            got = mm.gemm(x[None, :m], w.t()[None], b, rung, configs.pads_rows(m, rung))
            assert torch.equal(_bits(got), _bits(mm.gemm(x[None, :m], w.t()[None], b, base))), (m, b is None)
    # control: the unsplit kernel (another fixed order) gives other bits
    assert not torch.equal(mm.gemm(x[None], w.t()[None], None, rung),
                           mm.gemm(x[None], w.t()[None], None, dataclasses.replace(base, split_k=1)))


@pytest.mark.gpu
@pytest.mark.parametrize("inline", [False, True], ids=["programs", "in-program"])
@pytest.mark.parametrize("n", [576, 1536])
def test_gpu_sub_tiled_rungs_give_the_fixed_configs_bits(n, inline):
    """Tiles of three 64-column sub-tiles (192 columns) over the table's K partition of a narrow
    shape, K ranges by separate programs or in one: the fixed config's bits at every M."""
    k = 7168
    base = dataclasses.replace(mm.config_for(n, k, BF16), bands=())
    assert base.split_k == 4
    x = randn(1024, k, dtype=BF16, device="cuda", seed=25)
    w = randn(n, k, dtype=BF16, device="cuda", seed=26, scale=k ** -0.5)
    bias = randn(n, dtype=BF16, device="cuda", seed=27)
    for tile in (mm.MMConfig(64, 64, 64, num_warps=4, num_stages=4, sub_n=3, split_inline=inline),
                 mm.MMConfig(128, 64, 64, num_warps=8, num_stages=3, sub_n=3, split_inline=inline)):
        rung = configs.banded(base, [(None, tile)]).bands[0][1]
        for m in (1024, 300, 64, 5):
            for b in (None, bias):
                got = mm.gemm(x[None, :m], w.t()[None], b, rung, configs.pads_rows(m, rung))
                want = mm.gemm(x[None, :m], w.t()[None], b, base)
                assert torch.equal(_bits(got), _bits(want)), (configs.tile_name(rung), m, b is None)
    # control: the sub-tiles over the unsplit K loop (another fixed order) give other bits
    unsplit = dataclasses.replace(rung, split_k=1, split_inline=False, k_align=0)
    assert not torch.equal(mm.gemm(x[None], w.t()[None], None, unsplit), mm.gemm(x[None], w.t()[None], None, base))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 1536, 7168, False), (40, 4096, 4096, True), (300, 576, 7168, True),
                                         (7, 48, 200, False), (33, 7168, 2048, False)])
def test_gpu_planned_launch_gives_the_full_paths_bits(dtype, m, n, k, bias):
    """The second call of a kind goes through its launch plan (direct launch, cached tensor
    maps); it must give the first call's bits, for new tensors at other addresses too."""
    gemm_plan.clear()
    x = randn(m, k, dtype=dtype, device="cuda", seed=30)
    w = randn(n, k, dtype=dtype, device="cuda", seed=31, scale=k ** -0.5)
    b = randn(n, dtype=dtype, device="cuda", seed=32) if bias else None
    first = tri.linear(x, w, b)
    assert any(p is not None for p in gemm_plan.PLANS.values()), "no launch plan was made"
    for _ in range(3):
        x2, w2 = x.clone(), w.clone()
        assert torch.equal(tri.linear(x2, w2, None if b is None else b.clone()), first)
        assert torch.equal(tri.matmul(x2, w2.t()), tri.linear(x, w) if b is None else tri.matmul(x, w.t()))
    # a control that the comparison can fail: other weights give other bits through the same plan
    assert not torch.equal(tri.linear(x, w * 2 + 1, b), first)


@pytest.mark.gpu
def test_gpu_planned_launch_is_used_and_direct():
    from zmrl.batch_invariant.triton._launch import direct_launch_status

    gemm_plan.clear()
    x = randn(8, 4096, dtype=BF16, device="cuda", seed=40)
    w = randn(4096, 4096, dtype=BF16, device="cuda", seed=41)
    tri.linear(x, w)
    assert direct_launch_status().get("gemm") == "direct", direct_launch_status()
    # a split-K shape (1536 x 7168 in bf16): the partial GEMM and the fixed-order sum, both planned
    assert mm.config_for(1536, 7168, BF16).split_k > 1
    w = randn(1536, 7168, dtype=BF16, device="cuda", seed=42)
    x = randn(16, 7168, dtype=BF16, device="cuda", seed=43)
    first = tri.linear(x, w)
    assert direct_launch_status().get("splitk_sum") == "direct", direct_launch_status()
    plans = [p for p in gemm_plan.PLANS.values() if p is not None and p.splits > 1]
    assert plans, "the split-K call made no launch plan"
    assert torch.equal(tri.linear(x.clone(), w), first)


@pytest.mark.gpu
@pytest.mark.parametrize("pitch", [64, 67], ids=["in-place", "copied"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("t", [1, 37, 4096])
def test_gpu_plan_of_a_head_batched_call_gives_the_full_paths_bits(dtype, t, pitch):
    """The MLA LoRA products: bmm over heads of a transposed activation [T, H, d] and a head
    slice of B [H, d + v, r], as the adapter calls it. Both are read in place through 3-D
    descriptors; an activation whose row pitch no descriptor takes (67 elements) is copied first,
    and so is it by the call's plan. The plan must give the full path's bits, for new tensors at
    other addresses too."""
    heads, nope, v, r = 16, 64, 64, 8
    full = randn(t, heads, pitch, dtype=dtype, device="cuda", seed=50)
    q = full[..., :nope]
    b = randn(heads, nope + v, r, dtype=dtype, device="cuda", seed=51)
    gemm_plan.clear()
    first = tri.bmm(q.transpose(0, 1), b[:, :nope])
    plans = [p for p in gemm_plan.PLANS.values() if p is not None]
    assert plans and plans[0].prep_b is None and (plans[0].prep_a is not None) == (pitch == 67), gemm_plan.PLANS
    for _ in range(3):
        q2, b2 = q.clone(), b.clone()  # compact clones (for the 67 pitch: other strides, another plan)
        assert torch.equal(tri.bmm(q2.transpose(0, 1), b2[:, :nope]), first)
        q3 = torch.empty_like(full)[..., :nope].copy_(q)  # the first call's strides at a new address
        assert torch.equal(tri.bmm(q3.transpose(0, 1), b2[:, :nope]), first)
    assert len(gemm_plan.PLANS) == (1 if pitch == nope else 2)  # the same plans each time
    # the full path again (no plan) gives those bits; other values give other bits (a control)
    gemm_plan.clear()
    assert torch.equal(tri.bmm(q.transpose(0, 1), b[:, :nope]), first)
    assert not torch.equal(tri.bmm(q.transpose(0, 1), b[:, nope:]), first)


@pytest.mark.parametrize("split", [1, 3])
def test_a_plan_repeats_the_jit_launchs_arguments_in_the_kernels_order(monkeypatch, split):
    """What _run records for a launch plan (integers, then constexprs) is exactly what it passed
    to the JIT, in the kernel's parameter order: the plan hands Triton's C launcher that list."""
    seen = {}

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
                return "compiled"
            return launch

    real = kernel_mod._mm_kernel
    monkeypatch.setattr(kernel_mod, "_mm_kernel", FakeKernel())
    monkeypatch.setattr(kernel_mod, "INTERPRET", False)
    monkeypatch.setattr(configs, "INTERPRET", False)  # the K ranges' GPU alignment
    monkeypatch.setattr(kernel_mod, "sum_partials", lambda *a: "compiled sum")
    x = randn(1, 5, 3000, dtype=BF16)  # K ranges of 1024 (the GPU alignment): 3 splits hold data
    w = randn(48, 3000, dtype=BF16)
    cfg = dataclasses.replace(mm.MMConfig(16, 32, 32, num_warps=4, num_stages=1), split_k=split)
    out = torch.empty(1, 5, 48, dtype=BF16)
    launched = kernel_mod.launch_config(x, w.t()[None], None, cfg, False, out)
    params = list(inspect.signature(real.fn).parameters)
    consts = [p for p in params[13:]]
    assert list(seen["kwargs"])[:len(consts)] == consts and len(seen["args"]) == 13
    assert launched.ints == seen["args"][5:13] and launched.consts == tuple(seen["kwargs"][c] for c in consts)
    assert launched.direct and launched.splits == split and launched.ints[3] == (1024 if split > 1 else 3000)
    assert launched.progs == seen["grid"][0] and launched.total == ("compiled sum" if split > 1 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 1024), (576, 7168), (24576, 1536)])
def test_gpu_a_plan_made_at_one_row_count_gives_the_full_paths_bits_at_others(monkeypatch, dtype, n, k):
    """A minibatch of another token count reuses the plan of its row family (Plan.at_rows); every M
    must give the bits its own full-path call gives, and at least some Ms must take the derived plan."""
    derived = []
    at_rows = gemm_plan.Plan.at_rows
    monkeypatch.setattr(gemm_plan.Plan, "at_rows", lambda self, m: derived.append(m) or at_rows(self, m))
    x = randn(7400, k, dtype=dtype, device="cuda", seed=60)
    w = randn(n, k, dtype=dtype, device="cuda", seed=61, scale=k ** -0.5)
    rows = (7391, 7400, 6913, 4096, 4100, 1500, 257, 256, 200, 129, 64, 33, 17, 5, 1)
    full = {}
    for m in rows:  # each M's own first call: the full path
        gemm_plan.clear()
        full[m] = tri.linear(x[:m], w)
    gemm_plan.clear()
    for m in rows:  # one pass over the Ms, plans kept: later Ms of a family derive theirs
        assert torch.equal(tri.linear(x[:m].clone(), w), full[m]), m
    assert derived, "no call took a plan made at another row count"
    # control that the comparison can fail: other weights through the same derived plan
    m = derived[-1]
    assert not torch.equal(tri.linear(x[:m].clone(), w * 2 + 1), full[m])


@pytest.mark.gpu
def test_gpu_kept_workspace_serves_back_to_back_calls_and_two_streams():
    """Planned split-K calls queued back to back without a sync, on one stream and then
    alternating between two streams, write their partials to the kept workspaces: every output
    equals the same call made alone with a fresh workspace."""
    workspace = importlib.import_module("zmrl.batch_invariant.triton._workspace")
    assert mm.config_for(1536, 7168, BF16).split_k > 1
    w = randn(1536, 7168, dtype=BF16, device="cuda", seed=50, scale=7168 ** -0.5)
    xs = [randn(m, 7168, dtype=BF16, device="cuda", seed=51 + i) for i, m in enumerate((16, 256, 16, 256, 16, 256))]
    alone = []
    for x in xs:
        gemm_plan.clear()  # no plan, no kept buffer: the full path and a fresh workspace
        alone.append(tri.linear(x, w))
        torch.cuda.synchronize()
    for x in xs[:2]:
        tri.linear(x, w)  # plans for both row counts
    assert workspace._KEPT, "a planned split-K call kept no workspace"
    outs = [tri.linear(x, w) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    on_streams = []
    for i, x in enumerate(xs):
        with torch.cuda.stream(streams[i % 2]):
            on_streams.append(tri.linear(x, w))
    torch.cuda.synchronize()
    assert len({stream for _, stream, _ in workspace._KEPT}) == 3
    for i, want in enumerate(alone):
        assert torch.equal(outs[i], want), f"call {i}, one stream"
        assert torch.equal(on_streams[i], want), f"call {i}, two streams"
    assert not torch.equal(tri.linear(xs[0], w * 2), alone[0])  # control: the comparison sees other values


@pytest.mark.gpu
def test_gpu_a_captured_split_k_call_owns_its_workspace():
    """A split-K call captured in a CUDA graph gets a workspace of its own, not the kept buffer
    (eager calls may regrow that, freeing the old one, between replays)."""
    workspace = importlib.import_module("zmrl.batch_invariant.triton._workspace")
    w = randn(1536, 7168, dtype=BF16, device="cuda", seed=60, scale=7168 ** -0.5)
    x_in = randn(16, 7168, dtype=BF16, device="cuda", seed=61)
    x_next = randn(16, 7168, dtype=BF16, device="cuda", seed=62)
    want = tri.linear(x_next, w)  # also makes the plan
    workspace.release()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        y = tri.linear(x_in, w)
    assert not workspace._KEPT, "the captured call used a kept workspace"
    tri.linear(randn(256, 7168, dtype=BF16, device="cuda", seed=63), w)  # an eager call keeps (and grows) a buffer
    assert workspace._KEPT
    x_in.copy_(x_next)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
