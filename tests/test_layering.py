"""The dependency rules of docs/design.md ("The layers"), checked on the source (every import
statement, at any depth, so a lazy import inside a function counts too).

batch_invariant <- model <- lora <- {rollout, trainer} <- loop/CLI; rollout and trainer never
import each other; the CLI (zmrl/cli.py, zmrl/commands/) is imported by nothing else in zmrl;
heavy third-party packages only inside the adapter modules that need them; the kernels
(batch_invariant) import no library but torch and triton, besides the standard library.
"""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "zmrl"

# package -> zmrl packages it may import (besides itself)
ALLOWED = {
    "batch_invariant": set(),
    "model": {"batch_invariant"},
    "lora": {"batch_invariant", "model"},
    "rollout": {"batch_invariant", "model", "lora"},
    "trainer": {"batch_invariant", "model", "lora"},
    "data": set(),
}
# the CLI sits on top: only these paths (relative to zmrl/) may import zmrl.cli or zmrl.commands
CLI = ["cli.py", "commands/"]
# third-party package -> path prefixes (relative to zmrl/) allowed to import it
HEAVY = {
    "triton": ["batch_invariant/triton/"],
    "vllm": ["rollout/vllm/", "bench/vllm_throughput.py", "verl/vllm_server.py"],
    "megatron": ["trainer/megatron/"],
    "wandb": ["rl/tracking.py"],
    "datasets": ["data/"],
    "verl": ["verl/"],
    "ray": ["verl/"],
}
# the kernels' only third-party libraries
KERNEL_LIBRARIES = {"torch", "triton"}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            if node.module == "zmrl":  # from zmrl import model
                for alias in node.names:
                    yield f"zmrl.{alias.name}", node.lineno


SOURCES = sorted(p for p in ROOT.rglob("*.py"))


def test_there_is_source_to_check():
    assert len(SOURCES) > 30


def _violations(path: Path, rel: Path) -> list[str]:
    """The rule breaks of source file `path`, judged as if it lived at zmrl/`rel`."""
    package = rel.parts[0] if len(rel.parts) > 1 else None
    problems = []
    for module, line in _imports(path):
        parts = module.split(".")
        if parts[0] == "zmrl" and package in ALLOWED and len(parts) > 1:
            target = parts[1]
            if target != package and target not in ALLOWED[package]:
                problems.append(f"line {line}: zmrl/{package} imports zmrl.{target}")
        if parts[:2] in (["zmrl", "commands"], ["zmrl", "cli"]) and not any(str(rel).startswith(p) for p in CLI):
            problems.append(f"line {line}: imports {module}, the CLI (logic it needs belongs below it)")
        if parts[0] in HEAVY and not any(str(rel).startswith(p) for p in HEAVY[parts[0]]):
            problems.append(f"line {line}: imports {parts[0]} outside {HEAVY[parts[0]]}")
        if (package == "batch_invariant" and parts[0] not in KERNEL_LIBRARIES | {"zmrl"}
                and parts[0] not in sys.stdlib_module_names):
            problems.append(f"line {line}: zmrl/batch_invariant imports {parts[0]} (kernels use torch and triton only)")
    return problems


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_stack(path):
    rel = path.relative_to(ROOT)
    problems = _violations(path, rel)
    assert not problems, f"{rel}: " + "; ".join(problems)


def test_negative_control_the_checker_sees_each_kind_of_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from zmrl.trainer import base\n    import vllm\n"
                   "    from zmrl import commands\n    from zmrl.commands.init_model import run\n")
    assert [m for m, _ in _imports(bad)] == ["zmrl.trainer", "vllm", "zmrl", "zmrl.commands",
                                            "zmrl.commands.init_model"]
    assert _violations(bad, Path("rollout/x.py"))[:2] == [
        "line 2: zmrl/rollout imports zmrl.trainer",
        "line 3: imports vllm outside ['rollout/vllm/', 'bench/vllm_throughput.py', 'verl/vllm_server.py']"]
    assert _violations(bad, Path("rl/x.py")) == [
        "line 3: imports vllm outside ['rollout/vllm/', 'bench/vllm_throughput.py', 'verl/vllm_server.py']",
        "line 4: imports zmrl.commands, the CLI (logic it needs belongs below it)",
        "line 5: imports zmrl.commands.init_model, the CLI (logic it needs belongs below it)"]
    assert _violations(bad, Path("commands/x.py")) == [
        "line 3: imports vllm outside ['rollout/vllm/', 'bench/vllm_throughput.py', 'verl/vllm_server.py']"]


def test_negative_control_a_kernel_module_may_not_import_another_library(tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("import math\nimport torch\nimport numpy\nfrom transformers import AutoConfig\n")
    assert _violations(source, Path("batch_invariant/x.py")) == [
        "line 3: zmrl/batch_invariant imports numpy (kernels use torch and triton only)",
        "line 4: zmrl/batch_invariant imports transformers (kernels use torch and triton only)"]
    assert _violations(source, Path("model/x.py")) == []
