"""megatron is imported only inside zmrl/trainer/megatron, that package never imports a rollout
engine, and importing it (or the CLI) does not import megatron (docs/design.md, "The layers")."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import zmrl

pytestmark = pytest.mark.megatron

ROOT = Path(zmrl.__file__).parent
PACKAGE = ROOT / "trainer" / "megatron"


def _imported(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(node.module or "")
    return out


def test_megatron_is_imported_only_inside_the_megatron_trainer():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if PACKAGE not in p.parents
                 and any(n == "megatron" or n.startswith("megatron.") for n in _imported(p))]
    assert offenders == []
    assert any(n.startswith("megatron.") for n in _imported(PACKAGE / "model.py"))  # the scan sees imports


def test_the_megatron_trainer_never_imports_a_rollout_engine():
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if any(n.startswith("zmrl.rollout") for n in _imported(p))]
    assert offenders == []


def test_importing_the_package_and_the_cli_does_not_import_megatron():
    code = ("import sys; import zmrl.trainer.megatron; from zmrl.cli import build_parser; build_parser();"
            "print('megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
