"""The CLI stays light: building its parser imports no vLLM. (Where vllm may be imported at all is
tests/test_layering.py's rule, one list for every heavy package.)"""
import subprocess
import sys


def test_cli_help_does_not_import_vllm():
    code = "import sys; from zmrl.cli import build_parser; build_parser(); print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
