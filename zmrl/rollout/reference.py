"""The reference rollout: a plain loop over zmrl/model, one sequence at a time (the test oracle).

    from zmrl.rollout.reference import ReferenceEngine
    ref = ReferenceEngine.from_dir("runs/tiny-model")
    samples = ref.generate([[1, 2, 3]], n=2, max_tokens=16, temperature=1.0, seed=0)
    lps = ref.score([1, 2, 3], samples[0][0].token_ids, temperature=1.0)   # full-sequence forward

`score` is the trainer's computation: one forward over prompt + completion
(`zmrl.model.packed.forward_packed`), then `token_logprobs` (sample.py's convention).
`generate` prefills and decodes through a per-sequence cache and samples with torch's
multinomial, so its token choices differ from vLLM's sampler; its log-probs follow the same rule.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from zmrl.model.checkpoint import load_checkpoint
from zmrl.model.config import ModelConfig
from zmrl.model.packed import SequenceCache, forward_packed, split_layer_weights
from zmrl.model.projections import Projections
from zmrl.model.logprobs import completion_logprobs, pack_sequences
from zmrl.rollout.sample import Sample, check_sampling, derive_seed, token_logprobs


class ReferenceEngine:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 projections: Callable[[int], Projections] | None = None):
        self.cfg = cfg
        self.weights = weights
        self.projections = projections
        self._split()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ReferenceEngine":
        cfg, weights = load_checkpoint(model_dir)
        return cls(cfg, weights)

    def _split(self) -> None:
        self.w_layers = split_layer_weights(self.cfg, self.weights)

    def _forward(self, seqs: list[torch.Tensor], caches=None) -> list[torch.Tensor]:
        return forward_packed(self.cfg, self.weights, self.w_layers, seqs, caches, self.projections)

    @torch.no_grad()
    def score(self, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
        """Log-probs [len(completion)] of completion given prompt, from one full-sequence forward."""
        seqs = pack_sequences([prompt], [completion])
        return completion_logprobs(self._forward(seqs), [prompt], seqs, temperature)[0]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
                 seed: int | None = None, stop_at_eos: bool = True) -> list[list[Sample]]:
        check_sampling(n, max_tokens, temperature)
        eos = self.cfg.eos_token_id if stop_at_eos else None
        out = []
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            samples = []
            for j in range(n):
                gen = torch.Generator().manual_seed(derive_seed(seed or 0, i, j))
                cache = SequenceCache(self.cfg.num_hidden_layers)
                logits = self._forward([torch.tensor(prompt)], [cache])[0][-1:]
                ids, lps, reason = [], [], "length"
                for _ in range(max_tokens):
                    if temperature > 0:
                        probs = torch.softmax(logits.float() / temperature, -1)
                        tok = torch.multinomial(probs, 1, generator=gen).view(1)
                    else:
                        tok = logits.float().argmax(-1).view(1)
                    lps.append(token_logprobs(logits, tok, temperature))
                    ids.append(int(tok))
                    if eos is not None and ids[-1] == eos:
                        reason = "stop"
                        break
                    logits = self._forward([tok], [cache])[0]
                samples.append(Sample(ids, torch.cat(lps), reason))
            out.append(samples)
        return out

    @torch.no_grad()
    def sync_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name not in self.weights or self.weights[name].shape != t.shape:
                raise ValueError(f"weight update does not fit the model: {name} {tuple(t.shape)}")
        for name, t in tensors.items():
            self.weights[name].copy_(t)
