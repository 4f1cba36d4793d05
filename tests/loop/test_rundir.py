"""Run directories that never lie: every bad input or failure gives one line naming the problem and
the documented exit status, and leaves the run dir, its checkpoints and metrics as they were (or,
where the run can go on, lets it go on to exactly the metrics of an uninterrupted run).

A 2-step run (checkpoints at steps 1 and 2) is made once per session and copied for each case; the
uninterrupted 3-step run is the reference a continued run must equal. Reference backends throughout.
"""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zmrl.cli import main
from zmrl.config import load_recipe
from zmrl.rl import checkpoint
from zmrl.rl.loop import RLRun
from zmrl.rl.rundir import RunDirLock
from zmrl.rl.tracking import load_metrics

from tests.loop.conftest import RECIPE, ROOT, small_overrides  # noqa: E402
from tests.loop.test_loop import stable  # noqa: E402

REWARD = '''
"""The arithmetic reward, which a test can arm to fail once after some number of calls."""
import sys

from zmrl.data.arithmetic import reward as arithmetic

ARMED = {"what": None, "after": 0, "calls": 0}


def arm(what, after):
    ARMED.update(what=what, after=after, calls=0)


def reward(completion, example, **kwargs):
    ARMED["calls"] += 1
    if ARMED["what"] and ARMED["calls"] > ARMED["after"]:
        what, ARMED["what"] = ARMED["what"], None
        if what == "interrupt":
            raise KeyboardInterrupt
        if what == "exit":
            sys.exit(0)
        raise RuntimeError("injected")
    return arithmetic(completion, example, **kwargs)
'''
CALLS_PER_STEP = 4  # run.prompts_per_step=2 x rollout.n=2


def snapshot(*paths: Path) -> dict:
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        out[str(root)] = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    return out


@pytest.fixture(scope="session")
def armed_reward(tmp_path_factory):
    where = tmp_path_factory.mktemp("reward")
    (where / "zmrl_test_reward.py").write_text(REWARD)
    sys.path.insert(0, str(where))
    import zmrl_test_reward

    return zmrl_test_reward


def overrides(model, data, run_dir, steps):
    return small_overrides(model, data, run_dir) + [f"run.steps={steps}", "run.checkpoint_every=1",
                                                    'reward.function="zmrl_test_reward:reward"']


@pytest.fixture(scope="session")
def golden(tiny_model, dataset, armed_reward, tmp_path_factory):
    """(a finished 2-step run dir, the stable metrics rows of the uninterrupted 3-step run)."""
    root = tmp_path_factory.mktemp("golden")
    RLRun(load_recipe(RECIPE, overrides(tiny_model, dataset, root / "run", 2))).run()
    RLRun(load_recipe(RECIPE, overrides(tiny_model, dataset, root / "full", 3))).run()
    rows, _ = load_metrics(root / "full")
    assert [r["step"] for r in rows] == [1, 2, 3]
    return root / "run", [stable(r) for r in rows]


class Ctx:
    def __init__(self, golden, tiny_model, dataset, tmp_path, reward):
        self.run, self.full = tmp_path / "run", golden[1]
        shutil.copytree(golden[0], self.run)
        self.model, self.data, self.tmp, self.reward = tiny_model, dataset, tmp_path, reward
        self.new = tmp_path / "new"  # a run dir that does not exist yet
        self.locks = []

    def sets(self, *extra, run_dir=None, steps=3, model=None, data=None):
        o = overrides(model or self.model, data or self.data, run_dir or self.new, steps) + list(extra)
        return ["train", str(RECIPE)] + [a for x in o for a in ("--set", x)]

    def resume(self, *extra, steps=3):
        return self.sets(*extra, steps=steps) + ["--resume", str(self.run)]

    def bad_model(self, kind: str) -> Path:
        bad = self.tmp / f"model-{kind}"
        shutil.copytree(self.model, bad)
        weights = bad / "model.safetensors"
        if kind == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif kind == "garbage":
            weights.write_bytes(b"this is not a safetensors file" * 100)
        else:
            (bad / "config.json").write_text('{"hidden_size": 64,')
        return bad

    def unwritable(self) -> Path:
        """A directory this process cannot create files in (chmod; as root: a read-only system dir)."""
        ro = self.tmp / "readonly"
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        for candidate in (ro, Path("/sys/fs"), Path("/proc/sys")):
            try:
                (candidate / ".probe").write_bytes(b"")
                (candidate / ".probe").unlink()
            except OSError:
                return candidate / "run"
        raise AssertionError("no unwritable directory found on this machine")

    def lock(self, path: Path) -> None:
        self.locks.append(RunDirLock.acquire(path))

    def close(self):
        for lock in self.locks:
            lock.release()
        (self.tmp / "readonly").exists() and (self.tmp / "readonly").chmod(0o755)


@pytest.fixture
def ctx(golden, tiny_model, dataset, tmp_path, armed_reward):
    c = Ctx(golden, tiny_model, dataset, tmp_path, armed_reward)
    yield c
    c.close()
    armed_reward.arm(None, 0)


def zmrl(capsys, argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def damage(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "remove":
        path.unlink()
    else:
        path.write_bytes(b"\x00garbage")


# --------------------------------------------------------------------------- refused, nothing touched
def _locked_resume(c):
    c.lock(c.run)
    return c.resume(), rf"run dir {c.run} is in use by a running zmrl train \(pid {os.getpid()} on "


def _locked_new_dir(c):
    c.lock(c.new)
    return c.sets(), rf"run dir {c.new} is in use by a running zmrl train \(pid {os.getpid()}"


def _all_checkpoints_damaged(c):
    for step in (1, 2):
        damage(c.run / "checkpoints" / f"step_{step:06d}" / "trainer.pt", "truncate")
    return c.resume(), r"no intact checkpoint \(step_000002: .*trainer.pt is damaged.*step_000001: .*trainer.pt"


def _wandb_dir_is_a_file(c):
    (c.run / "wandb").write_text("not a directory")
    return c.resume('tracking.wandb="offline"'), rf"W&B directory {c.run}/wandb is not a directory"


def _non_utf8_dataset(c):
    bad = c.tmp / "latin1.jsonl"
    bad.write_bytes('{"prompt": "1+2", "answer": "3"}\n{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    return c.sets(data=bad), rf"dataset file {bad} is not UTF-8 text"


def _empty_dataset(c):
    (c.tmp / "empty.jsonl").write_text("\n")
    return c.sets(data=c.tmp / "empty.jsonl"), r"empty.jsonl has no rows"


def _init_preset_over_other_files(c):
    folder = c.tmp / "my-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    argv = c.sets('model.init_preset="tiny"', model=folder)
    return argv, r"model.path .*my-model holds files but no config.json \(notes.txt\); model.init_preset makes"


REFUSED = {
    "init_preset_over_a_folder_of_other_files": _init_preset_over_other_files,
    "locked_by_a_live_run_resume": _locked_resume,
    "locked_by_a_live_run_new_dir": _locked_new_dir,
    "fresh_start_onto_a_run": lambda c: (c.sets(run_dir=c.run), r"already holds a run \(checkpoints up to step_000002\); continue it with --resume"),
    "every_checkpoint_damaged": _all_checkpoints_damaged,
    "resume_a_dir_without_a_run": lambda c: (c.sets() + ["--resume", c.tmp], r"holds no zmrl run"),
    "lr_inf": lambda c: (c.sets("trainer.lr=inf"), r"trainer.lr: must be a finite number, got inf"),
    "lr_nan": lambda c: (c.sets("trainer.lr=nan"), r"trainer.lr: must be a finite number, got nan"),
    "generate_args_unknown_key": lambda c: (c.sets(f'data.path="{c.tmp / "gen.jsonl"}"', 'data.generate="arithmetic"',
                                                   "data.generate_args={max_operands=3}"),
                                            r"data.generate_args: unknown key 'max_operands' for the arithmetic generator"),
    "generate_args_bad_value": lambda c: (c.sets(f'data.path="{c.tmp / "gen.jsonl"}"', 'data.generate="arithmetic"',
                                                 'data.generate_args={ops="/"}'),
                                          r"data.generate_args: unknown operator '/'"),
    "truncated_weights": lambda c: (c.sets(model=c.bad_model("truncated")), r"model-truncated/model.safetensors is not a readable safetensors file"),
    "garbage_weights": lambda c: (c.sets(model=c.bad_model("garbage")), r"model-garbage/model.safetensors is not a readable safetensors file"),
    "invalid_config_json": lambda c: (c.sets(model=c.bad_model("config")), r"model-config/config.json is not a valid model config"),
    "dry_run_truncated_weights": lambda c: (c.sets(model=c.bad_model("truncated")) + ["--dry-run"], r"model-truncated/model.safetensors is not a readable"),
    "dry_run_invalid_config_json": lambda c: (c.sets(model=c.bad_model("config")) + ["--dry-run"], r"model-config/config.json is not a valid model config"),
    "dry_run_onto_a_run_the_run_refuses": lambda c: (c.sets(run_dir=c.run) + ["--dry-run"], r"the run would be refused: run dir .* already holds a run"),
    "dry_run_resume_other_recipe": lambda c: (c.resume("algorithm.clip_eps=0.3") + ["--dry-run"], r"would be refused: .*different recipe.*algorithm.clip_eps"),
    "unwritable_run_dir": lambda c: (c.sets(run_dir=c.unwritable()), r"run dir .*(is not writable|cannot be created)"),
    "wandb_dir_is_a_file": _wandb_dir_is_a_file,
    "non_utf8_dataset": _non_utf8_dataset,
    "empty_dataset": _empty_dataset,
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_one_line_before_the_engines_start_and_nothing_touched(case, ctx, capsys, monkeypatch):
    import re

    import zmrl.rl.loop as loop

    def no_engines(*args, **kwargs):
        raise AssertionError("the engines were started")

    monkeypatch.setattr(loop, "build_trainer", no_engines)
    monkeypatch.setattr(loop, "build_rollout", no_engines)
    argv, message = REFUSED[case](ctx)
    watched = [ctx.run, ctx.model, ctx.data, ctx.new, ctx.tmp / "gen.jsonl"]
    before = snapshot(*watched)
    new_existed = ctx.new.exists()
    code, _, err = zmrl(capsys, argv)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("zmrl train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]
    assert snapshot(*watched) == before
    assert ctx.new.exists() == new_existed, "a refused run leaves no run dir behind"


@pytest.mark.vllm
def test_unknown_rollout_extra_key_is_named_before_vllm_starts(ctx, capsys):
    import vllm  # noqa: F401  (scripts/setup.sh installs it: missing is an error, not a skip)

    code, _, err = zmrl(capsys, ctx.sets('rollout.backend="vllm"', "rollout.extra={no_such_arg=1}"))
    assert code == 2 and "rollout.extra.no_such_arg: not an argument of vllm.LLM" in err, err
    assert not ctx.new.exists()


# --------------------------------------------------------------------------- other commands
def _prompts(c, content: bytes) -> Path:
    p = c.tmp / "prompts.jsonl"
    p.write_bytes(content)
    return p


def _check(c, model=None, prompts=None, *extra):
    prompts = prompts or _prompts(c, b'{"prompt": "1+2"}\n')
    return ["check", "--model", model or c.model, "--prompts", prompts, "--rollout", "reference", "--n", "1",
            "--max-tokens", "2", *extra]


def _existing_data(c):
    (c.tmp / "d.jsonl").write_text("keep me\n")
    return ["make-data", "arithmetic", "--out", c.tmp / "d.jsonl"], r"d.jsonl exists; pass --force to replace it"


OTHER = {
    "make_data_bad_op": lambda c: (["make-data", "arithmetic", "--out", c.tmp / "d.jsonl", "--ops", "/"], r"unknown operator '/'"),
    "make_data_negative_operand": lambda c: (["make-data", "arithmetic", "--out", c.tmp / "d.jsonl", "--max-operand", "-1"],
                                             r"max_operand must be an int >= 0, got -1"),
    "make_data_size_0": lambda c: (["make-data", "arithmetic", "--out", c.tmp / "d.jsonl", "--size", "0"], r"--size must be >= 1, got 0"),
    "make_data_onto_a_file": _existing_data,
    "bench_negative_requests": lambda c: (["bench", "vllm", "--num-requests", "-3"], r"--num-requests must be >= 1, got -3"),
    "check_prompts_is_a_directory": lambda c: (_check(c, None, c.tmp), rf"--prompts {c.tmp} is a directory"),
    "check_prompts_not_utf8": lambda c: (_check(c, None, _prompts(c, b'{"prompt": "caf\xe9"}\n')), r"prompts.jsonl is not UTF-8 text"),
    "check_temperature_nan": lambda c: (_check(c, None, None, "--temperature", "nan"), r"--temperature must be >= 0 and finite, got nan"),
    "check_truncated_weights": lambda c: (_check(c, c.bad_model("truncated")), r"model-truncated/model.safetensors is not a readable"),
    "check_invalid_config_json": lambda c: (_check(c, c.bad_model("config")), r"model-config/config.json is not a valid model config"),
    "init_model_onto_a_model": lambda c: (["init-model", "--preset", "tiny", "--out", c.model], r"already holds a model .*pass --force"),
    "init_model_into_a_run_dir": lambda c: (["init-model", "--preset", "tiny", "--out", c.run, "--force"], r"is not empty and holds no model"),
}


@pytest.mark.parametrize("case", OTHER)
def test_other_commands_refuse_bad_input_with_one_line(case, ctx, capsys):
    import re

    argv, message = OTHER[case](ctx)
    before = snapshot(ctx.tmp, ctx.model)
    code, out, err = zmrl(capsys, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and re.search(message, lines[0]), err
    assert snapshot(ctx.tmp, ctx.model) == before


# --------------------------------------------------------------------------- failures the run goes on from
def finish(ctx, capsys, *, resume: bool, expect: str | None = None) -> str:
    """Continue the run dir (--resume or a plain start) to step 3; its metrics must be the reference's."""
    argv = ctx.resume() if resume else ctx.sets(run_dir=ctx.run)
    code, _, err = zmrl(capsys, argv)
    assert code == 0, err
    if expect:
        assert expect in err, err
    rows, skipped = load_metrics(ctx.run)
    assert not skipped
    assert [stable(r) for r in rows] == ctx.full
    assert not (ctx.run / "run.lock").exists()
    return err


def test_stale_lock_of_a_dead_process_is_taken_over(ctx, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ctx.run / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": "h", "started": "t"}))
    finish(ctx, capsys, resume=True, expect=f"taking over the lock of pid {dead.pid}, which is no longer running")


def test_a_second_run_is_refused_while_the_first_one_holds_the_dir(ctx, capsys, tiny_model, dataset):
    first = RLRun(load_recipe(RECIPE, overrides(tiny_model, dataset, ctx.run, 3)), resume=True)  # engines up
    before = snapshot(ctx.run)
    code, _, err = zmrl(capsys, ctx.resume())
    assert code == 2 and "is in use by a running zmrl train" in err, err
    assert snapshot(ctx.run) == before
    first.run()
    rows, _ = load_metrics(ctx.run)
    assert [stable(r) for r in rows] == ctx.full, "the first run's metrics are its own"


@pytest.mark.parametrize("resume", [False, True], ids=["plain_start", "resume"])
def test_a_run_dir_without_a_checkpoint_starts_over(ctx, capsys, resume):
    shutil.rmtree(ctx.run / "checkpoints")  # metrics rows and config.toml of a run that never checkpointed
    finish(ctx, capsys, resume=resume,
           expect="no checkpoint yet: starting at step 1" if resume else "stopped before its first checkpoint")


@pytest.mark.parametrize("failure", ["raise", "interrupt", "exit"])
def test_a_failure_in_step_1_leaves_a_restartable_run_dir(ctx, capsys, failure):
    shutil.rmtree(ctx.run)
    ctx.reward.arm(failure, 0)
    code, _, err = zmrl(capsys, ctx.sets(run_dir=ctx.run))
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    expected = {"raise": (4, "zmrl_test_reward:reward raised RuntimeError: injected"),
                "interrupt": (130, "interrupted during step 1; no checkpoint yet: `zmrl train` starts the run over"),
                "exit": (4, "zmrl_test_reward:reward called sys.exit(0)")}[failure]
    assert (code, expected[1] in lines[0]) == (expected[0], True), err
    assert checkpoint.checkpoint_dirs(ctx.run) == [] and not (ctx.run / "run.lock").exists()
    finish(ctx, capsys, resume=False)


def test_ctrl_c_after_a_checkpoint_is_one_line_and_resumes(ctx, capsys):
    shutil.rmtree(ctx.run)
    ctx.reward.arm("interrupt", CALLS_PER_STEP)  # in step 2, after step 1's checkpoint
    code, _, err = zmrl(capsys, ctx.sets(run_dir=ctx.run))
    assert code == 130 and err.strip().count("\n") == 0, err
    assert f"interrupted during step 2; the latest checkpoint is step_000001: continue with --resume {ctx.run}" in err
    finish(ctx, capsys, resume=True)


def test_disk_full_while_checkpointing_keeps_latest_and_resumes(ctx, capsys, monkeypatch):
    import torch

    shutil.rmtree(ctx.run)
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 2's trainer.pt
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    code, _, err = zmrl(capsys, ctx.sets(run_dir=ctx.run))
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert code == 2 and err.strip().count("\n") == 0, err
    assert ("zmrl train: no space left on device during the checkpoint of step 2; the latest checkpoint "
            "is step_000001: continue with --resume") in err, err
    assert checkpoint.latest(ctx.run).name == "step_000001"
    checkpoint.load(checkpoint.latest(ctx.run))  # intact
    assert not list((ctx.run / "checkpoints").glob(".tmp-*")), "the failed save freed its space"
    finish(ctx, capsys, resume=True)


def test_a_damaged_metrics_line_loses_no_other_row(ctx, capsys):
    path = ctx.run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + '{"step": 1.5, "cut by a cra\n' + "".join(lines[1:]))
    err = finish(ctx, capsys, resume=True, expect="metrics.jsonl: line 2 skipped (not JSON")
    assert "the original is kept as metrics.jsonl.damaged" in err
    assert "cut by a cra" in (ctx.run / "metrics.jsonl.damaged").read_text()


@pytest.mark.parametrize("part, how", [("trainer.pt", "truncate"), ("state.json", "truncate"), ("rng.pt", "remove"),
                                       ("adapter/adapter_model.safetensors", "garble")])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(ctx, capsys, part, how):
    damage(ctx.run / "checkpoints" / "step_000002" / part, how)
    err = finish(ctx, capsys, resume=True, expect="resuming from the newest intact checkpoint, step_000001")
    assert f"step_000002: {ctx.run}/checkpoints/step_000002/{part.split('/')[0]}" in err, err
    assert (ctx.run / "checkpoints" / "damaged_step_000002").is_dir(), "kept aside, not deleted"


def test_resume_refuses_other_base_weights_and_init_model_needs_force(ctx, capsys, dataset):
    model = ctx.tmp / "model"
    shutil.copytree(ctx.model, model)
    shutil.rmtree(ctx.run)
    code, _, err = zmrl(capsys, ctx.sets(run_dir=ctx.run, model=model, steps=1))
    assert code == 0, err
    original = snapshot(model)
    code, _, err = zmrl(capsys, ["init-model", "--preset", "tiny", "--out", model, "--seed", "1"])
    assert code == 2 and "already holds a model" in err and snapshot(model) == original, err
    code, _, err = zmrl(capsys, ["init-model", "--preset", "tiny", "--out", model, "--seed", "1", "--force"])
    assert code == 0 and snapshot(model) != original, err
    before = snapshot(ctx.run)
    code, _, err = zmrl(capsys, ctx.sets(model=model, steps=2) + ["--resume", ctx.run])
    assert code == 2 and f"model.path {model} holds other weights than the run started from" in err, err
    assert snapshot(ctx.run) == before
    # negative control: the original weights back, the same resume goes on
    shutil.rmtree(model)
    shutil.copytree(ctx.model, model)
    code, _, err = zmrl(capsys, ctx.sets(model=model, steps=2) + ["--resume", ctx.run])
    assert code == 0, err


# --------------------------------------------------------------------------- report
def test_report_never_claims_zero_mismatch_over_a_null_and_warns_about_duplicates(ctx, capsys):
    from zmrl.rl.report import summarize

    rows, _ = load_metrics(ctx.run)
    assert "mismatch: exactly 0 at every step" in summarize(rows, "r"), "negative control: the clean run"
    nulled = [dict(r) for r in rows]
    nulled[1]["mismatch/kl"] = None
    text = summarize(nulled, "r")
    assert "exactly 0" not in text and "NOT RECORDED (null: non-finite or missing) at steps [2]" in text, text
    text = summarize(rows + rows[:1], "r")
    assert "WARNING: steps [1] appear more than once (1 extra rows" in text, text
    path = ctx.run / "metrics.jsonl"
    path.write_text(path.read_text() + "garbage\n")
    assert main(["report", str(ctx.run)]) == 0
    out = capsys.readouterr().out
    assert "WARNING: " in out and "line 3 skipped (not JSON" in out, out


# --------------------------------------------------------------------------- pipes and machine-readable output
def _cli(*args, stdout=subprocess.PIPE):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.Popen([sys.executable, "-m", "zmrl.cli", *map(str, args)], stdout=stdout,
                            stderr=subprocess.PIPE, env=env, text=True)


def test_dry_run_into_a_closed_pipe_ends_quietly(ctx):
    proc = _cli(*ctx.sets(), "--dry-run")
    proc.stdout.close()  # `| head -0`: the reader is gone before anything is written
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("rollout, trainer", [
    ("reference", "reference"),
    pytest.param("reference", "megatron", marks=pytest.mark.megatron),
    pytest.param("vllm", "reference", marks=[pytest.mark.vllm, pytest.mark.slow]),
    pytest.param("vllm", "megatron", marks=[pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]),
])
def test_check_json_prints_exactly_one_json_object_on_stdout(ctx, rollout, trainer):
    prompts = ctx.tmp / "p.jsonl"
    prompts.write_text('{"prompt": "1+2"}\n{"prompt": "1+5"}\n')
    proc = _cli("check", "--json", "--model", ctx.model, "--prompts", prompts, "--rollout", rollout,
                "--trainer", trainer, "--n", "2", "--max-tokens", "3")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("\n") == 1, out
    report = json.loads(out)
    assert (report["rollout"], report["trainer"], report["differing_tokens"]) == (rollout, trainer, 0)
    assert report["total_tokens"] > 0


def test_a_field_added_after_the_run_was_saved_resumes_at_its_default():
    from zmrl.rl.inputs import config_differences

    saved = {"run": {"steps": 3}}  # written before run.orchestrator existed
    assert config_differences(saved, {"run": {"steps": 3, "orchestrator": "zmrl"}}) == []
    # control: the new field at another value than the one the saved run ran with is a difference
    assert config_differences(saved, {"run": {"steps": 3, "orchestrator": "verl"}}) == [
        "run.orchestrator: None in the run dir, 'verl' now"]
