"""torch's first parallel CPU op of a process can give other bits: run one before any of ours.

Measured (torch 2.13 CPU wheel, 2 intra-op threads, AVX-512, 2026-12-04): in about a third of
fresh processes, the first `torch.exp` over a [64, 300] fp32 tensor gave 9,576 of its 19,200 elements
(the rows of the tensor's second half) 1 ulp away from what every later call of the same op on
the same tensor gives; once one op had run split across the intra-op threads, every later call
agreed (12 of 12 processes). `torch.set_num_threads` alone did not settle it (1 of 12 still
differed). A zmrl CPU op whose elementwise math (exp, log, sigmoid) ran first in its process
would otherwise give a row bits that depend on whether the call came first and where the row
lay in it. So importing zmrl.batch_invariant runs one exp large enough for every intra-op thread
to take a share (tests/batch_invariant/test_cpu_first_op.py, which asserts no negative control: the
effect does not show in every run, see its docstring).
"""
from __future__ import annotations

import torch

_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch splits an elementwise op only past this many elements


def settle_intra_op_threads() -> None:
    """One exp split across every intra-op thread (about a millisecond at import)."""
    torch.exp(torch.zeros(2 * max(1, torch.get_num_threads()) * _GRAIN))
