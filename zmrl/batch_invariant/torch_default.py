"""The "torch" path: each op as the obvious implementation on torch's default kernels.

This is the control, not a product path: `use_path("torch")` runs every zmrl op the way a
framework without zmrl would (cuBLAS/MKL GEMMs chosen by M, torch.topk without a tie rule,
one softmax over all selected tokens, an index_add_ combine), so `--batch-invariant off`
and the negative-control tests can show, op for op, what the invariant kernels remove.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def matmul(a, b):
    return a @ b


def linear(x, weight, bias=None):
    return F.linear(x, weight, bias)


def bmm(a, b):
    return torch.bmm(a, b)


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def softmax(x, dim):
    return torch.softmax(x.float(), dim).to(x.dtype)


def log_softmax(x, dim):
    return torch.log_softmax(x.float(), dim).to(x.dtype)


def mean(x, dims, keepdim):
    return x.float().mean(dims, keepdim=keepdim).to(x.dtype)


def indexer_scores(q, weights, k, q_pos, k_pos):
    dots = torch.einsum("thd,sd->ths", q.float(), k.float())
    scores = (torch.relu(dots) * weights.float()[..., None]).sum(1)
    return scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def indexer_scores_varlen(q, weights, k, q_pos, k_pos, cu_q, cu_k, max_q, max_k):
    from zmrl.batch_invariant.indexer import pad_sequences, varlen_causal, varlen_rows

    b = cu_q.numel() - 1
    q_rows, k_rows = varlen_rows(cu_q, q.shape[0], q.device), varlen_rows(cu_k, k.shape[0], q.device)
    qp = pad_sequences(q.float(), *q_rows, b, max_q)  # [B, Lq, H, D]
    kp = pad_sequences(k.float(), *k_rows, b, max_k)  # [B, Lk, D]
    dots = torch.einsum("blhd,bsd->blhs", qp, kp)[q_rows]  # [T, H, Lk]
    scores = (torch.relu(dots) * weights.float()[..., None]).sum(1)
    return varlen_causal(scores, q_pos, k_pos, k_rows, b, max_k, q_rows[0])


def topk(scores, k):
    s = scores.float()
    valid = (s != float("-inf")).sum(-1)
    idx = torch.topk(s, min(k, s.shape[1]), dim=-1).indices  # ties: whatever the kernel keeps
    keep = torch.arange(idx.shape[1], device=s.device)[None, :] < valid[:, None]
    idx = torch.where(keep, idx, s.shape[1]).sort(-1).values
    idx = torch.where(idx == s.shape[1], -1, idx)
    return F.pad(idx, (0, k - idx.shape[1]), value=-1)


def _sparse_mla_rows(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale):
    valid = indices >= 0
    safe = indices.clamp(min=0)
    g = kv_latent[safe].float()
    logits = torch.einsum("thc,tkc->thk", q_latent.float(), g)
    if q_rope is not None:
        logits = logits + torch.einsum("thr,tkr->thk", q_rope.float(), k_rope[safe].float())
    logits = (logits * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("thk,tkc->thc", p, g).to(q_latent.dtype), lse


GATHER_BLOCK = 1 << 26
"""Query rows per call are bounded so that the [rows, k, C] fp32 gather stays under this many
elements (a packed batch of every sequence at once would otherwise gather tens of GB)."""
SAVE_LIMIT = GATHER_BLOCK
"""Above this many gathered elements in a call that needs gradients, each row block recomputes
its forward in backward instead of keeping the gathers (torch.utils.checkpoint). One block's worth:
the model calls sparse MLA once per head leaf over the same rows, so kept gathers multiply by the
leaf count and the layer count (the small preset's bf16 train step ran out of an H200's 140 GB at
a limit of 2^30 per call)."""


def sparse_mla(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale, chunk_size):
    t, width, c = indices.shape[0], max(indices.shape[1], 1), kv_latent.shape[1]
    block = max(1, GATHER_BLOCK // (width * c))
    if t <= block:
        return _sparse_mla_rows(q_latent, q_rope, kv_latent, k_rope, indices, softmax_scale)
    recompute = torch.is_grad_enabled() and t * width * c > SAVE_LIMIT
    outs, lses = [], []
    for start in range(0, t, block):
        rows = slice(start, start + block)
        args = (q_latent[rows], None if q_rope is None else q_rope[rows], kv_latent, k_rope, indices[rows],
                softmax_scale)
        if recompute:
            from torch.utils.checkpoint import checkpoint

            out, lse = checkpoint(_sparse_mla_rows, *args, use_reentrant=False)
        else:
            out, lse = _sparse_mla_rows(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def moe_route(x, router_weight, bias, top_k, n_group, topk_group, routed_scaling_factor):
    scores = torch.sigmoid(F.linear(x.float(), router_weight.float()))
    biased = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = biased.view(biased.shape[0], n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), -1).values.sum(-1)
        keep = group_score.topk(topk_group, -1).indices
        mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        biased = grouped.masked_fill(mask[..., None], float("-inf")).flatten(1)
    ids = biased.topk(top_k, -1).indices.sort(-1).values
    chosen = scores.gather(1, ids)
    return chosen / chosen.sum(-1, keepdim=True) * routed_scaling_factor, ids


def moe_experts(x, expert_ids, expert_weights, w_gate, w_up, w_down, shared):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        tok, slot = (expert_ids == e).nonzero(as_tuple=True)
        h = F.silu(F.linear(x[tok], w_gate[e])) * F.linear(x[tok], w_up[e])
        out.index_add_(0, tok, F.linear(h, w_down[e]).float() * expert_weights[tok, slot, None].float())
    if shared is not None:
        g, u, d = shared
        out = out + F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d).float()
    return out.to(x.dtype)
