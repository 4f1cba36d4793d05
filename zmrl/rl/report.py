"""`zmrl report RUN_DIR`: PNG plots and a short text summary from RUN_DIR/metrics.jsonl."""
from __future__ import annotations

from pathlib import Path

from zmrl.rl.tracking import read_metrics

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


def summarize(rows: list[dict], run_dir: str) -> str:
    def mean(key, part):
        vals = [r[key] for r in part if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    k = max(1, min(5, len(rows) // 4))
    head, tail = rows[:k], rows[-k:]
    nonzero = [r["step"] for r in rows if any(r.get(m) for m in MISMATCH_KEYS)]
    total_time = sum((r.get("time/rollout_s") or 0) + (r.get("time/train_s") or 0) for r in rows)
    lines = [
        f"run: {run_dir}",
        f"steps: {rows[0]['step']}..{rows[-1]['step']} ({len(rows)} logged)",
        f"reward/mean: {mean('reward/mean', head):.4f} (first {k} steps) -> {mean('reward/mean', tail):.4f} (last {k})",
        f"reward/full_credit_frac: {mean('reward/full_credit_frac', head):.4f} -> {mean('reward/full_credit_frac', tail):.4f}",
        f"policy/kl_ref: {mean('policy/kl_ref', tail):.3e} (last {k})",
        "mismatch: " + ("exactly 0 at every step (" + ", ".join(MISMATCH_KEYS) + ")" if not nonzero
                        else f"NON-ZERO at steps {nonzero[:10]}"),
        f"max mismatch/logprob_abs_diff_max: {max(r.get('mismatch/logprob_abs_diff_max') or 0 for r in rows)!r}, "
        f"total mismatch/tokens_different: {sum(r.get('mismatch/tokens_different') or 0 for r in rows)}",
        f"throughput/tokens_per_s: {mean('throughput/tokens_per_s', rows):.1f} (mean); rollout+train time {total_time:.1f} s",
    ]
    return "\n".join(lines)


def write_report(run_dir: str, out: str | None = None) -> tuple[str, list[Path]]:
    rows = read_metrics(run_dir)
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
            xs, ys = _series(rows, key)
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None)
            ax.set_ylabel(key, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0, 0].set_title(title)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        files.append(out_dir / name)
    summary = summarize(rows, run_dir)
    (out_dir / "summary.txt").write_text(summary + "\n")
    files.append(out_dir / "summary.txt")
    return summary, files
