"""Every module of zmrl imports on its own, as the first zmrl module of a fresh interpreter.

Import cycles and import-time hooks only show when a module is the *first* one imported: a test
run that imported zmrl.model before zmrl.model.hf would never see a cycle between them. So each
module gets its own process. To keep this fast on 2 cores, one helper interpreter imports torch
(which imports nothing of zmrl, and is what every process would spend most of its start-up on)
and the other libraries of PRELOAD, then forks one child per module, a few at a time; each child
imports its one module and exits. transformers, vllm, megatron and verl are NOT preloaded: zmrl hooks
the import of transformers (zmrl.model.autoregister) and of verl's modules (zmrl.verl.hooks), vllm
and verl load zmrl's plugins through entry points, and the adapter modules must pull those in
themselves.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_names() -> list[str]:
    names = []
    for path in sorted((ROOT / "zmrl").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


MODULES = _module_names()

# Libraries that zmrl neither hooks nor configures before importing, and that import nothing of zmrl,
# transformers, vllm, megatron or verl (the fork server asserts it): what the vllm, megatron and verl
# modules spend most of their import on besides those (several seconds per module on 2 cores). Each
# child still imports every zmrl module and every hooked library itself, in its own order. Left
# out: libraries that start a thread on import (pyarrow, pandas, datasets), since the children are
# forked.
PRELOAD = ["torch._dynamo", "triton", "tensordict", "sympy", "networkx", "openai", "ray", "wandb", "grpc",
           "fastapi", "uvicorn", "aiohttp", "omegaconf", "psutil", "requests", "urllib3", "accelerate",
           "jsonschema", "pydantic", "yaml", "jinja2", "safetensors", "tokenizers", "huggingface_hub", "zmq"]

# Runs in the helper interpreter: argv = [modules as JSON, parallel children, scratch dir, PRELOAD as JSON].
_FORK_SERVER = r"""
import importlib, json, os, sys, traceback

import torch  # noqa: F401

for lib in json.loads(sys.argv[4]):
    try:
        importlib.import_module(lib)
    except ImportError:  # not installed here: the children do without it
        pass
assert not [m for m in sys.modules if m == "zmrl" or m.startswith("zmrl.")], "zmrl preloaded"
assert not [m for m in ("transformers", "vllm", "megatron", "verl") if m in sys.modules], "hooked library preloaded"
modules, jobs, scratch = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pending, running, results = list(modules), {}, {}


def child(name, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        import importlib

        importlib.import_module(name)
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


while pending or running:
    while pending and len(running) < jobs:
        name = pending.pop(0)
        log = os.path.join(scratch, name + ".log")
        pid = os.fork()
        if pid == 0:
            child(name, log)
        running[pid] = (name, log)
    pid, status = os.wait()
    name, log = running.pop(pid)
    ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    results[name] = None if ok else (open(log).read()[-3000:] or f"wait status {status}")
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def import_errors(tmp_path_factory) -> dict[str, str | None]:
    """module -> None if importing it first, alone, worked, else the end of its traceback."""
    scratch = tmp_path_factory.mktemp("imports")
    proc = subprocess.run([sys.executable, "-c", _FORK_SERVER, json.dumps(MODULES), "2", str(scratch),
                           json.dumps(PRELOAD)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_module_is_listed():
    assert len(MODULES) > 60 and "zmrl.model.hf" in MODULES and "zmrl" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_first_and_alone(import_errors, module):
    assert import_errors[module] is None, f"`import {module}` in a fresh interpreter failed:\n{import_errors[module]}"


def test_negative_control_a_cycle_is_caught(tmp_path):
    """Two modules that import names from each other: importing either one first fails, which is
    what the fork server reports (the same child code path, run on a throwaway package)."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc.b import g\n\ndef f():\n    return g\n")
    (pkg / "b.py").write_text("from cyc.a import f\n\ndef g():\n    return f\n")
    # nothing preloaded: the throwaway package imports no library, and preloading only saves time
    proc = subprocess.run([sys.executable, "-c", _FORK_SERVER, json.dumps(["cyc.a", "cyc"]), "2", str(tmp_path), "[]"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["cyc"] is None
    assert "circular import" in results["cyc.a"], results["cyc.a"]
