"""Supervised warm start of a freshly initialized base model (all weights, next-token loss).

    from zmrl.trainer.warmstart import warm_start
    warm_start("runs/models/tiny", examples, steps=40, lr=3e-3, seed=0)   # rewrites model.safetensors

Why: a randomly initialized model cannot be steered by LoRA alone. Its final RMSNorm fixes the
norm of the last hidden state and its LM head rows are tiny (std 0.02), so no adapter can raise any
token's probability above a few percent; and with frozen embeddings and head, LoRA learns even a
supervised token-to-token map slowly (measured on the tiny preset: 30 steps moved p(correct) from
0.10 to 0.13, where full-weight training reached 0.99). A handful of full-weight supervised steps
on the task gives a *weak* base model (the tiny recipe stops at p(correct first token) ~ 0.4), the
usual starting point of RL: it knows the format and part of the answers, and RL has to do the rest.

examples: (prompt_ids, completion_ids) pairs; the loss is the mean NLL of the completion tokens
under zmrl.model.logprobs.token_logprobs (temperature 1). Deterministic: one CPU generator
picks the batches. `device` ("cpu", "cuda") is where the steps run; the checkpoint is written
from CPU copies.
"""
from __future__ import annotations

from pathlib import Path

import torch

from zmrl.model.checkpoint import load_checkpoint, save_weights
from zmrl.model.logprobs import token_logprobs
from zmrl.model.packed import forward_packed, split_layer_weights


def warm_start(model_dir: str | Path, examples: list[tuple[list[int], list[int]]], *, steps: int,
               lr: float = 3e-3, batch_size: int = 32, seed: int = 0, device="cpu") -> list[float]:
    """Train every weight of the checkpoint in `model_dir` for `steps` AdamW steps and write it
    back (to a temporary file first, then renamed). -> the loss of each step."""
    if not examples:
        raise ValueError("warm start needs at least one example")
    cfg, weights = load_checkpoint(model_dir, device=str(device))
    params = {k: v.float().requires_grad_(True) for k, v in weights.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        picks = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
        seqs = [torch.tensor(list(examples[i][0]) + list(examples[i][1])) for i in picks]
        logits = forward_packed(cfg, params, split_layer_weights(cfg, params), seqs)
        nll = []
        for lg, seq, i in zip(logits, seqs, picks):
            p = len(examples[i][0])
            nll.append(-token_logprobs(lg[p - 1:len(seq) - 1], seq[p:].to(lg.device), 1.0))
        loss = torch.cat(nll).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0, foreach=False)
        opt.step()
        losses.append(float(loss.detach()))
    dtype = next(iter(weights.values())).dtype
    out = {k: v.detach().to(dtype).cpu() for k, v in params.items()}
    tmp = Path(model_dir) / ".warm_start.tmp"
    tmp.mkdir(exist_ok=True)
    save_weights(cfg, out, tmp)
    (tmp / "model.safetensors").replace(Path(model_dir) / "model.safetensors")
    tmp.rmdir()
    return losses
