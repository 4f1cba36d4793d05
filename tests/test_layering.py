"""The dependency rules of DESIGN.md section 1, checked on the source (every import statement,
at any depth, so a lazy import inside a function counts too).

batch_invariant <- model <- lora <- {rollout, trainer} <- loop/CLI; rollout and trainer never
import each other; heavy third-party packages only inside the adapter modules that need them.
"""
import ast
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
# third-party package -> path prefixes (relative to zmrl/) allowed to import it
HEAVY = {
    "triton": ["batch_invariant/triton/"],
    "vllm": ["rollout/vllm/", "bench/vllm_throughput.py"],
    "megatron": ["trainer/megatron/"],
    "wandb": ["rl/tracking.py"],
    "datasets": ["data/"],
}


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


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_stack(path):
    rel = path.relative_to(ROOT)
    package = rel.parts[0] if len(rel.parts) > 1 else None
    problems = []
    for module, line in _imports(path):
        parts = module.split(".")
        if parts[0] == "zmrl" and package in ALLOWED and len(parts) > 1:
            target = parts[1]
            if target != package and target not in ALLOWED[package]:
                problems.append(f"line {line}: zmrl/{package} imports zmrl.{target}")
        if parts[0] in HEAVY and not any(str(rel).startswith(p) for p in HEAVY[parts[0]]):
            problems.append(f"line {line}: imports {parts[0]} outside {HEAVY[parts[0]]}")
    assert not problems, f"{rel}: " + "; ".join(problems)


def test_negative_control_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from zmrl.trainer import base\n    import vllm\n")
    assert [m for m, _ in _imports(bad)] == ["zmrl.trainer", "vllm"]
