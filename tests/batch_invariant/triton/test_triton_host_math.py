"""The host-side cdiv / next_power_of_2 that size grids and blocks give triton's values (which are
constexpr functions in Triton 3.6, slow to call from Python), so no grid or block changes."""
import pytest
import triton

from zmrl.batch_invariant.triton._common import cdiv, next_power_of_2


def test_cdiv_is_tritons():
    for b in (1, 2, 3, 7, 16, 64, 128, 1000):
        for a in range(-300, 5000, 7):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert cdiv(2**40 + 1, 2**20) == triton.cdiv(2**40 + 1, 2**20)


def test_next_power_of_2_is_tritons():
    for n in [*range(-5, 5000), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


@pytest.mark.parametrize("name", ["cdiv", "next_power_of_2"])
def test_no_host_call_is_left_to_triton(name):
    # every grid and block size in the Triton modules goes through the host helpers
    import pathlib

    import zmrl.batch_invariant.triton as tri

    for path in pathlib.Path(tri.__file__).parent.glob("*.py"):
        assert f"triton.{name}(" not in path.read_text().replace(f"`triton.{name}`", ""), path.name
