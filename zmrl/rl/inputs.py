"""Everything a run reads before it starts, checked before anything is written to RUN_DIR:
the model checkpoint (created with init-model when the recipe asks), its tokenizer, the prompt
dataset (generated when the recipe asks), the reward function.

Runs started together (a sweep of seeds from a fresh checkout) may all need the same model or
dataset made: each is made under a lock (`.NAME.lock` beside it), and a run that waited for it
finds it made and uses it."""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path


class RunError(ValueError):
    """Bad input to a run (missing files, a run dir in the way, a resume that does not fit)."""


@contextlib.contextmanager
def creating(path: Path):
    """Held while `path` (a model dir, a dataset file) is made; a second process waits for it."""
    import fcntl
    import os

    lock = path.with_name(f".{path.name}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunError(f"cannot create {path}: {e.strerror} ({e.filename})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"zmrl: waiting for another process that is making {path}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def prepare_model(cfg, create: bool = True, device=None) -> str:
    """-> the model dir; runs init-model when it has no config.json and model.init_preset is set
    (its warm start runs on `device`, default the CPU)."""
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        if cfg.model.init_preset is None:
            raise RunError(f"model.path {path} has no config.json (create a model with `zmrl init-model "
                           f"--preset tiny --out {path}`, or set model.init_preset = \"tiny\")")
        held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        if path.is_file() or held:  # the model is renamed into place: only a new or empty dir takes it
            what = "is a file" if path.is_file() else f"holds files but no config.json ({', '.join(held[:4])})"
            raise RunError(f"model.path {path} {what}; model.init_preset makes a model only in a new or empty "
                           f"directory (point model.path elsewhere)")
        if not create:
            return str(path)
        with creating(path):
            if not (path / "config.json").is_file():  # else made by the run this one waited for
                _create_model(cfg, path, device)
    if cfg.model.init_dtype is not None:
        from zmrl.model.checkpoint import read_config

        try:
            stated = read_config(path).torch_dtype
        except ValueError as e:
            raise RunError(f"model.path {path}: {e}") from None
        if stated != cfg.model.init_dtype:
            raise RunError(f"model.path {path} holds a model stored in {stated} but model.init_dtype is "
                           f"{cfg.model.init_dtype!r}; point model.path elsewhere to create one")
    if not (path / "tokenizer.json").is_file():
        raise RunError(f"model dir {path} has no tokenizer.json: the loop tokenizes prompts and decodes "
                       f"completions with it (models written by `zmrl init-model` have one)")
    return str(path)


def _create_model(cfg, path: Path, device) -> None:
    import time

    from zmrl.model.factory import init_model

    warm = f", then {cfg.model.warm_start_steps} warm-start steps" if cfg.model.warm_start_steps else ""
    print(f"zmrl: making the model {path} (preset {cfg.model.init_preset}{warm}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()

    # built in a sibling temp dir and renamed: an interrupted init never leaves a half model
    tmp = path.with_name(f".{path.name}.init-tmp")
    if tmp.exists():  # what an interrupted run left (the lock rules out a live one)
        import shutil

        shutil.rmtree(tmp)
    init_model(cfg.model.init_preset, str(tmp), cfg.model.init_seed, cfg.model.init_dtype)
    if cfg.model.warm_start_steps:
        _warm_start(cfg, str(tmp), device)
    if path.exists() and not any(path.iterdir()):
        path.rmdir()
    tmp.rename(path)
    print(f"zmrl: made {path} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _warm_start(cfg, model_dir: str, device=None) -> None:
    """A few supervised steps on the dataset's own answers (see zmrl.trainer.warmstart)."""
    from zmrl.trainer.warmstart import warm_start

    tokenizer = Tokenizer(model_dir)
    data = prepare_data(cfg, tokenizer)
    if "answer" not in data.rows[0]:
        raise RunError(f"model.warm_start_steps needs an 'answer' column in {cfg.data.path}")
    eos = json.loads((Path(model_dir) / "config.json").read_text())["eos_token_id"]
    examples = [(p, tokenizer.encode(str(row["answer"])) + [eos]) for p, row in zip(data.ids, data.rows)]
    warm_start(model_dir, examples, steps=cfg.model.warm_start_steps, lr=cfg.model.warm_start_lr,
               seed=cfg.model.init_seed, device=device or "cpu")


class Tokenizer:
    """The model dir's tokenizer.json (the `tokenizers` library only: light and exact)."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as _Tokenizer

        self.tok = _Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        config = json.loads((Path(model_dir) / "config.json").read_text())
        size = self.tok.get_vocab_size()
        if size != config.get("vocab_size"):
            raise RunError(f"{model_dir}: tokenizer has {size} tokens but config.json vocab_size is "
                           f"{config.get('vocab_size')}")
        self.max_positions = int(config.get("max_position_embeddings", 1 << 30))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


@dataclass
class Prompts:
    rows: list[dict]
    texts: list[str]
    ids: list[list[int]]

    @property
    def max_len(self) -> int:
        return max(len(i) for i in self.ids)


def prepare_data(cfg, tokenizer: Tokenizer | None, create: bool = True) -> Prompts | None:
    from zmrl.data.prompts import load_rows, prompts_of

    d = cfg.data
    path = Path(d.path)
    if d.generate and not path.exists():
        if not create:
            return None
        from zmrl.data.arithmetic import write_dataset

        with creating(path):
            try:
                if not path.exists():  # else made by the run this one waited for
                    write_dataset(path, size=d.generate_size, seed=cfg.run.seed, **d.generate_args)
            except (TypeError, ValueError) as e:  # a generate_args value the generator cannot use
                raise RunError(f"data.generate_args: {e}") from None
    try:
        rows = load_rows(d.path, d.split)
        texts = prompts_of(rows, d.prompt_key, d.format, where=f"dataset {d.path}")
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from None
    if tokenizer is None:
        return Prompts(rows, texts, [])
    ids = []
    for i, text in enumerate(texts):
        t = tokenizer.encode(text)
        if not t:
            raise RunError(f"dataset {d.path}: row {i}'s prompt tokenizes to nothing")
        if len(t) + cfg.rollout.max_tokens > tokenizer.max_positions:
            raise RunError(f"dataset {d.path}: row {i}'s prompt ({len(t)} tokens) + rollout.max_tokens "
                           f"exceeds the model's max_position_embeddings ({tokenizer.max_positions})")
        ids.append(t)
    return Prompts(rows, texts, ids)


# config keys a resume may change: how long, how often to save, how to display and track
RESUMABLE = {("run", "steps"), ("run", "dir"), ("run", "checkpoint_every"), ("run", "keep_checkpoints"),
             ("run", "num_threads"), ("run", "progress"), ("tracking", "wandb"), ("tracking", "project"),
             ("tracking", "name")}


_MISSING = object()


def _default(section: str, key: str):
    """The default of a config field (_MISSING where it has none): what a run saved before the
    field existed ran with."""
    import dataclasses
    import typing

    from zmrl.config import RunConfig

    cls = typing.get_type_hints(RunConfig).get(section)
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name == key:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return _MISSING


def config_differences(saved: dict, current: dict) -> list[str]:
    out = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if (section, key) in RESUMABLE or a.get(key) == b.get(key):
                continue
            if key not in a and b.get(key) == _default(section, key):
                continue  # a field added after the run was saved, at the value the run had
            out.append(f"{section}.{key}: {a.get(key)!r} in the run dir, {b.get(key)!r} now")
    return out
