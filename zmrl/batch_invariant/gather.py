"""Row gathers whose backward sums in one fixed order on the CPU.

The backward of `table[ids]` adds each gathered row's gradient into the row it was read from, with
`index_put_(accumulate=True)`. On the CPU, torch 2.13 runs that in parallel above a size, and the
order of the additions into a repeated row then changes from run to run (2 threads, 3,456 ids over
512 rows: 20 of 20 runs gave other fp32 bits). `scatter_add_rows` adds with `index_add_` along
dim 0, one index after another in position order, which is a serial accumulation's order
(tests/batch_invariant/test_gather.py checks it against one). Other devices keep autograd's own
backward: a CUDA `index_add_` adds with atomics, in no fixed order.
"""
from __future__ import annotations

import torch

from zmrl.batch_invariant._paths import records_graph


def scatter_add_rows(grad_rows: torch.Tensor, ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """grad_rows [*ids.shape, *row] -> [num_rows, *row]: row r is the sum of the grad rows whose id is
    r, added in the order they come (ids flattened)."""
    row = grad_rows.shape[ids.dim():]
    flat_ids = ids.reshape(-1)
    out = grad_rows.new_zeros(num_rows, *row)
    return out.index_add_(0, flat_ids, grad_rows.reshape(flat_ids.numel(), *row))


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, ids):
        ctx.save_for_backward(ids)
        ctx.num_rows = table.shape[0]
        return table[ids]

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return scatter_add_rows(grad, ids, ctx.num_rows), None


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] (ids int64, any shape, every entry in range): the same rows, with a backward that
    sums in a fixed order where autograd records the call on a CPU table."""
    if table.device.type == "cpu" and records_graph(table):
        return _GatherRows.apply(table, ids)
    return table[ids]
