"""Whether exp, log and rsqrt give an element the same bits wherever it sits in a CPU tensor.

The CPU row ops (rowwise.py), the router's sigmoid and SiLU (moe.py) and sparse MLA's softmax are
built from these three and from IEEE +, *, / and max, so that an element's result cannot depend on
its place in a tensor, which depends on what else is in the batch. The IEEE ops are correctly
rounded wherever they run. exp, log and rsqrt are not promised to be: torch runs a vectorized
version over the body of an elementwise loop and may run another over its tail. On every CPU zmrl
was measured on (AMD EPYC and Intel Xeon, AVX-512; the EPYC with torch capped at AVX2 and at no
vector ISA) they agree bit for bit, while torch.sigmoid and silu do not (why zmrl builds those from
exp). Nothing promises it for another CPU or torch build, so `zmrl doctor` measures it here.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# Fewer elements than one unrolled vector iteration of any ISA torch has (16 fp32 lanes, unrolled
# twice, under AVX-512): every element of a call this long runs in the loop's scalar tail.
TAIL = 31

# The ops the CPU paths rely on, each with the inputs it is used on.
LANE_OPS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "exp": (torch.exp, lambda x: x),
    "log": (torch.log, lambda x: x.abs() + 1e-30),
    "rsqrt": (torch.rsqrt, lambda x: x.abs() + 1e-30),
}


PROBE_CHUNKS = 4000
PROBE_VALUES = TAIL * PROBE_CHUNKS  # how many values lane_report probes by default


def probe_values(chunks: int = PROBE_CHUNKS, seed: int = 0) -> torch.Tensor:
    """[TAIL x chunks] fp32 values spread over -60 ... 60 (exp's range without overflow)."""
    return torch.randn(TAIL * chunks, generator=torch.Generator().manual_seed(seed)) * 20


def position_mismatches(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """How many elements of the 1-D x get other bits from fn(x), where most run in vector lanes,
    than from fn over the TAIL-element piece holding them, where all run in the scalar tail."""
    pieces = x[: TAIL * (x.numel() // TAIL)].view(-1, TAIL)
    as_tails = torch.cat([fn(p) for p in pieces])
    return int((as_tails != fn(x)[: as_tails.numel()]).sum())


def lane_report(values: torch.Tensor | None = None) -> dict[str, int]:
    """{op: elements whose bits depend on their place} for each op the CPU paths rely on; all 0
    where this machine keeps the property."""
    x = probe_values() if values is None else values
    return {name: position_mismatches(fn, domain(x)) for name, (fn, domain) in LANE_OPS.items()}
