"""Runs started together (a sweep from a fresh checkout) that need the same model or dataset made:
one makes it under a lock, the others wait and then use it. Without the lock two runs made the
model in one temp dir at once: the second removed the first's half-made model, and the first
failed (or renamed a model mixed from both)."""
import json
import threading
import time
from pathlib import Path

from zmrl.config import load_recipe
from zmrl.model.factory import init_model
from zmrl.rl.inputs import creating, prepare_data, prepare_model

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.toml"


def _cfg(tmp_path: Path):
    return load_recipe(RECIPE, [f'model.path="{tmp_path / "model"}"', f'data.path="{tmp_path / "data.jsonl"}"',
                                "model.warm_start_steps=0", f'run.dir="{tmp_path / "run"}"'])


def _files(root: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _start(fn) -> tuple[threading.Thread, dict]:
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn()))
    thread.start()
    return thread, out


def test_a_run_waits_for_the_model_another_run_is_making_and_uses_it(tmp_path, capsys):
    cfg, model = _cfg(tmp_path), tmp_path / "model"
    with creating(model):  # another run, making the model
        waiter, out = _start(lambda: prepare_model(cfg))
        time.sleep(1.0)
        assert waiter.is_alive() and not model.exists(), "it made nothing while the other run held the lock"
        init_model("tiny", str(model), seed=7)  # the other run's model (the recipe's own seed is 0)
        made = _files(model)
    waiter.join(120)
    assert out["result"] == str(model) and _files(model) == made
    assert f"waiting for another process that is making {model}" in capsys.readouterr().err


def test_negative_control_with_no_other_run_it_makes_the_model_itself(tmp_path):
    cfg, model = _cfg(tmp_path), tmp_path / "model"
    waiter, out = _start(lambda: prepare_model(cfg))
    waiter.join(120)
    assert out["result"] == str(model) and (model / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"], "no temp dir left"


def test_a_run_waits_for_the_dataset_another_run_is_writing_and_uses_it(tmp_path):
    cfg, data = _cfg(tmp_path), tmp_path / "data.jsonl"
    theirs = [{"prompt": "1+1", "answer": "2"}, {"prompt": "1+2", "answer": "3"}]
    with creating(data):
        waiter, out = _start(lambda: prepare_data(cfg, None))
        time.sleep(1.0)
        assert waiter.is_alive() and not data.exists()
        data.write_text("".join(json.dumps(row) + "\n" for row in theirs))
    waiter.join(60)
    assert out["result"].texts == ["1+1", "1+2"]
    control = _cfg(tmp_path / "alone")  # negative control: no other run, it writes the recipe's own
    assert len(prepare_data(control, None).texts) == control.data.generate_size
