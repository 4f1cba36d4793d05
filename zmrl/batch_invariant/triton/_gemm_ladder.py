"""The GEMM tile ladder's self-check and the per-call tile selection.

The tile ladder (bf16/fp16, ZMRL_GEMM_LADDER=auto, the default). One fixed tile shape leaves
most SMs idle at small M (a 64-row problem is 16-32 tiles of 128x256 for 132 SMs), and no
M-dependent split-K may add parallelism. The ladder picks, from M, a smaller tile M/N shape that
gives ~every SM a tile: 16-row tiles for M <= 16 and 32-row tiles for M <= 32, whose dots Triton
issues as mma.sync m16n8k16 instructions, and 64/128-row tiles (64x16 ... 128x256, wgmma)
above (the rungs: _gemm_config.py; a narrow shape's table entry names its rung per band of M
instead, measured, `banded`). Every rung keeps the same ascending K loop into one fp32
accumulator (per K range, for a split-K shape: a rung splits K exactly where the fixed config
does) and the same epilogue (round to the output dtype, then add the bias). Triton lowers
`acc = tl.dot(a, b, acc)` to a chain of 16-deep tensor-core steps, each accumulating into `acc`
in ascending k, so BLOCK_K (64 for the fixed configs, 128-1024 for the small rungs, which need
more bytes in flight per SM) only sets how many steps run between two loads, not their order.
(Past K, TMA reads zeros; a deeper block can add trailing steps whose 16 products are all zero,
which leaves the accumulator's value unchanged: at most an exact -0.0 result could come out as
+0.0.) So the contract's intent, "each output element reduces K in one fixed order", is kept
by construction: what changes with M is only which program computes which rows and columns,
and the instruction shape (and warp count) that multiplies one 16-deep k step. This departs
from the letter of the original contract ("tile configuration chosen from (N, K, dtype) only,
never from M") to keep its intent (docs/design.md, "Matmul"). Whether the tensor cores'
per-element result for one k step is independent of that instruction shape (wgmma m64nNk16 vs
mma.sync m16n8k16) is NOT promised by any NVIDIA or Triton document; it was observed on an
H200 (every rung, every row, three shapes; a sweep of 444 candidate tiles found none that
differs). Hence the self-check:

  On the first call of a process for a (device name, SM count, N, K, dtype, B layout) at an M
  whose rung differs from the fixed config, every rung the ladder can pick for that shape (a
  row split, _gemm_config.row_parts, run as its two launches) runs on probe inputs (seeded
  random activations with rows of magnitudes 2^-12 ... 2^12 and
  rows mixing magnitudes within the row, against a random weight and the caller's own
  operand B, in the caller's layout; and for each weight the same activations with odd rows
  cancelling against it, zmrl.batch_invariant._probes: a bf16 output hides an fp32-level change
  of the K order or of a step's rounding from random rows unless it lands near a tie, and shows
  it on those rows), at M values inside each rung's first and last range of M (their first and
  last M, partial and full row tiles, zero-padded lone tiles exactly as the public path
  runs them), and each result is compared bit for bit (torch.equal) with the fixed config's
  rows. Only if every rung matches on every probe does that shape use the ladder;
  otherwise it keeps the fixed config for the rest of the process, and ladder_decision() /
  ladder_decisions() say which rung differed where (or which error a rung raised). An M at
  which the ladder picks the fixed tile anyway needs no check. The check never runs
  during CUDA-graph capture: an undecided shape then takes the fixed config for that call
  and is decided at its next uncaptured call. The interpreter (TRITON_INTERPRET=1), fp32
  (BLOCK_K 16 FMA path), batched bmm (B > 1) and ZMRL_GEMM_LADDER=off always take the fixed
  config (so bmm with B = 1 agreeing with B > 1 rests on the same check).

  What it proves: on this GPU, driver, Triton build and shape, the ladder's kernels agreed
  with the fixed kernel on every probe element (for 4096- and 7168-wide shapes dozens of rung launches and
  ~40 million length-K dot products per weight/activation pair, three pairs), i.e. on those
  data no rung behaves like a different reduction order. What it does not prove: agreement
  on data it did not try (a difference that only shows on rare inputs, e.g. one exponent
  alignment inside an instruction's partial sums, subnormals, inf or NaN, could escape it),
  agreement on another GPU, driver or Triton build (each process checks its own device), or
  the bias epilogue (not probed: the bias is added elementwise after rounding, the same code
  in every rung). Cost: compiling the rungs, seconds once per process; then a few hundred small
  launches once per new (N, K) of a forward GEMM (365-570 probes, 0.18-1.18 s with the first
  compiles, for 4096 x 4096, 2048 x 7168 and 7168 x 2048 on an H100, row splits included,
  2026-12-06).

  The autograd backward's GEMMs do not come here: they run cuBLAS (matmul.py), since gradients
  must be deterministic, not batch-invariant.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time

import torch

from zmrl.batch_invariant._probes import cancelling_rows
from zmrl.batch_invariant.triton import _gemm_plan
from zmrl.batch_invariant.triton._common import INTERPRET, device_index, num_sms
from zmrl.batch_invariant.triton._gemm_config import (
    MMConfig,
    _ladder_applies,
    _rung_for,
    config_for,
    ladder_plan,
    pads_rows,
    row_parts,
    tile_name,
)
from zmrl.batch_invariant.triton._gemm_kernel import launch_config, row_views


PROBE_ROWS_MAX = 8192
CANCELLING_ROWS = 1024  # cancelling probe rows per weight ([K, rows] of fp32 scratch while they are made)


def _probe_ms(cfg: MMConfig, lo: int, hi: int | None) -> tuple[int, ...]:
    """M values inside [lo, hi] that the self-check runs one rung at: both ends, a lone
    partial tile, one short of / exactly / past a full row tile."""
    top = hi if hi is not None else lo + 2 * cfg.block_m + 5
    bm = cfg.block_m
    cand = {lo, lo + 1, lo + 2, lo + bm // 2 + 3, lo + bm - 1, lo + bm, lo + 2 * bm + 5, top - 1, top}
    ms = sorted(m for m in cand if lo <= m <= top)
    small = [m for m in ms if m <= PROBE_ROWS_MAX]
    return tuple(small or ms[:2])


def _rung_probes(plan: list[tuple[MMConfig, int, int | None]]) -> list[tuple[MMConfig, list, tuple[int, ...]]]:
    """(rung, its ranges of M, probe M values) once per distinct rung of a ladder plan, probed inside
    its first and its last range: a rung's bits cannot depend on which range it runs in (the same
    tile and K loop), and a rung the wave model picks can own dozens of short ranges."""
    by_rung: dict[MMConfig, list[tuple[int, int | None]]] = {}
    for cfg, lo, hi in plan:
        by_rung.setdefault(cfg, []).append((lo, hi))
    out = []
    for cfg, ranges in by_rung.items():
        ms = set(_probe_ms(cfg, *ranges[0])) | set(_probe_ms(cfg, *ranges[-1]))
        out.append((cfg, ranges, tuple(sorted(ms))))
    return out


def _ranges_text(ranges: list[tuple[int, int | None]]) -> str:
    text = ", ".join(f"{lo}..{hi if hi else 'inf'}" for lo, hi in ranges[:3])
    return text + (f" (+{len(ranges) - 3} more)" if len(ranges) > 3 else "")


@dataclasses.dataclass(frozen=True)
class LadderDecision:
    """Whether one (device, N, K, dtype, B layout) uses the ladder in this process, and why."""
    device: str
    sms: int
    n: int
    k: int
    dtype: str
    b_layout: str
    use_ladder: bool
    reason: str
    rungs: tuple[str, ...] = ()
    probes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_DECISIONS: dict[tuple, LadderDecision] = {}
_LOCK = threading.Lock()


def ladder_mode() -> str:
    """ZMRL_GEMM_LADDER: "auto" (default: the ladder where its self-check passed) or "off"."""
    mode = os.environ.get("ZMRL_GEMM_LADDER", "auto").strip().lower() or "auto"
    if mode not in ("auto", "off"):
        raise ValueError(f"ZMRL_GEMM_LADDER={mode!r}: expected 'auto' or 'off'")
    return mode


def ladder_decisions() -> list[dict]:
    """Every self-check this process ran, one dict per (device, N, K, dtype, B layout)."""
    with _LOCK:
        return [d.as_dict() for d in _DECISIONS.values()]


def ladder_decision(n: int, k: int, dtype: torch.dtype, b_layout: str = "k_major",
                    device: torch.device | str | None = None) -> dict:
    """This process's decision for one shape, without running anything: the self-check's
    record if it ran, else why the fixed config is used (or that no call needed a rung yet)."""
    device = _default_device(device)
    name, sms = _device_info(device)
    with _LOCK:
        dec = _DECISIONS.get((name, sms, n, k, dtype, b_layout))
    if dec is not None:
        return dec.as_dict()
    base = config_for(n, k, dtype)
    reason = _static_reason(dtype, base) or "undecided: no call has needed a rung other than the fixed config yet"
    return LadderDecision(name, sms, n, k, str(dtype).replace("torch.", ""), b_layout, False, reason).as_dict()


def reset_ladder_decisions() -> None:
    """Forget every decision and every launch plan made from one (tests, a changed TUNED
    table; a later call selects and checks again)."""
    with _LOCK:
        _DECISIONS.clear()
        _gemm_plan.clear()


def _default_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
    return torch.device(device)


def _static_reason(dtype: torch.dtype, base: MMConfig) -> str | None:
    """Why this call takes the fixed config without any check, or None."""
    if ladder_mode() == "off":
        return "fixed config: ZMRL_GEMM_LADDER=off"
    if INTERPRET:
        return "fixed config: the interpreter (TRITON_INTERPRET=1) keeps it"
    if not _ladder_applies(dtype, base):
        return f"fixed config: {str(dtype).replace('torch.', '')} with BLOCK_K {base.block_k} has no ladder"
    return None


@functools.lru_cache(maxsize=None)
def _device_info(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return f"{device.type} (interpreter)" if INTERPRET else device.type, num_sms(None)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_name(idx), num_sms(idx)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _run_gemm(x: torch.Tensor, b: torch.Tensor, cfg: MMConfig, pad: bool) -> torch.Tensor:
    """One probe: x [M, K] x b [1, K, N] with an explicit config (no selection, no launch plan);
    a row split launches its parts where the public path would, each padded as it would be."""
    out = torch.empty(1, x.shape[0], b.shape[2], dtype=x.dtype, device=x.device)
    if cfg.tail is None:
        launch_config(x[None], b, None, cfg, pad, out)
        return out[0]
    for lo, hi, part in row_parts(x.shape[0], b.shape[2], cfg, num_sms(device_index(x))):
        rows_x, rows_out = row_views(x[None], out, lo, hi)  # the views the public path launches
        launch_config(rows_x, b, None, part, pads_rows(hi - lo, part), rows_out)
    return out[0]


def _probe_inputs(rows: int, n: int, k: int, dtype: torch.dtype, layout: str, device: torch.device,
                  b: torch.Tensor | None) -> tuple[list[torch.Tensor], list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """Two activation matrices (rows of magnitudes 2^-12 ... 2^12; every third row mixes
    magnitudes 2^-8 ... 2^8 inside the row) and the weights to try: a random one in `layout`,
    then the caller's own b, each with a third activation matrix made against it: the first one
    with odd rows (up to CANCELLING_ROWS of them) replaced by zmrl.batch_invariant._probes'
    cancelling rows, which show a change of the K order (or of how a step of it rounds) through
    the bf16 output's rounding, where random rows show it only near a tie."""
    g = torch.Generator(device=device)
    g.manual_seed(0x2A6E)
    xs = []
    for _ in range(2):
        x = torch.randn(rows, k, generator=g, device=device)
        row_exp = torch.randint(-12, 13, (rows, 1), generator=g, device=device).float()
        elem_exp = torch.randint(-8, 9, (rows, k), generator=g, device=device).float()
        mixed = (torch.arange(rows, device=device) % 3 == 2)[:, None]
        xs.append((x * torch.exp2(torch.where(mixed, elem_exp, row_exp))).to(dtype))
    w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
    w = w * torch.exp2(torch.randint(-4, 5, (n, 1), generator=g, device=device).float())
    w = w.to(dtype)
    rand_b = (w.t() if layout == "k_major" else w.t().contiguous())[None]
    bs = [("random weight", rand_b)] + ([("the caller's operand", b)] if b is not None else [])
    return xs, [(name, bp, _against(xs[0], bp[0])) for name, bp in bs]


def _against(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x with its odd rows (at most CANCELLING_ROWS) cancelling against b [K, N]."""
    out = x.clone()
    count = min(x.shape[0] // 2, CANCELLING_ROWS)
    out[1:2 * count:2] = cancelling_rows(b, count, x.dtype)
    return out


def _self_check(key: tuple, base: MMConfig, device: torch.device, b: torch.Tensor | None) -> LadderDecision:
    """Run every rung that can be picked for this shape on the probes; see the module docstring."""
    t0 = time.perf_counter()
    name, sms, n, k, dtype, layout = key
    info = dict(device=name, sms=sms, n=n, k=k, dtype=str(dtype).replace("torch.", ""), b_layout=layout)
    plan = _rung_probes(ladder_plan(n, base, sms))
    rungs = tuple(f"{tile_name(c)} w{c.num_warps} s{c.num_stages}"
                  f"{f' split {c.split_k}' if c.split_k > 1 else ''}{' in-program' if c.split_inline else ''} "
                  f"M={_ranges_text(ranges)} probed at M={list(ms)}" for c, ranges, ms in plan)
    if not plan:
        return LadderDecision(**info, use_ladder=False, reason="no rung other than the fixed config can be picked")
    probes = 0
    try:
        with torch.no_grad():
            xs, bs = _probe_inputs(max(max(ms) for *_, ms in plan), n, k, dtype, layout, device, b)
            for b_name, bp, cancelling in bs:
                for xi, x in enumerate([*(xs if b_name == "random weight" else xs[:1]), cancelling]):
                    fixed = _run_gemm(x, bp, base, False)
                    for cfg, _, ms in plan:
                        for m in ms:
                            got = _run_gemm(x[:m], bp, cfg, pads_rows(m, cfg))
                            probes += 1
                            if not torch.equal(got, fixed[:m]):
                                diff = (got != fixed[:m]).nonzero()
                                return LadderDecision(
                                    **info, use_ladder=False, rungs=rungs, probes=probes,
                                    seconds=time.perf_counter() - t0,
                                    reason=f"fixed config: rung {tile_name(cfg)} (w{cfg.num_warps}"
                                           f"{', split in-program' if cfg.split_inline else ''}) "
                                           f"differs at M={m}, {b_name}, activations "
                                           f"{'cancelling against it' if x is cancelling else xi}: {len(diff)} "
                                           f"elements, first at row {int(diff[0, 0])} col {int(diff[0, 1])}")
    except Exception as e:  # noqa: BLE001 - a rung that cannot run here means: keep the fixed config
        return LadderDecision(**info, use_ladder=False, rungs=rungs, probes=probes, seconds=time.perf_counter() - t0,
                              reason=f"fixed config: a probe raised {type(e).__name__}: {str(e)[:300]}")
    return LadderDecision(**info, use_ladder=True, rungs=rungs, probes=probes, seconds=time.perf_counter() - t0,
                          reason=f"ladder: {len(plan)} rungs equal the fixed config bit for bit on {probes} probes")


def _select(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, layout: str,
            b: torch.Tensor | None, batches: int = 1) -> tuple[MMConfig, bool]:
    """The public path's (config, pad_rows) for one call: the fixed config, or the ladder's
    rung where this shape's self-check passed."""
    base = config_for(n, k, dtype)
    if batches != 1 or _static_reason(dtype, base) is not None:
        return base, False
    name, sms = _device_info(device)
    rung = _rung_for(m, n, base, sms)
    if rung == base:
        return base, False  # the ladder picks the fixed tile at this M: nothing to check
    key = (name, sms, n, k, dtype, layout)
    dec = _DECISIONS.get(key)
    if dec is None:
        if _capturing(device):
            return base, False  # never probe inside a CUDA graph; decide at the next eager call
        with _LOCK:
            dec = _DECISIONS.get(key)
            if dec is None:
                dec = _DECISIONS[key] = _self_check(key, base, device, b)
    if not dec.use_ladder:
        return base, False
    return rung, pads_rows(m, rung)


def chosen_config(m: int, n: int, k: int, dtype: torch.dtype, b_layout: str = "k_major",
                  device: torch.device | str | None = None) -> tuple[MMConfig, bool]:
    """(config, pad_rows) the public path takes for x [M, K] @ B [K, N] (bmm with B = 1
    included) in this process; runs the shape's self-check (random weight only) if a rung
    is needed and none ran yet."""
    return _select(m, n, k, dtype, _default_device(device), b_layout, None)
