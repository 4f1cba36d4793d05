"""benchmarks/narrow_gemm.py without a GPU: its candidates, its --plan-only path, and the control
flow of the table and sweep modes with stand-in GEMMs.

The timings need an H200; what can be checked here is that every candidate is a rung the
public path can run for the swept partition, and that both modes reach their verdicts."""
import pytest
import torch

from tests.bench.scripts import load_benchmark


def test_candidates_are_rungs_of_the_swept_partition():
    sweep = load_benchmark("narrow_gemm")
    configs = sweep.configs
    for m in sweep.GRID:
        cands = sweep.candidates(m, 4)
        assert len(set(cands)) == len(cands) and cands
        for cfg, how in cands:
            assert (cfg.split_k, cfg.k_align) == (4, sweep.K_ALIGN) and sweep.K_ALIGN % cfg.block_k == 0
            assert cfg.split_inline == (how == "in-program")
            if cfg.split_inline:  # two fp32 accumulators per sub-tile: at most 96 registers per thread each
                assert m > configs.MID_M and (configs._inline_ok(cfg) or cfg.sub_n > 1)
                assert cfg.block_m * configs.tile_n(cfg) <= 96 * 32 * cfg.num_warps
            else:  # an fp32 partial tile in shared memory next to the pipeline's buffers
                assert configs._split_smem(cfg, cfg.num_stages) <= configs._SPLIT_SMEM_BUDGET
            if m <= configs.SMALL_M:
                assert cfg.block_m == 16
        assert any(cfg.sub_n == 3 for cfg, _ in cands) == (m >= sweep.SUB_TILED_FROM_M), m


def test_unsplit_candidates_add_the_wide_tiles_and_never_split():
    sweep = load_benchmark("narrow_gemm")
    configs = sweep.configs
    for m in sweep.GRID:
        cands = sweep.candidates(m, 1)
        assert cands and all(cfg.split_k == 1 and not cfg.split_inline and how == "programs" for cfg, how in cands)
        wide = [cfg for cfg, _ in cands if cfg.block_n == 256]
        assert bool(wide) == (m > configs.MID_M), m  # 128 x 256 accumulators fit only without a second one


def test_plan_only_covers_every_shape_and_m(capsys):
    sweep = load_benchmark("narrow_gemm")
    sweep.main(["--plan-only", "--sweep", "--shape", "1536x7168", "--shape", "576x7168", "--ms", "1,16,128,1024"])
    out = capsys.readouterr().out
    for n in (1536, 576):
        assert f"## N={n} K=7168:" in out
    assert sum(line.startswith("  M=") for line in out.splitlines()) == 8


def test_a_partition_that_does_not_split_k_evenly_is_refused():
    sweep = load_benchmark("narrow_gemm")
    with pytest.raises(SystemExit, match="--splits 4"):
        sweep.main(["--plan-only", "--sweep", "--shape", "24576x1536", "--splits", "4"])


def _stand_ins(sweep, monkeypatch):
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    times = {}

    def fake_us(fn, rep):  # runs the call once; a fixed, call-order-dependent time
        fn()
        return times.setdefault(len(times), 1.0 + 0.1 * (len(times) % 7))

    def stand_in_gemm(a, b, bias=None, cfg=None, pad_rows=False):
        return (a.float() @ b.float()).to(a.dtype)

    monkeypatch.setattr(sweep, "graph_us", fake_us)
    monkeypatch.setattr(sweep.mm, "gemm", stand_in_gemm)
    monkeypatch.setattr(sweep.tri, "linear", lambda x, w, bias=None: (x.float() @ w.float().t()).to(x.dtype))


def test_the_sweep_reaches_a_banded_entry_with_stand_in_gemms(monkeypatch, capsys):
    sweep = load_benchmark("narrow_gemm")
    _stand_ins(sweep, monkeypatch)
    with torch.no_grad():
        bands = sweep.sweep(96, 2048, (1, 16, 64, 300), splits=4, rep=1)
    out = capsys.readouterr().out
    assert "TUNED[(torch.bfloat16, 96, 2048)] = banded(" in out and "unsplit" in out, out
    assert bands[-1][0] is None
    base = sweep.MM(64, 64, 64, split_k=4, k_align=sweep.K_ALIGN)
    assert sweep.configs.banded(base, bands).bands  # the printed table is one `banded` accepts


def test_the_table_mode_reaches_its_verdicts_with_stand_in_gemms(monkeypatch, capsys):
    sweep = load_benchmark("narrow_gemm")
    _stand_ins(sweep, monkeypatch)
    with torch.no_grad():
        ratios = sweep.table(96, 2048, (1, 16), rep=1)
    out = capsys.readouterr().out
    assert len(ratios) == 2 and "INVARIANT" in out and "control: cuBLAS" in out and "ladder:" in out, out


def test_install_keeps_the_tables_bands_below_the_sweep_and_restores_nothing_else(monkeypatch, capsys):
    sweep = load_benchmark("narrow_gemm")
    configs = sweep.configs
    key = (torch.bfloat16, 1536, 7168)
    table = configs.TUNED[key]
    monkeypatch.setitem(configs.TUNED, key, table)  # the test's install is undone afterwards
    swept = [(512, sweep.MM(64, 64, 64, num_warps=4, num_stages=4, sub_n=3, split_k=4, k_align=256)),
             (None, sweep.MM(128, 64, 64, num_warps=8, num_stages=3, sub_n=3, split_k=4, k_align=256,
                             split_inline=True))]
    merged = sweep.install(1536, 7168, swept, 256)
    assert configs.TUNED[key] is merged  # what config_for returns off the interpreter
    below = [(hi, cfg) for hi, cfg in table.bands if hi is not None and hi < 256]
    assert list(merged.bands[:len(below)]) == below and [hi for hi, _ in merged.bands[len(below):]] == [512, None]
    assert configs._rung_for(300, 1536, merged, 132).sub_n == 3
    assert configs._rung_for(9000, 1536, merged, 132).split_inline
    for m in (1, 20, 64):  # below the sweep: the table's rungs
        assert configs._rung_for(m, 1536, merged, 132) == configs._rung_for(m, 1536, table, 132)
    assert "sub_n=3" in capsys.readouterr().out
