"""benchmarks/narrow_gemm.py without a GPU: its candidate list and its --plan-only path.

The sweep itself needs an H200 (the lead runs it); what can be checked here is that every
candidate is one the public path can run as a shape's table entry, and that the plan covers
every shape at every M."""
import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "narrow_gemm.py"


def _load():
    spec = importlib.util.spec_from_file_location("narrow_gemm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_candidates_are_runnable_table_entries():
    sweep = _load()
    configs = sweep.configs
    for n, k in sweep.SHAPES:
        cands = sweep.candidates(k)
        assert len(set(cands)) == len(cands)
        align = configs.split_align(torch.bfloat16, cands[0])
        splits = {c.split_k for c in cands}
        # every split count gives its own K ranges (no two counts split K at the same columns)
        assert len({sweep.splitk.k_chunk(k, s, align) for s in splits}) == len(splits)
        assert 1 in splits and (k < 2 * align or len(splits) > 1)
        for c in cands:
            assert c.block_k == 64  # the tile ladder applies to BLOCK_K 64 entries only
            if c.split_k > 1:  # an fp32 partial tile in shared memory next to the pipeline's buffers
                assert c.block_m * c.block_n <= configs._SPLIT_MAX_TILE
                assert configs._split_smem(c, c.num_stages) <= configs._SPLIT_SMEM_BUDGET


def test_plan_only_covers_every_shape_and_m(capsys):
    sweep = _load()
    sweep.main(["--plan-only", "--ms", "1,16,128,1024"])
    out = capsys.readouterr().out
    for n, k in sweep.SHAPES:
        assert f"## N={n} K={k}:" in out
    rows = [line for line in out.splitlines() if line.startswith("  MMConfig(")]
    assert len(rows) == sum(len(sweep.candidates(k)) for _, k in sweep.SHAPES)
    assert all(all(f"M={m}:" in line for m in (1, 16, 128, 1024)) for line in rows)


def test_the_sweep_runs_its_whole_path_with_stand_in_gemms(monkeypatch, capsys):
    """The GPU path's control flow on CPU: timing and every GEMM replaced by stand-ins (torch on
    CPU), on a small shape; it must reach the pick, the invariance check and the table line,
    and leave the table as it found it."""
    sweep = _load()
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    times = {}

    def fake_us(fn, rep):  # runs the call once; a fixed, config-dependent time per call site
        fn()
        return times.setdefault(len(times), 1.0 + 0.1 * (len(times) % 7))

    def stand_in_gemm(a, b, bias=None, cfg=None, pad_rows=False):
        return (a.float() @ b.float()).to(a.dtype)

    monkeypatch.setattr(sweep, "graph_us", fake_us)
    monkeypatch.setattr(sweep.mm, "gemm", stand_in_gemm)
    monkeypatch.setattr(sweep.tri, "linear", lambda x, w, bias=None: (x.float() @ w.float().t()).to(x.dtype))
    n, k = 96, 2048
    before = dict(sweep.mm.TUNED)
    with torch.no_grad():
        sweep.sweep(n, k, (1, 16, 128), top=2, rep=1, sms=132)
    out = capsys.readouterr().out
    assert f"PICK for N={n} K={k}" in out and f"TUNED line: (torch.bfloat16, {n}, {k}): MMConfig(" in out, out
    assert "control: cuBLAS" in out and "fixed configs (no ladder)" in out
    assert sweep.mm.TUNED == before
