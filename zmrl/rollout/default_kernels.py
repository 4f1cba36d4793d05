"""Default torch kernels for every projection: the 'batch invariance off' control.

torch's CPU GEMMs (MKL/oneDNN) pick their algorithm by row count: on this machine a linear's
rows for M <= 5 differ in bits from the same rows inside a larger M. A decode step (M = 1
per request) therefore differs from the trainer's full-sequence forward; this is what
zmrl.batch_invariant removes, and what the negative controls show.
"""
from __future__ import annotations

import torch

from zmrl.model.projections import Projections


class TorchProjections(Projections):
    def linear(self, name, x, weight):
        return torch.nn.functional.linear(x, weight)

    def expert_linear(self, name, expert, x, weight, rows=None):
        return torch.nn.functional.linear(x, weight)

    def absorb_uk(self, name, q_nope, w_uk):
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_uv(self, name, o_latent, w_uv):
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
