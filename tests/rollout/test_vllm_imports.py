"""vllm is imported only inside zmrl/rollout/vllm (docs/design.md, "The layers"), and the CLI stays light."""
import ast
import subprocess
import sys
from pathlib import Path

import zmrl

ROOT = Path(zmrl.__file__).parent
ALLOWED = ROOT / "rollout" / "vllm"


def _imports_vllm(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            return True
    return False


def test_vllm_is_imported_only_inside_the_vllm_adapter():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if ALLOWED not in p.parents and _imports_vllm(p)]
    assert offenders == []
    assert _imports_vllm(ALLOWED / "engine.py")  # the scan does see imports (a control)


def test_cli_help_does_not_import_vllm():
    code = "import sys; from zmrl.cli import build_parser; build_parser(); print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
