"""benchmarks/grouped_decode.py on the tiny preset: each variant takes the path it names (the
grouped experts and leaves run only where it says so), its switches are undone, and a short run
reports all four."""

import torch

from zmrl.batch_invariant import cpu_grouped

from tests.bench.scripts import load_benchmark


def test_each_variant_takes_its_path_and_a_short_run_reports_all(monkeypatch):
    mod = load_benchmark("grouped_decode")
    hits = {"leaves": 0, "experts": 0}
    real_leaves, real_fit = cpu_grouped.leaf_products, cpu_grouped.ExpertTiles.fit

    def leaves_spy(xs, weights):
        out = real_leaves(xs, weights)
        hits["leaves"] += out is not None
        return out

    def fit_spy(*args):
        out = real_fit(*args)
        hits["experts"] += out is not None
        return out

    monkeypatch.setattr(cpu_grouped, "leaf_products", leaves_spy)
    monkeypatch.setattr(cpu_grouped.ExpertTiles, "fit", fit_spy)
    cfg = mod.ModelConfig(**mod.PRESETS["tiny"])
    roll = mod.Rollout(cfg, 2, 24)
    roll.step(torch.randint(2, cfg.vocab_size, (2 * 20,), generator=torch.Generator().manual_seed(0)), 0, 20)
    seen = {}
    for name, variant in mod.VARIANTS.items():
        hits.update(leaves=0, experts=0)
        with variant():
            roll.step(torch.tensor([5, 7]), 20, 1)  # a decode step of 2 requests
        seen[name] = (hits["experts"] > 0, hits["leaves"] > 0)
    assert seen == {"experts and leaves grouped": (True, True), "experts grouped only": (True, False),
                    "neither grouped": (False, False), "invariance off": (False, False)}
    assert (cpu_grouped.leaf_products, cpu_grouped.ExpertTiles.fit) == (leaves_spy, fit_spy)  # switches undone
    medians = mod.main(["--steps", "1", "--samples", "1", "--num-requests", "2", "--prompt-len", "20"])
    assert set(medians) == set(mod.VARIANTS) and all(ms > 0 for ms in medians.values())
