"""The reference rollout: a plain loop over zmrl/model, one sequence at a time (the test oracle).

    from zmrl.rollout.reference import ReferenceEngine
    ref = ReferenceEngine.from_dir("runs/tiny-model")
    samples = ref.generate([[1, 2, 3]], n=2, max_tokens=16, temperature=1.0, seed=0)
    lps = ref.score([1, 2, 3], samples[0][0].token_ids, temperature=1.0)   # full-sequence forward

`score` is the trainer's computation: one forward over prompt + completion
(`zmrl.model.packed.forward_packed`), then `token_logprobs` (sample.py's convention).
`generate` prefills every (prompt, sample) sequence in one packed forward, then decodes all
unfinished sequences one token per forward, each through its own cache (the kernels are
batch-invariant, so a token's log-prob does not depend on which sequences share a forward). It
samples with torch's multinomial on the CPU, one seeded generator per sequence, so its token
choices differ from vLLM's sampler; its log-probs follow the same rule.

Device: `from_dir(..., device=)` "auto" (the default: CUDA when present), "cpu" or "cuda" runs
every forward there (the constructor: where the weights are); returned log-probs are CPU tensors.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from zmrl.model.checkpoint import load_checkpoint
from zmrl.model.config import ModelConfig
from zmrl.model.device import resolve_device
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
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "auto") -> "ReferenceEngine":
        cfg, weights = load_checkpoint(model_dir, device=str(resolve_device(device)))
        return cls(cfg, weights)

    @property
    def device(self) -> torch.device:
        return self.weights["model.embed_tokens.weight"].device

    def _split(self) -> None:
        self.w_layers = split_layer_weights(self.cfg, self.weights)

    def _forward(self, seqs: list[torch.Tensor], caches=None) -> list[torch.Tensor]:
        return forward_packed(self.cfg, self.weights, self.w_layers, seqs, caches, self.projections)

    @torch.no_grad()
    def score(self, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
        """Log-probs [len(completion)] of completion given prompt, from one full-sequence forward."""
        seqs = pack_sequences([prompt], [completion])
        return completion_logprobs(self._forward(seqs), [prompt], seqs, temperature)[0].cpu()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 16, temperature: float = 1.0,
                 seed: int | None = None, stop_at_eos: bool = True) -> list[list[Sample]]:
        check_sampling(n, max_tokens, temperature)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
        eos = self.cfg.eos_token_id if stop_at_eos else None
        pairs = [(i, j) for i in range(len(prompts)) for j in range(n)]
        gens = [torch.Generator().manual_seed(derive_seed(seed or 0, i, j)) for i, j in pairs]
        caches = [SequenceCache(self.cfg.num_hidden_layers) for _ in pairs]
        ids: list[list[int]] = [[] for _ in pairs]
        lps: list[list[torch.Tensor]] = [[] for _ in pairs]
        reasons = ["length"] * len(pairs)
        live = list(range(len(pairs)))
        feed = [torch.tensor(prompts[i]) for i, _ in pairs]  # prefill: each sequence's whole prompt
        for _ in range(max_tokens):
            if not live:
                break
            logits = torch.cat([lg[-1:] for lg in self._forward(feed, [caches[s] for s in live])])
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1).cpu()
                toks = torch.cat([torch.multinomial(probs[r:r + 1], 1, generator=gens[s]).view(1)
                                  for r, s in enumerate(live)])
            else:
                toks = logits.float().argmax(-1).cpu()
            step_lps = token_logprobs(logits, toks.to(logits.device), temperature).cpu()
            still = []
            for r, s in enumerate(live):
                ids[s].append(int(toks[r]))
                lps[s].append(step_lps[r:r + 1])
                if eos is not None and ids[s][-1] == eos:
                    reasons[s] = "stop"
                else:
                    still.append((r, s))
            live = [s for _, s in still]
            feed = [toks[r:r + 1] for r, _ in still]
        samples = [Sample(ids[s], torch.cat(lps[s]), reasons[s]) for s in range(len(pairs))]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def sync_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name not in self.weights or self.weights[name].shape != t.shape:
                raise ValueError(f"weight update does not fit the model: {name} {tuple(t.shape)}")
        for name, t in tensors.items():
            self.weights[name].copy_(t)
