"""gather_rows / scatter_add_rows (zmrl/batch_invariant/gather.py): a gather's backward that sums a
repeated row's gradients in one fixed order on the CPU, whatever the thread count."""
import pytest
import torch

from tests.batch_invariant.invariance import assert_bitwise, torch_threads
from zmrl.batch_invariant.gather import gather_rows, scatter_add_rows


def _serial_sum(grad_rows: torch.Tensor, ids: torch.Tensor, num_rows: int, order=None) -> torch.Tensor:
    """The oracle: row by row in position order (or `order`), one addition at a time."""
    out = torch.zeros(num_rows, grad_rows.shape[-1], dtype=grad_rows.dtype)
    for i in (range(ids.numel()) if order is None else order):
        out[ids[i]] += grad_rows[i]
    return out


def _ids_and_rows(n=3456, rows=512, width=64, seed=0):
    # many repeats of a few rows, as a prompt's tokens repeat over a batch (the sizes where CPU
    # index_put_(accumulate=True) ran in parallel and changed its bits from run to run, 2 threads)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g)
    ids[: n // 2] = ids[: n // 2] % 7
    return ids, torch.randn(n, width, generator=g)


@pytest.mark.parametrize("threads", [1, 2])
def test_scatter_add_rows_sums_in_position_order(threads):
    ids, grad_rows = _ids_and_rows()
    want = _serial_sum(grad_rows, ids, 512)
    with torch_threads(threads):
        for _ in range(3):
            assert_bitwise(scatter_add_rows(grad_rows, ids, 512), want, f"{threads} threads")
    # negative control: another order of the same additions gives other bits, so the equality above
    # checks the order and not just the sums
    assert not torch.equal(_serial_sum(grad_rows, ids, 512, order=reversed(range(ids.numel()))), want)


def test_scatter_add_rows_keeps_the_row_shape_of_multi_dim_ids():
    ids, grad_rows = _ids_and_rows(n=96, rows=20, width=8)
    got = scatter_add_rows(grad_rows.view(12, 8, 8), ids.view(12, 8), 20)
    assert_bitwise(got, _serial_sum(grad_rows, ids, 20), "[12, 8] ids")


def test_gather_rows_is_the_gather_and_its_gradient_the_serial_sum():
    ids, grad_rows = _ids_and_rows()
    table = torch.randn(512, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with torch_threads(2):
        out = gather_rows(table, ids)
        assert_bitwise(out.detach(), table.detach()[ids], "forward")
        out.backward(grad_rows)
    assert_bitwise(table.grad, _serial_sum(grad_rows, ids, 512), "backward")
    with torch.no_grad():  # nothing recorded: the plain gather
        assert gather_rows(table, ids).grad_fn is None
