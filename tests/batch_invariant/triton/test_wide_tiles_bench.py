"""benchmarks/wide_tiles.py: its wide tiles give the bits of the table's K partition.

The experiment times 192-column tiles (sub-tile accumulators sharing each A tile) for the narrow
split-K shapes; its figures count only if each tile computes exactly what the shape's two-kernel
split computes. Here at small fp32 shapes (the interpreter on a CPU, compiled on a GPU): every case
equals the split, and the control, the same wide kernel over another partition of K (2 ranges
instead of 4), differs."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "wide_tiles.py"


def _load():
    spec = importlib.util.spec_from_file_location("wide_tiles", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # after this folder's conftest chose interpreter or compiled kernels
    return mod


WIDE = _load()


@pytest.mark.parametrize("case", WIDE.CHECK_CASES, ids=lambda c: f"M{c[0]}-N{c[1]}-K{c[2]}-{'+'.join(map(str, c[3]))}"
                         f"-{'inprog' if c[4] else 'programs'}")
def test_wide_tile_equals_the_split_and_another_partition_differs(case, dev):
    same, control = WIDE.check_case(case, dev)
    assert same, "the wide tile's rows differ from the two-kernel split of the same partition"
    assert not control, "control: the same kernel over 2 K ranges gave the 4-range bits"
