"""The CPU GEMM's self-check and its exact fallback (zmrl/batch_invariant/cpu_gemm.py, exact_gemm.py).

The self-check must catch a row-variant GEMM (negative controls: MKL's own torch.mm on unpadded
rows, which is row-variant on the machines zmrl was measured on, and two deliberately variant
GEMMs that are variant on every machine); a shape whose check fails must then take the exact
GEMM, which gives invariant rows even where the "BLAS" underneath is variant.
"""
import logging

import pytest
import torch
import torch.nn.functional as F

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import assert_bitwise, count_variant_rows, torch_threads
from zmrl.batch_invariant import cpu_gemm
from zmrl.batch_invariant._tiles import LARGE_ROW_TILES, ROW_TILE, SMALL_ROW_TILE, bmm_tiles, mm_large_tiles, mm_tiles
from zmrl.batch_invariant.exact_gemm import exact_bmm, exact_mm

# the exact GEMM against float64: within one fp32 (bf16) rounding of the true value, plus the
# dropped low slices (below K * 2^-40 * max|a_row| * max|b_col|, ~1e-9 on these data)
# within one rounding of the output dtype: the float64 sum is rounded to fp32/bf16 once more, so a
# result may sit one ulp (2^-23 / 2^-7 relative at the bottom of a binade) from the correctly rounded one
EXACT_TOL = {torch.float32: dict(rtol=2**-23, atol=1e-8), torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}


def _data(k, n, dtype, rows=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(dtype), w.to(dtype)


def _k_split_when_many_rows(a, b):
    """Variant on every machine: above 40 rows it sums the two halves of K separately (as a
    BLAS that splits K across threads would)."""
    if a.shape[0] <= 40:
        return a @ b
    h = a.shape[1] // 2
    return a[:, :h] @ b[:h] + a[:, h:] @ b[h:]


def _reversed_k_at_odd_positions(a, b):
    """Variant on every machine, in the row's position only: odd rows of a call reduce K backwards."""
    out = mm_tiles(a, b)
    odd = torch.arange(a.shape[0]) % 2 == 1
    rows = [mm_tiles(a[i:i + 1].flip(1), b.flip(0)) for i in odd.nonzero()[:, 0].tolist()]
    if rows:
        out[odd] = torch.cat(rows)
    return out


# ----------------------------------------------------------------------------- the tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_tiles_is_one_fixed_shape_call_per_tile(dtype):
    """mm_tiles against its definition written out: rows zero-padded to whole tiles (at least
    min_tiles), one [tile, K] x [K, N] product per tile (bf16: torch.mm per tile; fp32: one bmm with
    the weight broadcast), the padding dropped. A transposed A is made dense first."""
    x, w = _data(96, 40, dtype, rows=70, seed=3)
    b = w.t()
    for tile in (SMALL_ROW_TILE, ROW_TILE):
        for rows in (1, tile - 1, tile, tile + 3, 2 * tile):
            for min_tiles in (1, 2):
                a = x[:rows]
                tiles = max(-(-rows // tile), min_tiles)
                padded = torch.zeros(tiles * tile, a.shape[1], dtype=dtype)
                padded[:rows] = a
                if dtype == torch.bfloat16:
                    want = torch.cat([torch.mm(padded[i * tile:(i + 1) * tile], b) for i in range(tiles)])
                else:
                    want = torch.bmm(padded.view(tiles, tile, -1), b.expand(tiles, *b.shape)).view(-1, b.shape[1])
                got = mm_tiles(a, b, tile, min_tiles=min_tiles)
                assert got.shape == (rows, b.shape[1]) and torch.equal(got, want[:rows]), (tile, rows, min_tiles)
                assert torch.equal(mm_tiles(a.t().contiguous().t(), b, tile, min_tiles=min_tiles), got)
    # control: the comparison sees a changed value (one row's input)
    a = x[:ROW_TILE].clone()
    a[3] += 1
    assert not torch.equal(mm_tiles(a, b), mm_tiles(x[:ROW_TILE], b))


# ----------------------------------------------------------------------------- the exact GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 48), (1000, 96), (4097, 33)])
def test_exact_gemm_matches_float64(dtype, k, n):
    x, w = _data(k, n, dtype, rows=40)
    ref = (x.double() @ w.double().t()).to(dtype)
    torch.testing.assert_close(exact_mm(x, w.t()), ref, **EXACT_TOL[dtype])
    b = torch.randn(3, k, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    a = x[:30].view(3, 10, k)
    torch.testing.assert_close(exact_bmm(a, b), (a.double() @ b.double()).to(dtype), **EXACT_TOL[dtype])


def test_exact_gemm_keeps_tiny_and_huge_rows_and_marks_non_finite_rows():
    x, w = _data(96, 40, torch.float32, rows=8)
    x[1] *= 2.0**-120  # near fp32's subnormal range
    x[2] *= 2.0**100
    x[3, 7] = float("inf")
    x[4, 0] = float("nan")
    out = exact_mm(x, w.t())
    finite = [0, 1, 2, 5, 6, 7]
    torch.testing.assert_close(out[finite], (x[finite].double() @ w.double().t()).float(), rtol=2**-23, atol=0)
    assert torch.isnan(out[3]).all() and torch.isnan(out[4]).all()
    assert_bitwise(exact_mm(x[finite], w.t()), out[finite], "finite rows next to non-finite ones")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_gemm_is_invariant_even_over_a_variant_blas(dtype, monkeypatch):
    # The exact GEMM hands the BLAS only exact partial sums; replace the BLAS's bmm with one
    # that splits K differently for every call size and the rows must not change a bit.
    x, w = _data(256, 48, dtype, rows=70)
    want = torch.cat([exact_mm(x[i:i + 1], w.t()) for i in range(70)])
    real_bmm = torch.bmm

    def k_split_bmm(a, b, out=None):
        h = 1 + a.shape[1] % (a.shape[2] - 1)
        return torch.add(real_bmm(a[..., :h], b[:, :h]), real_bmm(a[..., h:], b[:, h:]), out=out)

    monkeypatch.setattr(torch, "bmm", k_split_bmm)
    for m in (1, 3, 33, 70):
        assert_bitwise(exact_mm(x[:m], w.t()), want[:m], f"M={m}")


# ----------------------------------------------------------------------------- the self-check
def test_self_check_passes_the_exact_gemm_and_agrees_with_the_decision():
    _, w = _data(1000, 96, torch.float32)
    ok, detail, probes = cpu_gemm.check_rows(exact_mm, w.t(), torch.float32)
    assert ok, detail
    assert probes >= 10
    cpu_gemm.reset_decisions()
    bi.linear(torch.randn(3, 1000), w)
    (dec,) = [d for d in cpu_gemm.decisions() if (d["op"], d["k"], d["n"]) == ("mm", 1000, 96)]
    threads = torch.get_num_threads()
    plain_ok, _, _ = cpu_gemm.check_rows(mm_tiles, w.t(), torch.float32)
    padded_ok = threads > 1 and cpu_gemm.check_rows(cpu_gemm.tile_path("mm", threads), w.t(), torch.float32)[0]
    want = ("tiles", 1) if plain_ok else ("tiles", threads) if padded_ok else ("exact", 1)
    assert (dec["path"], dec["min_tiles"]) == want, dec
    assert dec["b_layout"] == "k_major" and dec["threads"] == threads


@pytest.mark.parametrize("variant", [_k_split_when_many_rows, _reversed_k_at_odd_positions])
def test_self_check_detects_a_variant_gemm(variant):
    _, w = _data(256, 48, torch.float32)
    ok, detail, _ = cpu_gemm.check_rows(variant, w.t(), torch.float32)
    assert not ok and "differ" in detail


def test_self_check_detects_mkl_mm_on_unpadded_rows():
    # torch.mm without the fixed tiles: MKL's fp32 GEMM changes kernels with M on the machines
    # zmrl was measured on (tests/batch_invariant/test_matmul.py's negative control)
    _, w = _data(1000, 96, torch.float32)
    with torch_threads(2):
        ok, detail, _ = cpu_gemm.check_rows(lambda a, b: torch.mm(a, b), w.t(), torch.float32, threads=2)
    assert not ok, detail


def test_self_check_detects_a_variant_bmm():
    _, w = _data(256, 48, torch.float32)

    def variant(a, b):
        return torch.stack([_k_split_when_many_rows(a[i], b[i]) if a.shape[0] > 1 else a[i] @ b[i]
                            for i in range(a.shape[0])])

    assert not cpu_gemm.check_bmm_rows(variant, w.t(), torch.float32)[0]
    assert cpu_gemm.check_bmm_rows(exact_bmm, w.t(), torch.float32)[0]


def _odd_rows_reversed_however_padded(a, b, tile=ROW_TILE, min_tiles=1):
    """Variant on every machine, padded or not: the odd rows of a call reduce K backwards."""
    out = mm_tiles(a, b, tile, min_tiles=min_tiles)
    odd = torch.arange(a.shape[0]) % 2 == 1
    if odd.any():
        out[odd] = mm_tiles(a[odd].flip(1), b.flip(0), tile, min_tiles=min_tiles)
    return out


def _k_split_in_a_lone_tile(a, b, tile=ROW_TILE, min_tiles=1):
    """As MKL's fp32 bmm with 2 threads on an Intel Xeon at K = 1024: a call of one tile is split
    across the threads, K included; a call of two tiles or more runs each tile whole."""
    if max(-(-a.shape[0] // tile), min_tiles) >= 2:
        return mm_tiles(a, b, tile, min_tiles=min_tiles)
    h = a.shape[1] // 2
    return a[:, :h] @ b[:h] + a[:, h:] @ b[h:]


def test_a_shape_variant_in_a_lone_tile_pads_every_call_to_a_tile_per_thread(monkeypatch):
    x, w = _data(256, 48, torch.float32, rows=70)
    monkeypatch.setattr(cpu_gemm, "mm_tiles", _k_split_in_a_lone_tile)
    with torch_threads(2):
        cpu_gemm.reset_decisions()
        with bi.use_cpu_gemm("tiles"):  # negative control: the unpadded tiles give variant rows
            assert count_variant_rows(lambda t: bi.linear(t, w), x) > 0
        assert count_variant_rows(lambda t: bi.linear(t, w), x) == 0
        (dec,) = cpu_gemm.decisions()
        assert (dec["path"], dec["min_tiles"]) == ("tiles", 2) and "padded to at least 2 tiles" in dec["reason"], dec
        # a lone row runs in two tiles: the arithmetic of the many-tile calls, not the split one
        assert_bitwise(bi.linear(x[:1], w), mm_tiles(x, w.t())[:1], "one row, padded")
        assert not torch.equal(_k_split_in_a_lone_tile(x[:1], w.t()), mm_tiles(x, w.t())[:1])
    with torch_threads(1):  # one thread: nothing to pad for, and this stand-in stays variant there
        cpu_gemm.reset_decisions()
        bi.linear(x[:3], w)
        (dec,) = cpu_gemm.decisions()
        assert dec["path"] == "exact", dec
    cpu_gemm.reset_decisions()


@pytest.mark.parametrize("min_tiles", [1, 2, 5])
def test_padded_tiles_return_the_callers_rows_only(min_tiles):
    # the zero tiles a call is padded with never reach its result: the shape is the caller's and
    # the values are the product's (float64 reference), for mm and for bmm with B = 1 and 3
    x, w = _data(96, 40, torch.float32, rows=7)
    got = mm_tiles(x[:3], w.t(), min_tiles=min_tiles)
    assert got.shape == (3, 40)
    torch.testing.assert_close(got, (x[:3].double() @ w.t().double()).float(), rtol=1e-5, atol=1e-5)
    a = x[:6].view(3, 2, 96)
    b = w.t()[None].expand(3, 96, 40)
    for batch in (1, 3):
        got = bmm_tiles(a[:batch], b[:batch], min_tiles=min_tiles)
        assert got.shape == (batch, 2, 40)
        torch.testing.assert_close(got, (a[:batch].double() @ b[:batch].double()).float(), rtol=1e-5, atol=1e-5)


def test_k1024_rows_are_invariant_on_this_blas_and_padding_is_used_only_where_needed():
    # the hidden size of the small preset, where MKL's fp32 bmm on a 2-core Intel Xeon splits a lone
    # tile's GEMM across the threads: whatever path the check picks here, rows are invariant; where
    # it picked the padded tiles, the unpadded tiles (forced) are variant on the same rows
    x, w = _data(1024, 384, torch.float32, rows=70)
    with torch_threads(2):
        with bi.use_path("torch"):  # negative control whatever the path: torch's GEMM is variant here
            assert count_variant_rows(lambda t: bi.linear(t, w), x) > 0
        cpu_gemm.reset_decisions()
        assert count_variant_rows(lambda t: bi.linear(t, w), x) == 0
        (dec,) = cpu_gemm.decisions()
        if dec["min_tiles"] > 1:
            with bi.use_cpu_gemm("tiles"):
                assert count_variant_rows(lambda t: bi.linear(t, w), x) > 0
        cpu_gemm.reset_decisions()


def test_a_failed_check_hands_the_shape_to_the_exact_gemm(monkeypatch, caplog):
    x, w = _data(256, 48, torch.float32, rows=70)
    # a BLAS that is row-variant, with or without the padding
    monkeypatch.setattr(cpu_gemm, "mm_tiles", _odd_rows_reversed_however_padded)
    cpu_gemm.reset_decisions()
    with bi.use_cpu_gemm("tiles"):  # negative control: trusting that BLAS gives variant rows
        assert count_variant_rows(lambda t: bi.linear(t, w), x) > 0
    with caplog.at_level(logging.WARNING, logger="zmrl.batch_invariant"):
        assert count_variant_rows(lambda t: bi.linear(t, w), x) == 0
    (dec,) = cpu_gemm.decisions()
    assert dec["path"] == "exact" and "row-variant" in dec["reason"]
    if dec["threads"] > 1:
        assert "padded to" in dec["reason"], dec  # the padded tiles were tried first
    assert "takes the exact GEMM" in caplog.text  # reported once, never silent
    assert_bitwise(bi.linear(x, w), exact_mm(x, w.t()), "the exact GEMM")
    cpu_gemm.reset_decisions()


def test_decisions_are_cached_per_shape():
    cpu_gemm.reset_decisions()
    _, w = _data(64, 48, torch.float32)
    for m in (1, 5, 70):
        bi.linear(torch.randn(m, 64), w)
    bi.matmul(torch.randn(2, 64), w.t().contiguous())  # other B layout: its own check
    layouts = sorted(d["b_layout"] for d in cpu_gemm.decisions())
    assert layouts == ["k_major", "n_major"]


def test_modes_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="CPU GEMM mode"):
        with bi.use_cpu_gemm("fast"):
            pass
    monkeypatch.setenv("ZMRL_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="ZMRL_CPU_GEMM='blas'"):
        bi.linear(torch.randn(2, 8), torch.randn(4, 8))
    monkeypatch.setenv("ZMRL_CPU_GEMM", "exact")
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    assert_bitwise(bi.linear(x, w), exact_mm(x, w.t()), "ZMRL_CPU_GEMM=exact")


# ----------------------------------------------------------------------------- forced exact, end to end
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_gemm_under_the_mode_and_threads(dtype):
    x, w = _data(256, 96, dtype, rows=70)
    bias = torch.randn(96).to(dtype)
    calls = {
        "mm": lambda t: torch.mm(t, w.t()),
        "F.linear+bias (addmm)": lambda t: F.linear(t, w, bias),
        "bmm": lambda t: torch.bmm(t[None], w.t()[None])[0],
    }
    with bi.use_cpu_gemm("exact"), bi.batch_invariant_mode():
        for name, fn in calls.items():
            assert count_variant_rows(fn, x, sizes=(1, 3, 33, 65)) == 0, name
        with torch_threads(1):
            one = F.linear(x, w, bias)
        with torch_threads(2):
            assert_bitwise(F.linear(x, w, bias), one, "1 vs 2 threads")


def test_exact_gemm_input_gradient_rows_are_batch_invariant():
    x, w = _data(128, 40, torch.float32, rows=70)
    g = torch.randn(70, 40)

    def grad_x(rows):
        xx = x[rows].clone().requires_grad_()
        bi.linear(xx, w).backward(g[rows])
        return xx.grad

    with bi.use_cpu_gemm("exact"):
        full = grad_x(torch.arange(70))
        for m in (1, 3, 33, 65):
            assert_bitwise(grad_x(torch.arange(m)), full[:m], f"grad x, M={m}")


# ----------------------------------------------------------------------------- the small tile
def _reversed_k_in_small_tiles(a, b, tile=ROW_TILE):
    """Variant on every machine, in the tile size only: a small tile reduces K backwards."""
    if tile == ROW_TILE:
        return mm_tiles(a, b)
    return mm_tiles(a.flip(1), b.flip(0), tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["mm", "bmm"])
def test_small_tile_rows_equal_the_32_row_tiles(dtype, op):
    # where the check lets few rows run as one small tile, they keep the bits of the 32-row tiles:
    # a decode step of a few requests computes what a prefill (and the trainer) computes
    x, w = _data(128, 96, dtype, rows=70)
    cpu_gemm.reset_decisions()
    if op == "mm":
        full = bi.linear(x, w)
        small = [bi.linear(x[s:s + m], w) for s, m in ((0, 1), (5, 3), (30, SMALL_ROW_TILE), (61, SMALL_ROW_TILE))]
    else:
        a = x.view(2, 35, 128)
        b = w.t()[None].expand(2, 128, 96)
        full = bi.bmm(a, b).reshape(70, 96)
        small = [bi.bmm(a[:, s:s + m], b).reshape(-1, 96) for s, m in ((0, 1), (27, SMALL_ROW_TILE))]
    (dec,) = [d for d in cpu_gemm.decisions() if (d["op"], d["k"], d["n"]) == (op, 128, 96)]
    # on the machines zmrl is measured on the check passes here; elsewhere the test still holds
    assert dec["small_tile"] in (0, SMALL_ROW_TILE) and dec["path"] == "tiles", dec
    if op == "mm":
        for (s, m), got in zip(((0, 1), (5, 3), (30, SMALL_ROW_TILE), (61, SMALL_ROW_TILE)), small):
            assert_bitwise(got, full[s:s + m], f"{m} rows from {s}")
    else:
        for (s, m), got in zip(((0, 1), (27, SMALL_ROW_TILE)), small):
            want = full.view(2, 35, 96)[:, s:s + m].reshape(-1, 96)
            assert_bitwise(got, want, f"{m} rows from {s} of each batch entry")


def test_small_tile_check_detects_a_variant_small_tile():
    _, w = _data(128, 96, torch.float32)
    ok, detail, _ = cpu_gemm.check_small_tile(_reversed_k_in_small_tiles, w.t(), torch.float32, batched=False)
    assert not ok and "differ" in detail
    ok, detail, _ = cpu_gemm.check_small_tile(lambda a, b, tile=ROW_TILE: mm_tiles(a, b), w.t(), torch.float32,
                                              batched=False)
    assert ok, detail  # the control: the 32-row tile for every call passes


def test_a_failed_small_tile_check_keeps_the_32_row_tile(monkeypatch):
    x, w = _data(128, 96, torch.float32, rows=70)
    monkeypatch.setattr(cpu_gemm, "mm_tiles", _reversed_k_in_small_tiles)
    cpu_gemm.reset_decisions()
    full = bi.linear(x, w)
    (dec,) = cpu_gemm.decisions()
    assert dec["path"] == "tiles" and dec["small_tile"] == 0 and "keep the 32-row tile" in dec["reason"], dec
    for m in (1, 3, SMALL_ROW_TILE):
        assert_bitwise(bi.linear(x[:m], w), full[:m], f"M={m}")
    # negative control: the variant small tile, were it used, changes the rows
    assert not torch.equal(_reversed_k_in_small_tiles(x[:3], w.t(), SMALL_ROW_TILE), full[:3])
    cpu_gemm.reset_decisions()


# ----------------------------------------------------------------------------- the large tiles
def _reversed_k_in_large_tiles(a, b, sizes, rest=mm_tiles):
    """Variant on every machine, in the tile size only: rows in a large tile reduce K backwards."""
    return mm_large_tiles(a.flip(1), b.flip(0), sizes, lambda x, y: rest(x.flip(1), y.flip(0)))


LARGE_CALLS = ((0, 64), (3, 100), (5, 200), (0, 256), (1, 300), (37, 600))  # (first row, rows): 64-, 128- and 256-row tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tile_rows_equal_the_32_row_tiles(dtype):
    # where the check lets whole 64-, 128- and 256-row tiles carry a call's rows, each row keeps the bits
    # of the 32-row tiles: a long prefill computes what a decode step and the trainer compute
    x, w = _data(128, 96, dtype, rows=640)
    want = mm_tiles(x, w.t())
    cpu_gemm.reset_decisions()
    for s, m in LARGE_CALLS:
        assert_bitwise(bi.linear(x[s:s + m], w), want[s:s + m], f"{m} rows from {s}")
    (dec,) = cpu_gemm.decisions()
    assert set(dec["large_checked"]) == set(LARGE_ROW_TILES), dec  # each size checked once a call fitted it
    # on the machines zmrl is measured on the checks pass here; elsewhere the equality above still holds
    assert set(dec["large_tiles"]) <= set(LARGE_ROW_TILES) and dec["path"] == "tiles", dec
    assert cpu_gemm.mm_route(x[:300], w.t())[3] == tuple(s for s in dec["large_tiles"] if s <= 300)
    cpu_gemm.reset_decisions()


def test_large_tiles_are_checked_when_a_call_first_fits_them_and_never_unchecked():
    x, w = _data(128, 96, torch.float32, rows=300)
    cpu_gemm.reset_decisions()
    bi.linear(x[:63], w)  # fits no large tile: nothing checked
    assert cpu_gemm.decisions()[0]["large_checked"] == ()
    bi.linear(x[:100], w)  # fits the 64-row tile only
    assert cpu_gemm.decisions()[0]["large_checked"] == (64,)
    with bi.use_cpu_gemm("tiles"):  # a forced mode checks nothing, so it uses the 32-row tiles only
        assert cpu_gemm.mm_route(x, w.t()) == ("tiles", 0, 1, ())
        assert cpu_gemm.decisions()[0]["large_checked"] == (64,)
    cpu_gemm.reset_decisions()


def test_large_tile_check_detects_a_variant_large_tile():
    _, w = _data(128, 96, torch.float32)
    for size in LARGE_ROW_TILES:
        ok, detail, _ = cpu_gemm.check_large_tile(_reversed_k_in_large_tiles, mm_tiles, w.t(), torch.float32, size)
        assert not ok and f"in {size}-row tiles differ" in detail
    # the control: the 32-row tiles for every call pass
    ok, detail, _ = cpu_gemm.check_large_tile(lambda a, b, sizes: mm_tiles(a, b), mm_tiles, w.t(), torch.float32,
                                              256)
    assert ok, detail


def test_a_failed_large_tile_check_keeps_the_32_row_tiles(monkeypatch):
    x, w = _data(128, 96, torch.float32, rows=640)
    want = mm_tiles(x, w.t())
    monkeypatch.setattr(cpu_gemm, "mm_large_tiles", _reversed_k_in_large_tiles)
    cpu_gemm.reset_decisions()
    for s, m in LARGE_CALLS:
        assert_bitwise(bi.linear(x[s:s + m], w), want[s:s + m], f"{m} rows from {s}")
    (dec,) = cpu_gemm.decisions()
    assert dec["large_tiles"] == () and set(dec["large_checked"]) == set(LARGE_ROW_TILES), dec
    assert all(f"{size}-row tiles not used" in dec["reason"] for size in LARGE_ROW_TILES), dec
    # negative control: the variant large tiles, were they used, change the rows
    assert not torch.equal(_reversed_k_in_large_tiles(x[:300], w.t(), LARGE_ROW_TILES), want[:300])
    cpu_gemm.reset_decisions()


# ----------------------------------------------------------------------------- a zero weight
ZERO_WEIGHT_CASES = {  # stage -> (a GEMM variant at that stage only, the name it replaces, its check)
    "tiles": (_odd_rows_reversed_however_padded, "mm_tiles",
              lambda gemm, b: cpu_gemm.check_rows(gemm, b, torch.float32)),
    "small tile": (_reversed_k_in_small_tiles, "mm_tiles",
                   lambda gemm, b: cpu_gemm.check_small_tile(gemm, b, torch.float32, batched=False)),
    "large tiles": (_reversed_k_in_large_tiles, "mm_large_tiles",
                    lambda gemm, b: cpu_gemm.check_large_tile(gemm, mm_tiles, b, torch.float32, 256)),
}


@pytest.mark.parametrize("stage", list(ZERO_WEIGHT_CASES))
def test_a_zero_weight_vouches_for_nothing(stage, monkeypatch):
    # A LoRA B starts at zero. The first call of its shape decides the path, and against zeros every
    # summation order gives the same bits: the decision must rest on a random weight as well.
    x, w = _data(128, 96, torch.float32, rows=640)
    zero = torch.zeros_like(w)
    variant, name, check = ZERO_WEIGHT_CASES[stage]
    assert check(variant, zero.t())[0]  # negative control: against the zero weight alone, the variant passes
    assert not check(variant, w.t())[0]
    monkeypatch.setattr(cpu_gemm, name, variant)
    cpu_gemm.reset_decisions()
    bi.linear(x[:300], zero)  # decides the shape on the zero weight (300 rows: the large tiles too)
    bi.linear(x[:3], zero)
    (dec,) = cpu_gemm.decisions()
    assert "against a random weight" in dec["reason"], dec
    if stage == "tiles":
        assert dec["path"] == "exact", dec
    elif stage == "small tile":
        assert dec["path"] == "tiles" and dec["small_tile"] == 0, dec
    else:
        assert dec["path"] == "tiles" and dec["large_tiles"] == () and dec["large_checked"], dec
    # the weight trained away from zero: every call gives each row the bits of the path decided on
    want = exact_mm(x, w.t()) if stage == "tiles" else mm_tiles(x, w.t())
    for s, m in ((0, 1), (5, 3), (0, SMALL_ROW_TILE), (3, 100), (1, 300)):
        assert_bitwise(bi.linear(x[s:s + m], w), want[s:s + m], f"{m} rows from {s}")
    cpu_gemm.reset_decisions()


def test_the_probe_weight_keeps_the_callers_layout_and_not_its_values():
    _, w = _data(128, 96, torch.bfloat16)
    for b in (w.t(), w.t().contiguous(), torch.zeros(96, 200, dtype=torch.bfloat16)[:, 7:135].t()):
        p = cpu_gemm.probe_weight(b, torch.bfloat16)
        assert p.shape == b.shape and p.dtype == torch.bfloat16
        assert cpu_gemm.b_layout(p) == cpu_gemm.b_layout(b)
        assert bool((p != 0).all()) and not torch.equal(p, b)
        assert torch.equal(p, cpu_gemm.probe_weight(b.clone(), torch.bfloat16))  # seeded: the same everywhere
    strided = w.t()[::2, ::3]  # neither dimension unit-stride
    p = cpu_gemm.probe_weight(strided, torch.bfloat16)
    assert p.stride() == strided.stride() and cpu_gemm.b_layout(p) == "strided"


# ----------------------------------------------------------------------------- order changes behind a bf16 rounding
def _k_halves_in_small_tiles(a, b, tile=ROW_TILE):
    """Variant in the tile size only, and only in K's order: a small tile sums K's two halves in
    fp32 separately, then rounds to bf16 (a BLAS switching kernels at few rows, as oneDNN's bf16 GEMM
    does at 9 rows on an AVX512-BF16 CPU). The fp32 results move by an fp32 unit or two, which the
    bf16 rounding hides unless it falls near a tie."""
    if tile == ROW_TILE:
        return mm_tiles(a, b)
    h = a.shape[1] // 2
    af, bf = a.float(), b.float()
    return (af[:, :h] @ bf[:h] + af[:, h:] @ bf[h:]).to(a.dtype)


def test_the_small_tile_check_sees_a_k_order_change_behind_a_bf16_rounding(monkeypatch):
    # a LoRA A of rank 4: four output columns per row, so random rows almost never land near a tie
    w = (torch.randn(4, 128, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    ok, detail, _ = cpu_gemm.check_small_tile(_k_halves_in_small_tiles, w.t(), torch.bfloat16, batched=False)
    assert not ok and "differ" in detail
    # negative control, the same check on the random probe rows alone: the rounding hides the change
    monkeypatch.setattr(cpu_gemm, "probe_rows_against", lambda b, rows, dtype: cpu_gemm.probe_rows(rows, b.shape[0],
                                                                                                      dtype))
    ok, detail, _ = cpu_gemm.check_small_tile(_k_halves_in_small_tiles, w.t(), torch.bfloat16, batched=False)
    assert ok, detail


def test_cancelling_rows_reduce_to_their_small_terms_and_move_with_the_k_order():
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16)
    x = cpu_gemm.cancelling_rows(w.t(), 16, torch.bfloat16)
    assert x.shape == (16, 64) and x.dtype == torch.bfloat16
    exact = x.double() @ w.t().double()
    big = x.double().abs().max(1).values * w.double().abs().max()
    aimed = exact[torch.arange(16), torch.arange(16) % 8]
    assert (aimed.abs() < big * 2.0 ** -8).all()  # the large products cancel in each row's column
    forward = (x.float() @ w.t().float()).to(torch.bfloat16)
    backward = (x.float().flip(1) @ w.t().float().flip(0)).to(torch.bfloat16)
    assert not torch.equal(forward[torch.arange(16), torch.arange(16) % 8],
                           backward[torch.arange(16), torch.arange(16) % 8]), "a reversed K order left every bit"
