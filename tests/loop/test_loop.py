"""The RL loop on the tiny recipe (reference backends, a few small steps): the rollout/trainer
mismatch is exactly 0 at every step; a 1-ulp change of one rollout-side weight stops a strict run
(negative control); a resumed run repeats an uninterrupted one bit for bit; a crash while writing a
checkpoint leaves the latest one intact."""
import json

import pytest
import torch

from zmrl.config import from_dict
from zmrl.rl import checkpoint
from zmrl.rl.loop import MismatchError, RLRun
from zmrl.rl.tracking import read_metrics

STABLE = ("mismatch/", "reward/", "loss/", "policy/", "train/", "response/")


def stable(metrics: dict) -> dict:
    """The metrics that must repeat bit for bit (everything but wall-clock time and throughput)."""
    return {k: v for k, v in metrics.items() if k.startswith(STABLE) or k == "step"}

MISMATCH = ("mismatch/logprob_abs_diff_max", "mismatch/tokens_different", "mismatch/kl",
            "mismatch/ratio_first_minibatch_max_abs_dev")


def test_mismatch_is_exactly_zero_at_every_step(make_config, tmp_path):
    cfg = make_config("run.steps=3", "algorithm.kl_coef=0.05", "algorithm.num_minibatches=2", "algorithm.epochs=2")
    metrics = RLRun(cfg).run()
    assert len(metrics) == 3
    for step, m in enumerate(metrics, 1):
        for key in MISMATCH:
            assert m[key] == 0, f"step {step}: {key} = {m[key]!r}"
        assert m["train/num_minibatches"] == 4
    assert metrics[0]["policy/kl_ref"] == 0.0, "step 1: the adapter's B factors are zero: policy == reference"
    assert any(m["policy/kl_ref"] != 0.0 for m in metrics[1:]), "negative control: the policy moves"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    keys = set(rows[0])
    for key in MISMATCH + ("reward/mean", "loss/policy", "policy/kl_ref", "time/rollout_s", "time/train_s",
                           "throughput/tokens_per_s"):
        assert key in keys, key
    import tomllib

    assert from_dict(tomllib.loads((tmp_path / "run" / "config.toml").read_text())) == cfg
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "run")] == ["step_000002", "step_000003"]
    assert (checkpoint.latest(tmp_path / "run") / "adapter" / "adapter_config.json").is_file()


def bump_one_ulp(rollout, name):
    """Every element of the rollout's base weight `name` one ulp up (the trainer's copy unchanged)."""
    w = rollout.base_weight(name)
    rollout.sync_base_weights({name: torch.nextafter(w, torch.full_like(w, 2.0))})


def test_strict_mode_stops_on_a_one_ulp_rollout_weight(make_config, tmp_path):
    run = RLRun(make_config())
    bump_one_ulp(run.rollout, "model.norm.weight")  # every element 1 ulp up (1.0 -> 1.0000001)
    with pytest.raises(MismatchError) as err:
        run.run()
    message = str(err.value)
    assert "step 1" in message and "sequence" in message and "token" in message, message
    assert checkpoint.latest(tmp_path / "run") is None, "nothing was checkpointed"
    assert read_metrics(tmp_path / "run") == []


def test_lenient_mode_logs_the_same_perturbation(make_config, tmp_path):
    run = RLRun(make_config("mismatch.strict=false", "run.steps=1"))
    bump_one_ulp(run.rollout, "model.norm.weight")
    (m,) = run.run()
    assert m["mismatch/tokens_different"] > 0 and m["mismatch/logprob_abs_diff_max"] > 0


def test_resume_repeats_the_uninterrupted_run_bitwise(make_config, tmp_path):
    full = RLRun(make_config("run.steps=4", run_dir=tmp_path / "full")).run()
    RLRun(make_config("run.steps=2", run_dir=tmp_path / "part")).run()
    resumed = RLRun(make_config("run.steps=4", run_dir=tmp_path / "part"), resume=True)
    assert resumed.step_done == 2
    tail = resumed.run()
    assert [stable(m) for m in tail] == [stable(m) for m in full[2:]]
    rows = read_metrics(tmp_path / "part")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [stable(r) for r in rows] == [stable(r) for r in read_metrics(tmp_path / "full")]
    a = checkpoint.load(checkpoint.latest(tmp_path / "full"))
    b = checkpoint.load(checkpoint.latest(tmp_path / "part"))
    assert a["cursor"] == b["cursor"]
    assert any(v.abs().sum() > 0 for k, v in a["trainer"]["adapter"].items() if k.endswith("__B")), \
        "the adapter moved, so equality is not trivial"
    for part in ("adapter", "masters"):
        for k, v in a["trainer"][part].items():
            assert torch.equal(v, b["trainer"][part][k]), f"{part} {k}"


def test_crash_while_checkpointing_keeps_the_latest(make_config, tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def flaky_save(obj, path, *args, **kwargs):
        calls.append(str(path))
        if len(calls) == 3:  # step 2's trainer.pt (step 1 wrote trainer.pt and rng.pt)
            raise OSError("disk full (injected)")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", flaky_save)
    with pytest.raises(OSError, match="injected"):
        RLRun(make_config("run.steps=3", "run.checkpoint_every=1")).run()
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    latest = checkpoint.latest(tmp_path / "run")
    assert latest.name == "step_000001"
    assert json.loads((latest / "state.json").read_text())["step"] == 1
    checkpoint.load(latest)  # complete and readable
    resumed = RLRun(make_config("run.steps=3", "run.checkpoint_every=1"), resume=True)
    assert resumed.step_done == 1
    resumed.run()
    assert checkpoint.latest(tmp_path / "run").name == "step_000003"
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*")), "the stray temp dir is cleaned up"
