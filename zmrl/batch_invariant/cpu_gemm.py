"""Which CPU GEMM a shape takes: BLAS tiles where this machine proves them row-invariant, else exact.

The tile path (_tiles.py) is fast but rests on the BLAS picking the same microkernel and
reduction order for every row of a fixed [ROW_TILE, K] tile, whatever the number of tiles in
the call and the row's position. That held on the AMD EPYC / oneDNN 3.12 machine zmrl is
developed on and failed on an Intel Xeon (AVX-512, MKL, oneDNN 3.10, 16 threads) at K = 1000,
N = 96 fp32. So, once per process for each (op, K, N, dtype, B layout, thread count), the
self-check below runs the tile path on probe rows against two weights, a seeded random one in
the caller's B layout and then the caller's own B, and compares, bit for bit (torch.equal). The
caller's B alone could prove nothing: a LoRA B starts at zero, and zero products agree in any
summation order. The probes:
  - every row position of a tile: windows that start one row and half a tile later than the
    reference call (every row moves to a neighbouring position, see probe_plan) and rows alone;
  - several tile fillings: 1, 2, 3, ROW_TILE +- 1, 2 ROW_TILE + 1 rows and tile counts around the
    thread count against a reference call with more tiles than threads (one, several and more
    tiles than threads: where a BLAS may switch from splitting one GEMM, even its K, across
    threads to one GEMM per thread);
  - mixed magnitudes: rows scaled by 2^-12 ... 2^12, every third row mixing 2^-8 ... 2^8 inside
    the row, so a changed summation order changes bits;
  - bmm: batch counts 1 and several, every batch entry against one weight (the random one, then
    the caller's first).
If every probe matches, the shape takes the tiles. If not, and there are several threads, the same
probes run once more with every call padded to at least one tile per thread (_tiles.py, min_tiles:
a BLAS that splits a lone GEMM across its threads runs each of them on one thread then); if those
match, the shape takes the padded tiles. Otherwise exact_gemm.py (whose result does not depend on
any reduction order) takes over for that shape for the rest of the process.
A shape that takes the tiles is then checked once more for the small tile (_tiles.py
SMALL_ROW_TILE rows): calls of 1 ... SMALL_ROW_TILE rows, starting at rows that put every probe row
at every position of the small tile, each padded to one small tile, against the same rows of the
32-row reference call. If they match bit for bit, calls of at most SMALL_ROW_TILE rows (decode
steps) run as one small tile instead of a 32-row tile that is mostly zeros; else they keep the
32-row tile (the decision's `small_tile` is 0). Such a shape's large tiles (_tiles.py
LARGE_ROW_TILES: 256, 128 and 64 rows) are checked the same way against the 32-row tiles, each at the
first call with as many rows (large_tile_plan: a large tile starting at rows that move every probe
row through its positions, and calls of several large tiles); a call then runs its rows through
the large tiles that passed (fewer, larger BLAS calls) and keeps the 32-row tiles for the rest. The
decision is logged at first use (a warning when the exact path takes over) and listed by
`decisions()` and `zmrl doctor`.

What it proves: on this CPU, BLAS build, thread count and shape, the tile path gave every probe
row the same bits alone, at every tile position and in every probed batch. What it does not
prove: agreement on data it did not try, at tile counts beyond the probes (the largest call has
max(8, 4 x threads + 1) tiles, at most 40; of large tiles, threads + 1, at most 8), at another
thread count (each count is checked on its own), or for B values other than the two tried (a
trained weight changes after the decision; a bmm's other batch entries share its shape and layout).

ZMRL_CPU_GEMM (or `use_cpu_gemm`) = auto (default: the above) | tiles (the BLAS tiles, no
check) | exact (the exact path everywhere). The backward's weight gradient (A^T @ grad, whose K
is the token count) needs determinism, not row invariance, and takes the tiles without a check
unless the mode is "exact" (a check per token count would cost more than the step).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

from zmrl.batch_invariant._probes import cancelling_rows
from zmrl.batch_invariant._tiles import (LARGE_ROW_TILES, ROW_TILE, SMALL_ROW_TILE, TiledMM, bmm_tiles, mm_large_tiles,
                                         mm_tiles)
from zmrl.batch_invariant.exact_gemm import exact_bmm, exact_mm

MODES = ("auto", "tiles", "exact")
ENV = "ZMRL_CPU_GEMM"
PROBE_TILES_MAX = 40  # caps the largest probe call (tile count) on machines with many threads
LARGE_PROBE_TILES_MAX = 8  # caps the large tiles of one probe call (an fp32 call is one bmm over them)

log = logging.getLogger("zmrl.batch_invariant")
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("zmrl_cpu_gemm", default=None)


def gemm_mode() -> str:
    """The mode in force: `use_cpu_gemm`'s, else ZMRL_CPU_GEMM's, else "auto"."""
    forced = _forced.get()
    if forced is not None:
        return forced
    raw = os.environ.get(ENV)
    if raw is None:
        return "auto"
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@contextlib.contextmanager
def use_cpu_gemm(mode: str) -> Iterator[None]:
    """Force the CPU matmul/linear/bmm path inside the block: "auto", "tiles" or "exact"."""
    if mode not in MODES:
        raise ValueError(f"CPU GEMM mode must be one of {MODES}, got {mode!r}")
    token = _forced.set(mode)
    try:
        yield
    finally:
        _forced.reset(token)


@dataclasses.dataclass(frozen=True)
class GemmDecision:
    """Which CPU GEMM one (op, K, N, dtype, B layout, threads) takes in this process, and why."""
    op: str
    k: int
    n: int
    dtype: str
    b_layout: str
    threads: int
    path: str  # "tiles" or "exact"
    reason: str
    probes: int = 0
    seconds: float = 0.0
    small_tile: int = 0  # calls of at most this many rows run as one tile of this many rows (0: never)
    min_tiles: int = 1  # every call is padded to at least this many tiles (1: calls go as they come)
    large_tiles: tuple[int, ...] = ()  # the large tiles (_tiles.LARGE_ROW_TILES) proven to keep the bits
    large_checked: tuple[int, ...] = ()  # the large tiles checked so far (each at the first call it fits)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_DECISIONS: dict[tuple, GemmDecision] = {}
_LOCK = threading.Lock()


def decisions() -> list[dict]:
    """Every self-check this process ran."""
    with _LOCK:
        return [d.as_dict() for d in _DECISIONS.values()]


def reset_decisions() -> None:
    """Forget every decision (tests, `zmrl doctor`; a later call checks again), and with them the
    call plans made from them (cpu_plans.py) and the grouped GEMMs' checks (cpu_grouped.py)."""
    from zmrl.batch_invariant import cpu_grouped, cpu_plans

    with _LOCK:
        _DECISIONS.clear()
        cpu_plans.forget()
        cpu_grouped.forget()


def b_layout(b: torch.Tensor) -> str:
    """How B [.., K, N] sits in memory (a BLAS may pick its kernel by it): weight.t() is k_major."""
    if b.stride(-1) == 1:
        return "n_major"
    return "k_major" if b.stride(-2) == 1 else "strided"


# ----------------------------------------------------------------------------- the self-check
def probe_rows(rows: int, k: int, dtype: torch.dtype, seed: int = 0x5EED) -> torch.Tensor:
    """[rows, K] activations: rows of magnitudes 2^-12 ... 2^12; every third row mixes 2^-8 ... 2^8."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    row_exp = torch.randint(-12, 13, (rows, 1), generator=g).float()
    elem_exp = torch.randint(-8, 9, (rows, k), generator=g).float()
    mixed = (torch.arange(rows) % 3 == 2)[:, None]
    return (x * torch.exp2(torch.where(mixed, elem_exp, row_exp))).to(dtype)


def probe_rows_against(b: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """probe_rows with every other row a cancelling row (cancelling_rows) against b [K, N]."""
    x = probe_rows(rows, b.shape[0], dtype)
    x[1::2] = cancelling_rows(b, rows // 2, dtype)
    return x


def probe_plan(threads: int) -> tuple[int, list[tuple[int, int]]]:
    """(rows of the reference call, [(first row, rows)] of the calls compared with it).

    Positions: a call starting one row later puts every row at the previous tile position (the
    positions form a cycle: a tile's first row moves to the previous tile's last), so if any two
    neighbouring positions of a tile computed differently, some probe row would change bits;
    a second shift by half a tile and rows alone (M = 1, a decode step) add other moves."""
    t = ROW_TILE
    many = min(PROBE_TILES_MAX, max(8, 4 * threads + 1))  # well past the thread count
    calls = [(0, 1), (1, 1), (t - 1, 1), (1, 3 * t), (t // 2 + 1, 3 * t)]
    sizes = {2, 3, t - 1, t + 1, 2 * t + 1}
    sizes.update(min(tiles, many - 1) * t for tiles in (threads - 1, threads, threads + 1) if tiles >= 1)
    calls += [(0, m) for m in sorted(sizes)]
    return many * t, calls


def check_rows(gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], b: torch.Tensor,
               dtype: torch.dtype, threads: int | None = None) -> tuple[bool, str, int]:
    """Run `gemm(x [M, K], b [K, N])` on the probe plan -> (row-invariant?, what differed, probes).
    `gemm` is the tile path in production; tests pass deliberately variant GEMMs."""
    threads = threads or torch.get_num_threads()
    total, calls = probe_plan(threads)
    x = probe_rows_against(b, total, dtype)
    full = gemm(x, b)
    for n, (start, m) in enumerate(calls, 1):
        got = gemm(x[start:start + m], b)
        want = full[start:start + m]
        if not torch.equal(got, want):
            bad = (got != want).any(-1).nonzero()[:, 0]
            return False, (f"rows {start}..{start + m - 1} in a call of {m} rows differ from the same rows in a call "
                           f"of {total}: {len(bad)} rows, first row {start + int(bad[0])}"), n
    return True, f"{len(calls)} probe calls (1 ... {total} rows) equal bit for bit", len(calls)


def check_bmm_rows(gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], b: torch.Tensor,
                   dtype: torch.dtype, threads: int | None = None) -> tuple[bool, str, int]:
    """The bmm version: `gemm(a [B, M, K], b [B, K, N])`, B and M both varied; b [K, N]."""
    threads = threads or torch.get_num_threads()
    t = ROW_TILE
    batch = max(3, threads + 1)
    rows = 2 * t + 1
    a = probe_rows_against(b, batch * rows, dtype).view(batch, rows, -1)
    bb = b.expand(batch, *b.shape)
    full = gemm(a, bb)
    calls = [(0, 1, 0, 1), (0, 1, 1, 1), (1, 1, t - 1, 1), (0, 1, 1, 2 * t), (1, 2, t // 2 + 1, t), (0, 1, 0, 3),
             (1, 2, 0, t + 1), (0, batch, 0, 5), (2, batch - 2, 3, t)]
    for n, (b0, nb, r0, m) in enumerate(calls, 1):
        got = gemm(a[b0:b0 + nb, r0:r0 + m], bb[b0:b0 + nb])
        if not torch.equal(got, full[b0:b0 + nb, r0:r0 + m]):
            where = f"batch {b0}..{b0 + nb - 1}, rows {r0}..{r0 + m - 1}"
            return False, f"{where} differ from the same rows in a call of {batch} x {rows}", n
    return True, f"{len(calls)} probe calls (B 1 ... {batch}, M 1 ... {rows}) equal bit for bit", len(calls)


def small_tile_plan(tile: int = SMALL_ROW_TILE) -> list[tuple[int, int]]:
    """[(first row, rows)] of the small-tile calls compared with the 32-row reference call: every
    size 1 ... tile, and whole small tiles starting at 0, 1 and tile // 2 + 1 (each probe row at
    several positions of the small tile) and across a 32-row tile boundary of the reference."""
    t = ROW_TILE
    calls = [(0, m) for m in range(1, tile + 1)]
    calls += [(1, tile), (tile // 2 + 1, tile), (t - tile // 2, tile), (t + 3, tile), (t - 1, 1), (2 * t + 5, 3)]
    return calls


def check_small_tile(tiled: Callable[..., torch.Tensor], b: torch.Tensor, dtype: torch.dtype, batched: bool,
                     threads: int | None = None, tile: int = SMALL_ROW_TILE) -> tuple[bool, str, int]:
    """Rows run as one [tile, K] tile (`tiled(x, b, tile)`) against the same rows of a call through
    the 32-row tiles (`tiled(x, b)`), bit for bit -> (equal?, what differed, probes). b [K, N];
    batched: `tiled` is bmm_tiles, called on [B, M, K] with B = 1 and several."""
    threads = threads or torch.get_num_threads()
    many = min(PROBE_TILES_MAX, max(8, 4 * threads + 1))
    x = probe_rows_against(b, many * ROW_TILE, dtype)
    if batched:
        batch = 3
        xs = x[: batch * (3 * ROW_TILE)].view(batch, 3 * ROW_TILE, -1)
        bb = b.expand(batch, *b.shape)
        full = tiled(xs, bb)
        calls = [(b0, nb, r0, m) for (r0, m) in small_tile_plan(tile) if r0 + m <= 3 * ROW_TILE for b0, nb in ((0, 1), (1, 2))]
        for n, (b0, nb, r0, m) in enumerate(calls, 1):
            got = tiled(xs[b0:b0 + nb, r0:r0 + m], bb[b0:b0 + nb], tile)
            if not torch.equal(got, full[b0:b0 + nb, r0:r0 + m]):
                return False, (f"batch {b0}..{b0 + nb - 1}, rows {r0}..{r0 + m - 1} in one {tile}-row tile differ "
                               f"from the same rows in {ROW_TILE}-row tiles"), n
        return True, f"{len(calls)} small-tile probe calls equal bit for bit", len(calls)
    full = tiled(x, b)
    calls = small_tile_plan(tile)
    for n, (start, m) in enumerate(calls, 1):
        got = tiled(x[start:start + m], b, tile)
        if not torch.equal(got, full[start:start + m]):
            return False, (f"rows {start}..{start + m - 1} in one {tile}-row tile differ from the same rows in "
                           f"{ROW_TILE}-row tiles"), n
    return True, f"{len(calls)} small-tile probe calls equal bit for bit", len(calls)


def large_tile_plan(size: int, threads: int) -> tuple[int, list[tuple[int, int]]]:
    """(rows of the 32-row-tile reference call, [(first row, rows)] of the calls through tiles of
    `size` rows compared with it): one large tile starting 0, 1, ROW_TILE - 1 and size // 2 + 1 rows
    in (every row moves to a neighbouring position of the large tile, as in probe_plan); a large tile
    and 32-row tiles after it; several large tiles in one call, up to one more than the threads (an
    fp32 call is one bmm over its large tiles, which a BLAS may split across threads by their count)."""
    t = ROW_TILE
    most = min(threads, LARGE_PROBE_TILES_MAX - 1) + 1
    calls = [(0, size), (1, size), (t - 1, size), (size // 2 + 1, size), (3, size + t + 2)]
    calls += [(5, count * size) for count in sorted({2, most})]
    calls.append((size // 2 + 1, most * size + 7))
    return (most + 1) * size + t, calls


def check_large_tile(large: Callable[..., torch.Tensor], tiled: Callable[..., torch.Tensor], b: torch.Tensor,
                     dtype: torch.dtype, size: int, threads: int | None = None) -> tuple[bool, str, int]:
    """Rows through tiles of `size` rows (`large(x, b, (size,))`, the rest of a call in 32-row
    tiles) against the same rows of one call through the 32-row tiles (`tiled(x, b)`), bit for bit
    -> (equal?, what differed, probes). b [K, N]."""
    threads = threads or torch.get_num_threads()
    total, calls = large_tile_plan(size, threads)
    x = probe_rows_against(b, total, dtype)
    full = tiled(x, b)
    for n, (start, m) in enumerate(calls, 1):
        got = large(x[start:start + m], b, (size,))
        if not torch.equal(got, full[start:start + m]):
            return False, (f"rows {start}..{start + m - 1} in {size}-row tiles differ from the same rows in "
                           f"{ROW_TILE}-row tiles"), n
    most = max(m for _, m in calls)
    return True, f"{len(calls)} probe calls ({size} ... {most} rows) equal bit for bit", len(calls)


def tile_path(op: str, min_tiles: int = 1) -> Callable[..., torch.Tensor]:
    """The tile GEMM of `op` ("mm" or "bmm") with every call padded to at least `min_tiles` tiles;
    at 1 the module's own mm_tiles / bmm_tiles (which tests replace with stand-ins)."""
    tiled = mm_tiles if op == "mm" else bmm_tiles
    if min_tiles == 1:
        return tiled
    return lambda a, b, tile=ROW_TILE: tiled(a, b, tile, min_tiles=min_tiles)


def probe_weight(b: torch.Tensor, dtype: torch.dtype, seed: int = 0x3E16) -> torch.Tensor:
    """A seeded random [K, N] in `dtype`, laid out as b [K, N] is: k- or n-major dense, columns of
    magnitudes 2^-4 ... 2^4 over a K^-1/2 scale; a strided b's own strides, values at that scale.
    The same for every process and every b of this shape and layout."""
    k, n = b.shape
    g = torch.Generator().manual_seed(seed)
    layout = b_layout(b)
    if layout == "strided":
        span = 1 + sum((size - 1) * stride for size, stride in zip(b.shape, b.stride()))
        return (torch.randn(span, generator=g) * k ** -0.5).to(dtype).as_strided(b.shape, b.stride())
    w = torch.randn(n, k, generator=g) * k ** -0.5 * torch.exp2(torch.randint(-4, 5, (n, 1), generator=g).float())
    w = w.to(dtype)
    return w.t() if layout == "k_major" else w.t().contiguous()


def probe_weights(b: torch.Tensor, dtype: torch.dtype) -> tuple[tuple[str, torch.Tensor], ...]:
    """The weights a check runs against: probe_weight(b), then b [K, N] itself. Never b alone: a LoRA
    B starts at zero, and against zeros every row is zeros in any summation order, so a check on it
    would pass any GEMM, and the B it decided for changes at the first update (seen with 4 threads on
    the 2-core AMD EPYC: K = 8, N = 24 passed on the zero B and gave rollout and trainer other
    log-probs from the second step on)."""
    return ("a random weight", probe_weight(b, dtype)), ("the caller's B", b)


def check_each_weight(check: Callable[[torch.Tensor], tuple[bool, str, int]],
                      weights: tuple[tuple[str, torch.Tensor], ...]) -> tuple[bool, str, int]:
    """check(w) for each of probe_weights' weights -> (all equal?, what differed, probes)."""
    probes = 0
    detail = ""
    for name, w in weights:
        ok, detail, more = check(w)
        probes += more
        if not ok:
            return False, f"against {name}: {detail}", probes
    return True, f"{detail}, against a random weight and the caller's B", probes


def _check_tiles(op: str, weights: tuple, dtype: torch.dtype, threads: int, min_tiles: int) -> tuple[bool, str, int]:
    check = check_rows if op == "mm" else check_bmm_rows
    try:
        with torch.no_grad():
            return check_each_weight(lambda w: check(tile_path(op, min_tiles), w, dtype, threads), weights)
    except Exception as e:  # noqa: BLE001 - a tile path that cannot run here is not trusted
        return False, f"a probe raised {type(e).__name__}: {str(e)[:200]}", 0


def _decide(key: tuple, b: torch.Tensor) -> GemmDecision:
    op, k, n, dtype, layout, threads = key
    t0 = time.perf_counter()
    info = dict(op=op, k=k, n=n, dtype=str(dtype).replace("torch.", ""), b_layout=layout, threads=threads)
    # [K, N]: a bmm's entries share its shape and layout; the random weight is made once per decision
    weights = probe_weights((b if op == "mm" else b[0]).detach(), dtype)
    ok, detail, probes = _check_tiles(op, weights, dtype, threads, 1)
    min_tiles = 1
    if not ok and threads > 1:
        plain = detail
        ok, padded, more = _check_tiles(op, weights, dtype, threads, threads)
        probes += more
        if ok:
            min_tiles = threads
            detail = f"every call padded to at least {threads} tiles (one per thread): {padded}; unpadded, {plain}"
        else:
            detail = f"{plain}; padded to {threads} tiles: {padded}"
    small = 0
    if ok:
        try:
            with torch.no_grad():
                small_ok, small_detail, small_probes = check_each_weight(
                    lambda w: check_small_tile(tile_path(op, min_tiles), w, dtype, batched=op == "bmm", threads=threads),
                    weights)
        except Exception as e:  # noqa: BLE001 - a small tile that cannot run here is not used
            small_ok, small_detail, small_probes = False, f"a probe raised {type(e).__name__}: {str(e)[:200]}", 0
        probes += small_probes
        small = SMALL_ROW_TILE if small_ok else 0
        detail += (f"; calls of <= {SMALL_ROW_TILE} rows run as one {SMALL_ROW_TILE}-row tile: {small_detail}"
                   if small_ok else f"; calls of few rows keep the {ROW_TILE}-row tile: {small_detail}")
    seconds = time.perf_counter() - t0
    if ok:
        dec = GemmDecision(**info, path="tiles", reason=f"BLAS tiles: {detail}", probes=probes, seconds=seconds,
                           small_tile=small, min_tiles=min_tiles)
        log.info("zmrl CPU %s K=%d N=%d %s (%s, %d threads): %s [%.3f s]",
                 op, k, n, info["dtype"], layout, threads, dec.reason, seconds)
    else:
        dec = GemmDecision(**info, path="exact", reason=f"exact GEMM: the BLAS tiles are row-variant here: {detail}",
                           probes=probes, seconds=seconds)
        log.warning("zmrl CPU %s K=%d N=%d %s (%s, %d threads) takes the exact GEMM (slower): %s",
                    op, k, n, info["dtype"], layout, threads, dec.reason)
    return dec


def decision_for(op: str, b: torch.Tensor, dtype: torch.dtype) -> tuple[str, int, int]:
    """(path, small_tile, min_tiles) for a row-invariant GEMM against b ([K, N] for mm, [B, K, N]
    for bmm): path "tiles" or "exact"; calls of at most small_tile rows may run as one small tile
    (0: never); every call is padded to at least min_tiles tiles. A forced mode gives 0 and 1: the
    small tile and the padding are used only where the self-check proved them."""
    mode = gemm_mode()
    if mode != "auto":
        return mode, 0, 1
    dec = _decision(_key(op, b, dtype), b)
    return dec.path, dec.small_tile, dec.min_tiles


def _key(op: str, b: torch.Tensor, dtype: torch.dtype) -> tuple:
    return op, b.shape[-2], b.shape[-1], dtype, b_layout(b), torch.get_num_threads()


def _decision(key: tuple, b: torch.Tensor) -> GemmDecision:
    dec = _DECISIONS.get(key)
    if dec is None:
        with _LOCK:
            dec = _DECISIONS.get(key)
            if dec is None:
                dec = _DECISIONS[key] = _decide(key, b)
    return dec


def large_tiles_for(b: torch.Tensor, dtype: torch.dtype, rows: int) -> tuple[int, ...]:
    """The large tiles (_tiles.LARGE_ROW_TILES, largest first) an mm of `rows` rows against b
    [K, N] may use: those of at most `rows` rows that the self-check proved to give every row the
    bits of the 32-row tiles. Each is checked at the first call it fits, not before (a decode-only
    process never pays for it); only under "auto", and only where the plain 32-row tiles passed."""
    if gemm_mode() != "auto" or rows < min(LARGE_ROW_TILES):
        return ()
    key = _key("mm", b, dtype)
    return _large_tiles(key, _decision(key, b), b, dtype, rows)


def _large_tiles(key: tuple, dec: GemmDecision, b: torch.Tensor, dtype: torch.dtype, rows: int) -> tuple[int, ...]:
    """large_tiles_for with the call's key and decision already in hand (mode "auto")."""
    if dec.path != "tiles" or dec.min_tiles > 1 or rows < min(LARGE_ROW_TILES):
        return ()
    if any(size <= rows and size not in dec.large_checked for size in LARGE_ROW_TILES):
        with _LOCK:
            dec = _DECISIONS.get(key) or dec
            for size in LARGE_ROW_TILES:
                if size <= rows and size not in dec.large_checked:
                    dec = _check_large(dec, b, dtype, size)
            _DECISIONS[key] = dec
    return tuple(size for size in dec.large_tiles if size <= rows)


def _check_large(dec: GemmDecision, b: torch.Tensor, dtype: torch.dtype, size: int) -> GemmDecision:
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            ok, detail, probes = check_each_weight(
                lambda w: check_large_tile(lambda a, bb, sizes: mm_large_tiles(a, bb, sizes, mm_tiles),
                                           tile_path("mm"), w, dtype, size, dec.threads),
                probe_weights(b.detach(), dtype))
    except Exception as e:  # noqa: BLE001 - a large tile that cannot run here is not used
        ok, detail, probes = False, f"a probe raised {type(e).__name__}: {str(e)[:200]}", 0
    seconds = time.perf_counter() - t0
    verdict = f"{size}-row tiles used: {detail}" if ok else f"{size}-row tiles not used: {detail}"
    log.info("zmrl CPU mm K=%d N=%d %s (%s, %d threads): %s [%.3f s]",
             dec.k, dec.n, dec.dtype, dec.b_layout, dec.threads, verdict, seconds)
    return dataclasses.replace(dec, large_checked=dec.large_checked + (size,),
                               large_tiles=tuple(sorted(dec.large_tiles + ((size,) if ok else ()), reverse=True)),
                               reason=f"{dec.reason}; {verdict}", probes=dec.probes + probes,
                               seconds=dec.seconds + seconds)


def path_for(op: str, b: torch.Tensor, dtype: torch.dtype) -> str:
    """"tiles" or "exact" for a row-invariant GEMM against b ([K, N] for mm, [B, K, N] for bmm)."""
    return decision_for(op, b, dtype)[0]


# ----------------------------------------------------------------------------- the GEMMs
# A call's route: ("exact", 0, 1, ()), or ("tiles", rows per tile, min tiles, large tiles), 0 rows
# meaning the default ROW_TILE (and with min tiles 1, mm_tiles and bmm_tiles are called with no more
# than a tile argument, as tests' stand-ins expect); large tiles (mm only): the sizes mm_large_tiles
# runs the call's rows through, () for none. The route depends only on the call's kind (shapes,
# dtype, B's layout, mode, threads), so a planned call (cpu_plans.py) stores it and runs `run_mm` /
# `run_bmm` with it.
Route = tuple[str, int, int, tuple[int, ...]]


def _route(op: str, rows: int, a: torch.Tensor, b: torch.Tensor, row_invariant: bool) -> Route:
    if 0 in a.shape or 0 in b.shape:
        return "exact", 0, 1, ()  # nothing to sum: zeros (or an empty result), no check needed
    if not row_invariant:
        return ("exact" if gemm_mode() == "exact" else "tiles"), 0, 1, ()
    mode = gemm_mode()
    if mode != "auto":
        return mode, 0, 1, ()
    key = _key(op, b, a.dtype)  # one key and one decision lookup for the whole route
    dec = _decision(key, b)
    if dec.path != "tiles":
        return dec.path, 0, 1, ()
    if rows <= dec.small_tile:
        return dec.path, dec.small_tile, dec.min_tiles, ()
    return dec.path, 0, dec.min_tiles, (_large_tiles(key, dec, b, a.dtype, rows) if op == "mm" else ())


def mm_route(a: torch.Tensor, b: torch.Tensor, row_invariant: bool = True) -> Route:
    """The route of a [M, K] x b [K, N] (see above)."""
    return _route("mm", a.shape[0], a, b, row_invariant)


def bmm_route(a: torch.Tensor, b: torch.Tensor, row_invariant: bool = True) -> Route:
    """The route of a [B, M, K] x b [B, K, N]."""
    return _route("bmm", a.shape[1], a, b, row_invariant)


def run_mm(route: Route, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    path, tile, min_tiles, large = route
    if path == "exact":
        return exact_mm(a, b)
    if large:
        return mm_large_tiles(a, b, large, mm_tiles)
    if min_tiles > 1:
        return mm_tiles(a, b, tile or ROW_TILE, min_tiles=min_tiles)
    return mm_tiles(a, b, tile) if tile else mm_tiles(a, b)


def mm_for_rows(route: Route, rows: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """run_mm(route, a, b) for every a of `rows` rows, as one callable: the plain tiles' padding
    worked out once (_tiles.TiledMM), any other route through run_mm."""
    path, tile, min_tiles, large = route
    if path == "tiles" and not large:
        return TiledMM(rows, tile or ROW_TILE, min_tiles)
    return functools.partial(run_mm, route)


def run_bmm(route: Route, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    path, tile, min_tiles, _ = route
    if path == "exact":
        return exact_bmm(a, b)
    if min_tiles > 1:
        return bmm_tiles(a, b, tile or ROW_TILE, min_tiles=min_tiles)
    return bmm_tiles(a, b, tile) if tile else bmm_tiles(a, b)


def mm(a: torch.Tensor, b: torch.Tensor, row_invariant: bool = True) -> torch.Tensor:
    """a [M, K] x b [K, N]. row_invariant=False (a weight gradient): deterministic is enough."""
    return run_mm(mm_route(a, b, row_invariant), a, b)


def bmm(a: torch.Tensor, b: torch.Tensor, row_invariant: bool = True) -> torch.Tensor:
    """a [B, M, K] x b [B, K, N]."""
    return run_bmm(bmm_route(a, b, row_invariant), a, b)
