"""`zmrl report RUN_DIR`: PNG plots and a short text summary from RUN_DIR/metrics.jsonl."""
from __future__ import annotations

from pathlib import Path

from zmrl.rl.tracking import load_metrics

PLOTS = {
    "reward.png": ("reward", ["reward/mean", "reward/full_credit_frac"]),
    "mismatch.png": ("rollout vs trainer (exactly 0 = zero mismatch)",
                     ["mismatch/logprob_abs_diff_max", "mismatch/tokens_different", "mismatch/kl",
                      "mismatch/ratio_first_minibatch_max_abs_dev"]),
    "kl_ref.png": ("KL to the reference policy (k1, sampled tokens)", ["policy/kl_ref"]),
    "throughput.png": ("throughput", ["throughput/tokens_per_s"]),
    "time.png": ("seconds per step", ["time/rollout_s", "time/train_s"]),
}
MISMATCH_KEYS = PLOTS["mismatch.png"][1]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _warnings(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """-> (one row per step, the last one written; WARNING lines about duplicated or unordered steps)."""
    counts = {}
    for r in rows:
        counts[r["step"]] = counts.get(r["step"], 0) + 1
    out = []
    repeated = sorted(s for s, c in counts.items() if c > 1)
    if repeated:
        out.append(f"WARNING: steps {repeated[:10]}{' ...' if len(repeated) > 10 else ''} appear more than once "
                   f"({len(rows) - len(counts)} extra rows: two runs wrote into this run dir, or a resume was not "
                   f"cut back); the summary uses the last row of each step")
    order = [r["step"] for r in rows]
    if not repeated and order != sorted(order):
        out.append("WARNING: steps are not in increasing order in metrics.jsonl")
    last = {r["step"]: r for r in rows}
    return [last[s] for s in sorted(last)], out


def mismatch_line(rows: list[dict]) -> str:
    """'exactly 0 at every step' only when every mismatch value of every step is present and 0."""
    nonzero = [r["step"] for r in rows if any(r.get(m) not in (None, 0) for m in MISMATCH_KEYS)]
    unknown = [r["step"] for r in rows if any(r.get(m) is None for m in MISMATCH_KEYS)]
    if not nonzero and not unknown:
        return "mismatch: exactly 0 at every step (" + ", ".join(MISMATCH_KEYS) + ")"
    parts = []
    if nonzero:
        parts.append(f"NON-ZERO at steps {nonzero[:10]}")
    if unknown:
        parts.append(f"NOT RECORDED (null: non-finite or missing) at steps {unknown[:10]}")
    return "mismatch: " + "; ".join(parts)


def summarize(rows: list[dict], run_dir: str, skipped: list[str] = ()) -> str:
    def mean(key, part):
        vals = [r[key] for r in part if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    logged = len(rows)
    rows, warnings = _warnings(rows)
    warnings = [f"WARNING: {s}" for s in skipped] + warnings
    k = max(1, min(5, len(rows) // 4))
    head, tail = rows[:k], rows[-k:]
    total_time = sum((r.get("time/rollout_s") or 0) + (r.get("time/train_s") or 0) for r in rows)
    lines = [
        f"run: {run_dir}",
        *warnings,
        f"steps: {rows[0]['step']}..{rows[-1]['step']} ({logged} logged)",
        f"reward/mean: {mean('reward/mean', head):.4f} (first {k} steps) -> {mean('reward/mean', tail):.4f} (last {k})",
        f"reward/full_credit_frac: {mean('reward/full_credit_frac', head):.4f} -> {mean('reward/full_credit_frac', tail):.4f}",
        f"policy/kl_ref: {mean('policy/kl_ref', tail):.3e} (last {k})",
        mismatch_line(rows),
        f"max mismatch/logprob_abs_diff_max: {max(r.get('mismatch/logprob_abs_diff_max') or 0 for r in rows)!r}, "
        f"total mismatch/tokens_different: {sum(r.get('mismatch/tokens_different') or 0 for r in rows)}",
        f"throughput/tokens_per_s: {mean('throughput/tokens_per_s', rows):.1f} (mean); rollout+train time {total_time:.1f} s",
    ]
    return "\n".join(lines)


def write_report(run_dir: str, out: str | None = None) -> tuple[str, list[Path]]:
    rows, skipped = load_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl with steps (is it a zmrl run dir?)")
    out_dir = Path(out) if out else Path(run_dir) / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    files = []
    for name, (title, keys) in PLOTS.items():
        fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
        for ax, key in zip(axes[:, 0], keys):
            xs, ys = _series(_warnings(rows)[0], key)
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None)
            ax.set_ylabel(key, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0, 0].set_title(title)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        files.append(out_dir / name)
    summary = summarize(rows, run_dir, skipped)
    (out_dir / "summary.txt").write_text(summary + "\n")
    files.append(out_dir / "summary.txt")
    return summary, files
