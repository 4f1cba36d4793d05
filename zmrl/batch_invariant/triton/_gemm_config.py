"""The GEMM's tile configurations: one fixed config per (N, K, dtype), and the tile ladder's rungs.

The fixed config (`config_for`) is the numerics contract's "tile configuration chosen from
(N, K, dtype) only": it sets BLOCK_K, the K order, and for narrow shapes the split-K count
(_splitk.py). The ladder (`_rung_for`) picks, from M, a smaller output tile that keeps that
K order, so ~every SM gets a tile at small M (by a fill rule; from 65 rows by a wave model that
also weighs a partial last wave, and may split the rows between two launches, whole waves of the
fixed tile and a smaller tile for the rest: `row_parts`; for a narrow shape by its table entry's
measured bands: `banded`); whether a shape may use it is decided per process by the self-check in
_gemm_ladder.py. Nothing here launches anything.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from zmrl.batch_invariant.triton._common import INTERPRET, cdiv


@dataclasses.dataclass(frozen=True)
class MMConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = True
    flatten: bool = False
    split_k: int = 1  # K ranges reduced by separate programs, summed in fixed order (_splitk.py)
    # the split_k ranges reduced one after another by one program, added in the same order: the
    # same bits without the fp32 workspace (a ladder rung where the tiles fill the SMs unsplit)
    split_inline: bool = False
    # K-range alignment of a split shape; 0: split_align derives it. Every config that may run
    # the shape has a BLOCK_K dividing it, so all of them split K at the same k
    k_align: int = 0
    # a measured shape's rungs, ((last M or None, config), ...) in ascending M (see `banded`):
    # they replace the fill rule for this shape
    bands: tuple = ()
    # column sub-tiles per program: a tile is sub_n side-by-side block_m x block_n accumulators
    # sharing each A tile (3 x 64 = 192 columns: 576 = 3 x 192 and 1536 = 8 x 192 leave no
    # partial tile, where power-of-two tiles do). Each column's K loop is unchanged.
    sub_n: int = 1
    # a row split (`row_parts`): the rows that fill whole waves of this config's tiles, then the
    # rest through `tail` (a ladder rung) in a second launch into the same output. Each row still
    # reduces K in this config's order; only which launch computes it depends on M
    tail: MMConfig | None = None


def tile_n(cfg: MMConfig) -> int:
    """The output columns one program's tile covers."""
    return cfg.block_n * cfg.sub_n


def output_tiles(m: int, n: int, cfg: MMConfig) -> int:
    """How many tiles of cfg cover an [m, n] output (per batch entry and K range)."""
    return cdiv(m, cfg.block_m) * cdiv(n, tile_n(cfg))


def check_sub_n(cfg: MMConfig) -> None:
    if cfg.sub_n not in (1, 2, 3):
        raise ValueError(f"sub_n={cfg.sub_n}: the GEMM kernel computes 1, 2 or 3 column sub-tiles per tile")


def tile_name(cfg: MMConfig) -> str:
    """BMxBNxBK, the columns as sub_n x BN where a tile has sub-tiles: 64x(3x64)x64; a row
    split names both tiles: 128x256x64 + tail 64x128x128."""
    cols = f"({cfg.sub_n}x{cfg.block_n})" if cfg.sub_n > 1 else str(cfg.block_n)
    name = f"{cfg.block_m}x{cols}x{cfg.block_k}"
    return name if cfg.tail is None else f"{name} + tail {tile_name(cfg.tail)}"


# Chosen on an H200 by `benchmarks/triton_bench.py --sweep` (2026-11-30): the best geometric
# mean of the cuBLAS/Triton time ratio over M in {1024, 4096, 8192}, weight [N, K] layout.
# Keys: (dtype, N, K); other shapes use _default_config.
TUNED: dict[tuple[torch.dtype, int, int], MMConfig] = {
    (torch.bfloat16, 4096, 4096): MMConfig(128, 256, 64, num_warps=8, num_stages=3),
    (torch.bfloat16, 2048, 7168): MMConfig(64, 256, 64, num_warps=4, num_stages=4),
    (torch.bfloat16, 7168, 2048): MMConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
    (torch.bfloat16, 24576, 1536): MMConfig(128, 256, 64, num_warps=8, num_stages=3),
}


def _default_config(n: int, k: int, dtype: torch.dtype) -> MMConfig:
    if INTERPRET:
        return MMConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        # the FMA path (no TF32): 64x64 is the largest tile ptxas keeps out of local memory
        return MMConfig(64, 64, 16, num_warps=4, num_stages=3, persistent=False)
    if n >= 4096:
        return MMConfig(128, 256, 64, num_warps=8, num_stages=3)
    if n >= 2048:
        return MMConfig(64, 256, 64, num_warps=4, num_stages=4)
    return MMConfig(128, 128, 64, num_warps=4, num_stages=4)


def config_for(n: int, k: int, dtype: torch.dtype) -> MMConfig:
    """The one tile configuration used for every M (the numerics contract)."""
    if not INTERPRET and (dtype, n, k) in TUNED:
        return TUNED[(dtype, n, k)]
    return _default_config(n, k, dtype)


# Tile shapes for the ladder, most efficient first (wgmma), for M > MID_M. The small tiles
# take deep K blocks (128/256): at M <= 256 a tile is memory-bound, and more bytes in flight per
# SM paid (H200, 2026-11-30, M = 64: 0.92-1.00x cuBLAS against 0.59-0.92x with BLOCK_K 64).
_LADDER = [
    MMConfig(128, 256, 64, num_warps=8, num_stages=3), MMConfig(64, 256, 64, num_warps=4, num_stages=4),
    MMConfig(128, 128, 64, num_warps=4, num_stages=6), MMConfig(64, 128, 128, num_warps=4, num_stages=4),
    MMConfig(64, 64, 128, num_warps=4, num_stages=6, persistent=False),
    MMConfig(64, 32, 256, num_warps=4, num_stages=4, persistent=False),
    MMConfig(64, 16, 256, num_warps=4, num_stages=4, persistent=False),
]
# Few rows: 16-row tiles for M <= 16 and 32-row tiles for M <= 32 (mma.sync), widest first.
# Measured on an H200 (2026-11-30, M = 1 ... 32): 0.79-1.06x cuBLAS against 0.48-0.86x for
# 64-row tiles that multiply mostly zero rows; the deep K blocks keep more weight bytes in
# flight per SM (decode is memory-bound: 16x16 with BLOCK_K 1024 gave 0.89x where 512 gave 0.77x).
SMALL_M = 16
_SMALL_LADDER = [
    MMConfig(16, 64, 256, num_warps=4, num_stages=4, persistent=False),
    MMConfig(16, 32, 256, num_warps=4, num_stages=5, persistent=False),
    MMConfig(16, 16, 1024, num_warps=4, num_stages=3, persistent=False),
]
MID_M = 32
_MID_LADDER = [
    MMConfig(32, 64, 256, num_warps=4, num_stages=4, persistent=False),
    MMConfig(32, 32, 256, num_warps=4, num_stages=4, persistent=False),
    MMConfig(32, 16, 256, num_warps=4, num_stages=4, persistent=False),
]
_MAX_RUNG_BLOCK_K = max(c.block_k for c in _LADDER + _SMALL_LADDER + _MID_LADDER)
# A rung is taken once it gives at least this share of the SMs a tile (4/5: 112 tiles of
# 64x64 on 132 SMs measured faster than 224 of 64x32 for N = 7168, M = 64).
_FILL_NUM, _FILL_DEN = 4, 5


# The wave model (`_wave_rung`): for an unsplit shape from WAVE_MODEL_FROM_M rows, while the fixed
# tile runs at most WAVE_MODEL_MAX_WAVES waves, the rung with the least estimated time, where
# time = waves x tile area / TILE_SPEED. The fill rule only asks whether a rung gives every
# SM a tile; it never sees a partial last wave or a partial row tile, and between the powers of two
# those cost up to half the time (4096 x 4096 at M = 1280: 160 tiles of 128 x 256 on 132 SMs run as
# two waves where 1024 rows run as one; 0.61x cuBLAS, 0.72x through 64 x 128 tiles).
# TILE_SPEED: output elements per unit time of each ladder tile with every SM busy, 128 x 256 = 1,
# measured on an H100 at M = 8192 (4096 x 4096, 2048 x 7168, 7168 x 2048, graph-replayed,
# 2026-12-06; the medians). A tie goes to the earlier tile of _LADDER. Below WAVE_MODEL_FROM_M rows
# a tile is memory-bound, these speeds do not hold, and the fill rule's picks measured well
# (0.89-1.08x cuBLAS at M <= 64).
TILE_SPEED = {(128, 256): 1.0, (64, 256): 0.9, (128, 128): 0.9, (64, 128): 0.78, (64, 64): 0.46,
              (64, 32): 0.29, (64, 16): 0.16}
WAVE_MODEL_FROM_M = 65
WAVE_MODEL_MAX_WAVES = 8
# another tile must be estimated this much faster than the fixed one to be taken: one tile's speed
# varies by ~0.05 from shape to shape (64 x 256: 0.88-0.95), so a smaller estimated gain is noise
_WAVE_MARGIN = 0.95


def _tile_cost(cfg: MMConfig) -> float:
    """One wave of cfg's tiles in the model's time unit: its area over its speed."""
    return cfg.block_m * tile_n(cfg) / TILE_SPEED[(cfg.block_m, tile_n(cfg))]


# (rung, its rows, its columns, one wave's cost) in _LADDER's order: a call at a new M (a new token
# count, eager) evaluates the model, so its loop does integer arithmetic only
_LADDER_COSTS = [(cfg, cfg.block_m, tile_n(cfg), _tile_cost(cfg)) for cfg in _LADDER]


def _wave_model_applies(base: MMConfig) -> bool:
    return base.split_k == 1 and not base.bands and (base.block_m, tile_n(base)) in TILE_SPEED


def _wave_model_last_m(n: int, base: MMConfig, sms: int) -> int:
    """The last M at which the fixed tile runs at most WAVE_MODEL_MAX_WAVES waves."""
    return (WAVE_MODEL_MAX_WAVES * sms // cdiv(n, tile_n(base))) * base.block_m


def _cheapest_tile(m: int, n: int, sms: int, skip: tuple[int, int] | None = None) -> tuple[MMConfig | None, float]:
    """The ladder tile the model estimates fastest over [m, n] (a tie keeps the earlier, more
    efficient tile of _LADDER), and that estimate; `skip`: a tile shape left out."""
    best, best_time = None, float("inf")
    for cfg, rows, cols, cost in _LADDER_COSTS:
        if (rows, cols) == skip:
            continue
        tiles = ((m + rows - 1) // rows) * ((n + cols - 1) // cols)  # output_tiles, without its calls
        t = ((tiles + sms - 1) // sms) * cost
        if t < best_time:
            best, best_time = cfg, t
    return best, best_time


def _wave_rung(m: int, n: int, base: MMConfig, sms: int) -> MMConfig | None:
    """The wave model's pick (base itself where it wins), or None where the model does not apply:
    one tile, or a row split where the model estimates it faster than any one tile."""
    if not _wave_model_applies(base) or not WAVE_MODEL_FROM_M <= m <= _wave_model_last_m(n, base, sms):
        return None
    base_time = cdiv(output_tiles(m, n, base), sms) * _tile_cost(base)
    best, best_time = _cheapest_tile(m, n, sms, skip=(base.block_m, tile_n(base)))
    if best_time >= base_time * _WAVE_MARGIN:
        best, best_time = base, base_time
    split = _split_estimate(m, n, base, sms)
    if split is not None and split[1] < best_time * _WAVE_MARGIN:
        return split[0]
    return best


# The row split: where the fixed tile leaves a partial last wave, the rows that fill whole waves
# of it run first, and the rest through the tile the model finds cheapest for that many rows, a
# second launch into the same output. Its estimate is the sum of the two launches (they run one
# after the other). Measured as a probe on an H100 (2026-12-06, graph-replayed, cuBLAS / zmrl):
# 4096 x 4096 at M = 1280 0.71 -> 0.80, 1536 0.87 -> 0.98, 2560 0.87 -> 0.96; 7168 x 2048 at
# 1280 0.77 -> 0.84, 2560 0.77 -> 0.93; every one of 340 combinations gave the fixed config's bits
# (docs/benchmarks.md, "a row split for the partial last wave").
def _bulk_rows(m: int, n: int, bulk: MMConfig, sms: int) -> int:
    """The rows whose tiles of `bulk` fill whole waves on `sms` SMs (as many waves as fit in m)."""
    col_tiles = cdiv(n, tile_n(bulk))
    waves = output_tiles(m, n, bulk) // sms
    return (waves * sms // col_tiles) * bulk.block_m


def _split_estimate(m: int, n: int, base: MMConfig, sms: int) -> tuple[MMConfig, float] | None:
    """(base with a tail, the estimate) for m rows, or None where whole waves leave no rows over
    or the tail would take base's own tile."""
    m1 = _bulk_rows(m, n, base, sms)
    if not 0 < m1 < m:
        return None
    tail, tail_time = _cheapest_tile(m - m1, n, sms)
    if (tail.block_m, tile_n(tail)) == (base.block_m, tile_n(base)):
        return None
    return _with_tail(base, tail), cdiv(output_tiles(m1, n, base), sms) * _tile_cost(base) + tail_time


# cached: a call at a new M builds these, and dataclasses.replace costs ~10 us of host time
@functools.lru_cache(maxsize=None)
def _with_tail(cfg: MMConfig, tail: MMConfig | None) -> MMConfig:
    return dataclasses.replace(cfg, tail=tail)


def row_parts(m: int, n: int, cfg: MMConfig, sms: int) -> list[tuple[int, int, MMConfig]]:
    """(first row, end row, config) of each launch a config makes over m rows: one, or for a row
    split the bulk (whole waves of cfg's tiles) and the tail. The split point depends only on
    (m, n, cfg, sms), so the self-check's probes split where the public path does."""
    if cfg.tail is None:
        return [(0, m, cfg)]
    bulk = _with_tail(cfg, None)
    m1 = _bulk_rows(m, n, bulk, sms)
    if not 0 < m1 < m:
        return [(0, m, bulk)]
    return [(0, m1, bulk), (m1, m, cfg.tail)]


def _rungs_for_rows(m: int) -> list[MMConfig]:
    return _SMALL_LADDER if m <= SMALL_M else _MID_LADDER if m <= MID_M else _LADDER


def _fills(m: int, n: int, cfg: MMConfig, sms: int, splits: int = 1) -> bool:
    return _FILL_DEN * output_tiles(m, n, cfg) * splits >= _FILL_NUM * sms


def _with_splits(cfg: MMConfig, base: MMConfig) -> MMConfig:
    """A rung of a split-K shape splits K exactly as its fixed config does."""
    if base.split_k == 1:
        return cfg
    stages = cfg.num_stages
    while stages > 2 and _split_smem(cfg, stages) > _SPLIT_SMEM_BUDGET:
        stages -= 1
    return dataclasses.replace(cfg, split_k=base.split_k, num_stages=stages)


# A split-K tile stores an fp32 partial through shared memory (BM x BN x 4 bytes next to the
# pipeline's buffers): tiles above 128 x 128 are not ladder rungs of a split shape, and a rung
# drops pipeline stages (which change no arithmetic) until its buffers fit an H200's 227 KiB.
_SPLIT_MAX_TILE = 128 * 128
_SPLIT_SMEM_BUDGET = 216 * 1024


def _usable_rungs(rungs: list[MMConfig], base: MMConfig) -> list[MMConfig]:
    return rungs if base.split_k == 1 else [c for c in rungs if c.block_m * tile_n(c) <= _SPLIT_MAX_TILE]


def _split_smem(cfg: MMConfig, stages: int) -> int:
    return stages * (cfg.block_m + tile_n(cfg)) * cfg.block_k * 2 + cfg.block_m * tile_n(cfg) * 4


def _inline_ok(cfg: MMConfig) -> bool:
    """Whether a tile may reduce a split shape's K ranges one after another in one program: a
    wgmma tile (64+ rows and columns) whose two fp32 accumulators (the running sum and the
    current range's) take at most 64 + 64 registers per thread."""
    return cfg.block_m >= 64 and cfg.block_n >= 64 and cfg.block_m * tile_n(cfg) <= 64 * 32 * cfg.num_warps


def _inline_rung(m: int, n: int, base: MMConfig, sms: int) -> MMConfig | None:
    """For a split shape, once such a tile fills the SMs without splitting K, the split's fp32
    workspace and second kernel buy nothing: that tile, reducing the same K ranges in-program
    (the same fp32 additions in the same order, so the same bits; the self-check compares)."""
    if base.split_k == 1 or m <= MID_M:
        return None
    for cfg in _LADDER:
        if _inline_ok(cfg) and _fills(m, n, cfg, sms):
            return dataclasses.replace(cfg, split_k=base.split_k, split_inline=True)
    return None


def banded(base: MMConfig, bands: list[tuple[int | None, MMConfig]]) -> MMConfig:
    """`base` with the rung measured fastest in each band of M: [(last M, config), ..., (None,
    config)]. Every rung splits K exactly as `base` does (its split count and K alignment; a
    rung reducing the ranges in-program says split_inline), so the bands change which program
    computes what, never the additions. Split rungs drop pipeline stages until they fit, as the
    fill rule's rungs do."""
    if base.split_k > 1 and (not base.k_align or base.k_align % base.block_k):
        raise ValueError(f"a split base needs a K alignment that its BLOCK_K {base.block_k} divides, "
                         f"got k_align={base.k_align}")
    rungs = []
    for i, (hi, cfg) in enumerate(bands):
        if (hi is None) != (i == len(bands) - 1) or (i and hi is not None and hi <= bands[i - 1][0]):
            raise ValueError(f"bands must ascend and end with None: {[h for h, _ in bands]}")
        if base.split_k > 1 and base.k_align % cfg.block_k:
            raise ValueError(f"BLOCK_K {cfg.block_k} does not divide the K alignment {base.k_align}")
        check_sub_n(cfg)
        rung = cfg if base.split_k == 1 or cfg.split_inline else _with_splits(cfg, base)
        rungs.append((hi, dataclasses.replace(rung, split_k=base.split_k, k_align=base.k_align)))
    return dataclasses.replace(base, bands=tuple(rungs))


# Narrow shapes: too few output tiles for 132 SMs at small M, so K is split into 4 ranges of
# 1792 (the partition is the shape's, never M's; _splitk.py), and each band of M runs the rung
# `benchmarks/narrow_gemm.py --sweep` measured fastest there on an H200 (2026-12-03): ranges
# reduced by separate programs up to a few hundred rows, one after another in one program above.
# The 192-column tiles (three 64-column sub-tiles, sub_n=3: no partial tile on 576 = 3 x 192 or
# 1536 = 8 x 192) won where two sweeps on an H100 agreed (2026-12-05, 1536 at M = 512 and 2048,
# 576 at M = 1024 and 4096); elsewhere the H200's picks stand. Re-swept on an H100 between the
# powers of two (2026-12-07): 1536 at M = 193-256 takes the 64-row 192-column tile (0.84 of cuBLAS
# against 0.78-0.80), 576 at M = 513-768 keeps the 128 x 128 tile of the band below (0.90 against
# 0.66-0.71 at M = 768: one wave of 6 x 5 x 4 programs on 132 SMs).
_SPLIT4 = dict(split_k=4, k_align=256)
_ONE_TILE_PER_PROGRAM = dict(num_warps=4, num_stages=4, persistent=False)
_IN_PROGRAM_128 = MMConfig(128, 128, 64, num_warps=8, num_stages=4, split_inline=True)
_TILE_128 = MMConfig(128, 128, 64, num_warps=4, num_stages=4)
_SUB_TILED_128 = dict(num_warps=8, num_stages=3, sub_n=3)  # 128 x (3 x 64)
TUNED[(torch.bfloat16, 1536, 7168)] = banded(MMConfig(64, 128, 64, num_warps=4, num_stages=4, **_SPLIT4), [
    (16, MMConfig(16, 64, 256, **_ONE_TILE_PER_PROGRAM)),
    (32, MMConfig(32, 64, 256, **_ONE_TILE_PER_PROGRAM)),
    (64, MMConfig(64, 64, 128, **_ONE_TILE_PER_PROGRAM)),
    (128, MMConfig(64, 128, 64, num_warps=4, num_stages=4)),
    (192, _TILE_128),
    (256, MMConfig(64, 64, 64, num_warps=4, num_stages=4, sub_n=3)),
    (512, MMConfig(128, 64, 64, **_SUB_TILED_128)),
    (1024, _IN_PROGRAM_128),
    (2048, MMConfig(128, 64, 64, split_inline=True, **_SUB_TILED_128)),
    (None, _IN_PROGRAM_128),
])
TUNED[(torch.bfloat16, 576, 7168)] = banded(MMConfig(128, 64, 64, num_warps=4, num_stages=4, **_SPLIT4), [
    (16, MMConfig(16, 32, 256, **_ONE_TILE_PER_PROGRAM)),
    (32, MMConfig(32, 32, 256, **_ONE_TILE_PER_PROGRAM)),
    (128, MMConfig(64, 64, 128, **_ONE_TILE_PER_PROGRAM)),
    (256, MMConfig(128, 64, 64, num_warps=4, num_stages=4)),
    (768, _TILE_128),
    (1024, MMConfig(128, 64, 64, **_SUB_TILED_128)),
    (2048, _IN_PROGRAM_128),
    (4096, MMConfig(128, 64, 64, split_inline=True, **_SUB_TILED_128)),
    (None, _IN_PROGRAM_128),
])

# An unsplit narrow shape (one K loop, so any tile gives the same bits): 64-row tiles 256 wide
# where 128-row tiles would multiply mostly zero rows, and 128 x 128 tiles where 128 x 256 ones
# leave a partial second wave (`--sweep --shape 24576x1536 --splits 1`, H200, 2026-12-03; on an
# H100, 2026-12-07, the 64 x 256 tile again at M = 257-320: 0.71-0.76 of cuBLAS against 0.57-0.64).
_WIDE_LOW = MMConfig(64, 256, 64, num_warps=4, num_stages=4)
_BASE_24576 = TUNED[(torch.bfloat16, 24576, 1536)]
TUNED[(torch.bfloat16, 24576, 1536)] = banded(_BASE_24576, [
    (16, MMConfig(16, 64, 256, **_ONE_TILE_PER_PROGRAM)),
    (32, MMConfig(32, 64, 256, **_ONE_TILE_PER_PROGRAM)),
    (96, _WIDE_LOW),
    (128, _BASE_24576),
    (192, _WIDE_LOW),
    (256, _TILE_128),
    (320, _WIDE_LOW),
    (384, _TILE_128),
    (None, _BASE_24576),
])


def _unbanded(base: MMConfig) -> MMConfig:
    """The fixed config as a band's rung spells it (without the bands)."""
    return dataclasses.replace(base, bands=())


def _rung_for(m: int, n: int, base: MMConfig, sms: int) -> MMConfig:
    """The most efficient rung that still gives ~every SM a tile; base for its own tile shape.
    A measured shape (base.bands) takes its band's rung instead; from WAVE_MODEL_FROM_M rows the
    wave model's pick, which may be a row split."""
    if base.bands:
        rung = next(cfg for hi, cfg in base.bands if hi is None or m <= hi)
        return base if rung == _unbanded(base) else rung  # a band may run the fixed tile itself
    inline = _inline_rung(m, n, base, sms)
    if inline is not None:
        return inline
    by_waves = _wave_rung(m, n, base, sms)
    if by_waves is not None:
        return by_waves
    rungs = _usable_rungs(_rungs_for_rows(m), base)
    for cfg in rungs:
        if _fills(m, n, cfg, sms, base.split_k):
            return base if (cfg.block_m, cfg.block_n) == (base.block_m, base.block_n) else _with_splits(cfg, base)
    return _with_splits(rungs[-1], base)


def pads_rows(m: int, cfg: MMConfig) -> bool:
    """Whether the ladder copies a lone partial row tile into zero rows first: for 64/128-row
    tiles (a TMA box mostly past the tensor's edge was slower); not for 16/32-row tiles
    (measured slower with the copy)."""
    return m < cfg.block_m and cfg.block_m > MID_M


def _ladder_applies(dtype: torch.dtype, base: MMConfig) -> bool:
    return dtype != torch.float32 and base.block_k == 64


def ladder_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms_: int = 132) -> MMConfig:
    """The ladder's tile for this M (ignoring the self-check; see the module docstring)."""
    base = config_for(n, k, dtype)
    if INTERPRET or not _ladder_applies(dtype, base):
        return base
    return _rung_for(m, n, base, num_sms_)


def ladder_plan(n: int, base: MMConfig, sms: int) -> list[tuple[MMConfig, int, int | None]]:
    """(rung, first M, last M or None) for every range of M in which the ladder picks a tile
    other than `base`. The pick only changes where some rung starts to fill the SMs, so the
    ranges are found from those thresholds, not by trying every M."""
    if base.bands:
        los = [1] + [hi + 1 for hi, _ in base.bands[:-1]]
        return [(cfg, lo, hi) for lo, (hi, cfg) in zip(los, base.bands) if cfg != _unbanded(base)]
    points = {1, SMALL_M + 1, MID_M + 1}
    for cfg in _usable_rungs(_LADDER, base):
        need = cdiv(_FILL_NUM * sms, _FILL_DEN * cdiv(n, tile_n(cfg)) * base.split_k)  # row tiles that fill the SMs
        points.add(max(1, (need - 1) * cfg.block_m + 1))
    if base.split_k > 1:  # where a tile starts to fill the SMs unsplit (_inline_rung)
        for cfg in filter(_inline_ok, _LADDER):
            need = cdiv(_FILL_NUM * sms, _FILL_DEN * cdiv(n, tile_n(cfg)))
            points.add(max(MID_M + 1, (need - 1) * cfg.block_m + 1))
    if _wave_model_applies(base):  # its picks change only where some tile's row-tile count does
        last = _wave_model_last_m(n, base, sms)
        step = min(c.block_m for c in _LADDER)  # every ladder tile's rows are a multiple of this
        # last + 1, where the fill rule takes over, is among them: last is a multiple of the step
        points.update(range(WAVE_MODEL_FROM_M, last + 2, step))
    points = sorted(points)
    ranges: list[list] = []
    for i, lo in enumerate(points):
        hi = points[i + 1] - 1 if i + 1 < len(points) else None
        rung = _rung_for(lo, n, base, sms)
        if ranges and ranges[-1][0] == rung:
            ranges[-1][2] = hi
        else:
            ranges.append([rung, lo, hi])
    return [(rung, lo, hi) for rung, lo, hi in ranges if rung != base]


def split_align(dtype: torch.dtype, cfg: MMConfig) -> int:
    """K-range alignment of a split-K config: a multiple of every BLOCK_K the ladder may run
    the shape with (so every rung splits K at the same k), else the config's own BLOCK_K."""
    if cfg.k_align:
        return cfg.k_align
    if INTERPRET or dtype == torch.float32:
        return cfg.block_k
    return max(cfg.block_k, _MAX_RUNG_BLOCK_K)

