"""`zmrl doctor` reports this machine's CPU, BLAS and the path each CPU GEMM takes."""
import json

import torch

from tests.batch_invariant.invariance import torch_threads
from tests.batch_invariant.test_cpu_gemm import _k_split_in_a_lone_tile, _odd_rows_reversed_however_padded
from zmrl.batch_invariant import cpu_gemm, lanes
from zmrl.cli import main


def test_doctor_reports_the_machine_and_every_path(capsys):
    assert main(["doctor", "--shapes", "64x48", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__ and report["threads"] == torch.get_num_threads()
    assert report["cpu"]["model"] and report["blas"]["libraries"]
    combos = {(r["op"], r["dtype"]) for r in report["cpu_paths"]}
    assert combos == {(op, dt) for op in ("linear", "matmul", "bmm") for dt in ("float32", "bfloat16")}
    assert all(r["path"] in ("tiles", "exact") and r["exact_check_passed"] for r in report["cpu_paths"])
    assert report["all_exact_checks_passed"]
    assert report["lanes"] == {"exp": 0, "log": 0, "rsqrt": 0}


def _exp_varying_with_place(x):
    """Variant on every machine: the second half of every 64 elements of a call is nudged."""
    return torch.where(torch.arange(x.numel()) % 64 >= 32, torch.exp(x) * (1 + 2**-20), torch.exp(x))


def test_doctor_fails_where_exp_depends_on_an_elements_place(capsys, monkeypatch):
    # negative control: a place-dependent exp is named and the exit code says do not train here
    monkeypatch.setitem(lanes.LANE_OPS, "exp", (_exp_varying_with_place, lambda x: x))
    assert main(["doctor", "--shapes", "64x48"]) == 1
    out = capsys.readouterr().out
    assert "an element's bits depend on its place in the tensor here (exp: " in out
    assert "of 124,000 values): the CPU row ops are not batch-invariant on this machine" in out
    cpu_gemm.reset_decisions()


def test_doctor_shows_vector_isa_caps_set_in_the_environment(capsys, monkeypatch):
    # oneDNN reads its cap once, at its first GEMM: run one first, so the variable is only shown here
    # and leaves this process's kernels as they were
    torch.mm(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert main(["doctor", "--shapes", "64x48"]) == 0
    caps = [line for line in capsys.readouterr().out.splitlines() if "capped by the environment:" in line]
    assert len(caps) == 1 and "ONEDNN_MAX_CPU_ISA=AVX2" in caps[0].split()
    cpu_gemm.reset_decisions()


def test_doctor_reports_a_failed_self_check(capsys, monkeypatch):
    # negative control: a row-variant "BLAS" must show up as a failed check and the exact path
    monkeypatch.setattr(cpu_gemm, "mm_tiles", _odd_rows_reversed_however_padded)
    assert main(["doctor", "--shapes", "256x48"]) == 0  # the exact GEMM still gives invariant rows
    out = capsys.readouterr().out
    assert "linear  float32     256     48 k_major   exact" in out
    assert "failed the tile self-check and take the exact GEMM" in out
    cpu_gemm.reset_decisions()


def test_doctor_reports_the_padded_tiles(capsys, monkeypatch):
    # a "BLAS" that splits only a lone tile's K across threads: the padded tiles, reported as such
    monkeypatch.setattr(cpu_gemm, "mm_tiles", _k_split_in_a_lone_tile)
    with torch_threads(2):
        assert main(["doctor", "--shapes", "256x48"]) == 0
    out = capsys.readouterr().out
    assert "linear  float32     256     48 k_major   tiles x2" in out
    assert "every call padded to at least 2 tiles" in out and "padded to a tile per thread" in out
    cpu_gemm.reset_decisions()


def test_doctor_rejects_bad_shapes(capsys):
    assert main(["doctor", "--shapes", "64x"]) == 2
    assert "--shapes: '64x' is not KxN" in capsys.readouterr().err
