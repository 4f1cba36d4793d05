"""The Megatron trainer: zmrl's model as megatron-core modules, canonical LoRA, AdamW on fp32 masters.

    from zmrl.lora import LoraConfig
    from zmrl.trainer.megatron import MegatronTrainer
    trainer = MegatronTrainer.from_dir("runs/tiny-model", LoraConfig(r=8), seed=0,
                                       options={"tensor_parallel": 1})
    lp = trainer.logprobs(prompts, completions, temperature=1.0)

Multi-process TP/EP: `zmrl train` starts and drives the ranks itself (zmrl.rl.launcher.TrainerRanks);
by hand, launch max(TP, EP) processes (e.g. `torchrun --nproc-per-node 2 ...`) and build the trainer
with options={"tensor_parallel": 2} (or {"expert_parallel": 2}, ...) in each. Every rank calls every
method (they hold collectives) and gets the same values back; rank 0 writes files.

The optimizer state lives in the canonical adapter layout (zmrl.lora.LoraAdapter.factors, in its
order) on every rank: after backward, each LoRA gradient is gathered (one tensor all-gather over
every rank) from the ranks that hold its pieces, clipped and stepped exactly as the reference trainer does, and the
rounded masters are cut back into this rank's LoRA parameters. So the masters, the AdamW state and `state_dict()` do not
depend on the TP or EP size, and `adapter_tensors()` are the very tensors the forward multiplies by.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

import zmrl.batch_invariant as bi
from zmrl.batch_invariant.collectives import all_gather
from zmrl.lora import LoraAdapter, LoraConfig, save_peft
from zmrl.model.checkpoint import DTYPES, load_checkpoint, read_config
from zmrl.model.config import ModelConfig
from zmrl.model.device import resolve_device
from zmrl.model.logprobs import pack_sequences, token_logprobs
from zmrl.trainer.base import TrainBatch, Trainer, UpdateSettings, check_trainer_state, lora_spec, state_to_cpu
from zmrl.trainer.ppo import adamw, ppo_update
from zmrl.trainer.megatron.convert import Layout, base_shapes, gather, lora_shapes, scatter
from zmrl.trainer.megatron.graphs import LogprobGraphs, MinibatchGraphs
from zmrl.trainer.megatron.parallel import BACKENDS, check_divisible, init_parallel, rank_coords

STATE_FORMAT = "zmrl.trainer.megatron/1"
OPTIONS = {"tensor_parallel": 1, "expert_parallel": None, "batch_invariant": True, "backend": None,
           "cuda_graphs": True}
"""expert_parallel: None (= tensor_parallel) or 1, 2, 4, 8: the routed experts are split whole over
that many ranks; the world is max(tensor_parallel, expert_parallel) processes.
backend: None (NCCL on CUDA, gloo on CPU), "nccl" or "gloo" (on CUDA: several ranks may share a GPU).
cuda_graphs: on one CUDA rank with invariance on, train_step pads each minibatch to a bucketed shape
and replays a CUDA graph per shape (zmrl.trainer.megatron.graphs): the same log-prob bits, the loss
summed over the padded layout (its rounding differs from the eager step's); `logprobs` pads its
batch the same way and replays a graph of the pass, with the unpadded pass's bits. False, CPU,
several ranks or invariance off: eager minibatches and passes."""


class MegatronTrainer(Trainer):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], lora: LoraConfig, *, seed: int = 0,
                 tensor_parallel: int = 1, expert_parallel: int | None = None, batch_invariant: bool = True,
                 backend: str | None = None, cuda_graphs: bool = True,
                 device: str | torch.device | None = "auto"):
        """device: "auto" (CUDA when present), "cpu" or "cuda" (zmrl.model.device); on CUDA each rank
        takes GPU LOCAL_RANK modulo the visible GPUs (zmrl.trainer.megatron.parallel)."""
        check_divisible(cfg, tensor_parallel, expert_parallel)
        self.cfg, self.lora, self.invariant = cfg, lora, batch_invariant
        want = resolve_device(device)
        if backend is None:
            backend = "nccl" if want.type == "cuda" else "gloo"
        elif backend == "nccl" and want.type != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda'; use 'gloo' on CPU")
        par = init_parallel(cfg, tensor_parallel, expert_parallel, backend=backend)
        from zmrl.trainer.megatron.model import ZmrlGPTModel

        self.layout = Layout(cfg, par.tp, par.rank, par.ep, par.ep_rank)
        # every global rank's layout, rank order (the gathers lay the world's tensors out by it)
        self.rank_layouts = [Layout(cfg, par.tp, t, par.ep, e)
                             for t, e in (rank_coords(r, par.tp, par.ep) for r in range(par.world))]
        # built on CPU (Megatron's use_cpu_initialization), then moved to this rank's GPU
        self.device = torch.device("cuda", torch.cuda.current_device()) if want.type == "cuda" else want
        self.model = ZmrlGPTModel(cfg, par.tp, par.ep).to(self.device)
        self.model.requires_grad_(False)  # the base is frozen; only LoRA factors train
        self.model.add_lora(self.layout, lora)
        self.base_slots, self.lora_slots = self.layout.base(), self.layout.lora(lora)
        scatter(self.layout, self.base_slots, weights, self._tensors())
        # the same initial bits as every other backend: zmrl.lora's own initializer
        dtype = DTYPES[cfg.torch_dtype]
        init = LoraAdapter(cfg, lora, seed=seed, dtype=dtype)
        self.names = list(init.factors.keys())
        scatter(self.layout, self.lora_slots, dict(init.factors.items()), self._tensors())
        self.params = {n: p for n, p in self.model.named_parameters() if ".lora_" in n}
        self.masters = [torch.nn.Parameter(p.detach().float().clone().to(self.device)) for p in init.factors.values()]
        self.optimizer = adamw(self.masters)
        self.num_steps = 0
        self.minibatch_graphs = None
        """A MinibatchGraphs that runs train_step's minibatches, or None: the eager minibatch."""
        self.logprob_graphs = None
        """A LogprobGraphs that runs `logprobs`, or None: the eager pass."""
        if cuda_graphs and self.device.type == "cuda" and par.world == 1:
            self.minibatch_graphs = MinibatchGraphs(self)
            self.logprob_graphs = LogprobGraphs(self)

    @staticmethod
    def check_options(model_dir, options: dict | None) -> dict:
        """The options with defaults filled in; raises on unknown ones and on a TP or EP size that
        does not divide the model (before any weight is read or any process starts)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown megatron trainer options {unknown}; known: {sorted(OPTIONS)}")
        opts = {**OPTIONS, **options}
        if opts["backend"] not in (None, *BACKENDS):
            raise ValueError(f"backend={opts['backend']!r} must be one of {BACKENDS} (or unset)")
        check_divisible(read_config(model_dir), opts["tensor_parallel"], opts["expert_parallel"])
        return opts

    @classmethod
    def from_dir(cls, model_dir, lora: LoraConfig, *, seed: int = 0, options: dict | None = None,
                 device: str | torch.device | None = "auto") -> "MegatronTrainer":
        opts = cls.check_options(model_dir, options)
        cfg, weights = load_checkpoint(model_dir)
        return cls(cfg, weights, lora, seed=seed, device=device, **opts)

    # ------------------------------------------------------------------ plumbing
    def _tensors(self) -> dict[str, torch.Tensor]:
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}

    def _all_ranks(self, slots_of, local: dict[str, torch.Tensor]) -> tuple[list[Layout], list[dict]]:
        """Every global rank's (layout, tensors), rank order. One rank: this rank alone, no collective.

        A parameter that holds a TP- or EP-split piece (a column-parallel B, a row- or column-split
        base weight, an expert's factors) travels by one tensor all-gather per dtype over every rank:
        each rank lays its pieces end to end in slot order (every rank's parameters have the same
        names and shapes); a whole parameter is the same on every rank (replicated weights, and their
        gradients, which the canonical reductions make whole) and does not travel. A replica's piece
        (the same TP or EP rank twice, when TP != EP) is a copy: `gather` takes either."""
        world = len(self.rank_layouts)
        if world == 1:
            return [self.layout], [local]
        # pieces that differ between ranks: TP chunks when TP > 1, experts when EP > 1 (otherwise
        # every rank holds the whole tensor, a replica)
        lay = self.layout
        split = sorted({s.param for s in slots_of(lay)
                        if (s.split == "expert" and lay.ep > 1) or (s.split in ("dim0", "dim1") and lay.tp > 1)})
        out = [dict(local) for _ in range(world)]
        for dtype in sorted({local[n].dtype for n in split}, key=str):
            names = [n for n in split if local[n].dtype == dtype]
            flat = torch.cat([local[n].detach().reshape(-1) for n in names])
            gathered = all_gather(flat, _world_group(), world)
            for r in range(world):
                for n, piece in zip(names, gathered[r].split([local[n].numel() for n in names])):
                    out[r][n] = piece.view(local[n].shape)
        return self.rank_layouts, out

    def _canonical(self, slots_of, local: dict[str, torch.Tensor], shapes: dict,
                   copy: bool = True) -> dict[str, torch.Tensor]:
        layouts, tensors = self._all_ranks(slots_of, local)
        out = gather(layouts, [slots_of(lay) for lay in layouts], tensors, shapes, copy)
        return {k: v.to(self.device) for k, v in out.items()}

    @contextlib.contextmanager
    def _kernels(self):
        """Off (the negative control): torch's aten kernels and every zmrl op on its "torch"
        path, as `zmrl check --batch-invariant off` runs the other engines."""
        if self.invariant:
            yield
            return
        with bi.batch_invariant_mode(False), bi.use_path("torch"):
            yield

    # ------------------------------------------------------------------ log-probs
    def _logprobs(self, prompts, completions, temperature: float, adapter: bool) -> list[torch.Tensor]:
        seqs = pack_sequences(prompts, completions)
        self.model.set_lora_enabled(adapter)
        try:
            with self._kernels():
                logits, bounds = self.model.forward_packed(seqs)
        finally:
            self.model.set_lora_enabled(True)
        # every completion row of the packed logits in one call (log_softmax is per row: the bits of
        # one call per sequence), rows and tokens built on the host and copied once
        rows = torch.cat([torch.arange(lo + len(p) - 1, hi - 1) for lo, hi, p in zip(bounds, bounds[1:], prompts)])
        tokens = torch.cat([seq[len(p):] for seq, p in zip(seqs, prompts)])
        device = logits.device
        with self._kernels():
            picked = logits.index_select(0, rows.to(device, non_blocking=True))
            lps = token_logprobs(picked, tokens.to(device, non_blocking=True), temperature)
        return list(lps.split([len(c) for c in completions]))

    @torch.no_grad()
    def logprobs(self, prompts, completions, *, temperature: float, adapter: bool = True) -> list[torch.Tensor]:
        if self.model.training:  # eval() walks every module (~0.6 ms); train_step leaves the model in eval
            self.model.eval()
        lps = None
        if self.logprob_graphs is not None and self.invariant:
            lps = self.logprob_graphs.run(prompts, completions, temperature, adapter)
        if lps is None:
            lps = self._logprobs(prompts, completions, temperature, adapter)
        flat = torch.cat(lps).cpu()  # one copy back: the pass's one wait for the GPU
        bi.raise_failed_checks()  # a bad value found on the device stops here, before anyone reads these
        return [t.clone() for t in flat.split([t.numel() for t in lps])]

    def logits(self, token_ids: list[torch.Tensor], adapter: bool = True) -> list[torch.Tensor]:
        """Whole-sequence logits [L, V] per sequence (tests and tools)."""
        self.model.set_lora_enabled(adapter)
        try:
            with self._kernels():
                return self.model.forward_sequences(token_ids)
        finally:
            self.model.set_lora_enabled(True)

    # ------------------------------------------------------------------ gradients and the optimizer
    def lora_grads(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The LoRA gradient in the canonical adapter layout (zeros where none flowed). copy=False:
        where this rank holds a whole factor, its gradient tensor itself (read it before the next
        backward)."""
        local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()}
        return self._canonical(lambda lay: lay.lora(self.lora), local, lora_shapes(self.cfg, self.lora), copy)

    def _master_grads(self) -> list[torch.Tensor]:
        grads = self.lora_grads(copy=False)  # copied (and cast to fp32) onto the masters at once
        return [grads[n] for n in self.names]

    def _write_masters(self) -> None:
        with torch.no_grad():
            canonical = {n: m.detach() for n, m in zip(self.names, self.masters)}
            scatter(self.layout, self.lora_slots, canonical, self.params)  # rounds once, here

    def train_step(self, batch: TrainBatch, settings: UpdateSettings, step: int) -> dict[str, float]:
        # every TP rank holds the same loss; Megatron's regions sum what the ranks share, and the
        # gradients are gathered into the canonical adapter layout before the (shared) optimizer step
        def zero_grads():
            for p in self.params.values():
                p.grad = None

        self.model.train()
        try:
            metrics, num_updates = ppo_update(
                batch, settings, step, optimizer=self.optimizer, masters=self.masters,
                logprobs=lambda prompts, completions: self._logprobs(prompts, completions, settings.temperature, True),
                zero_grads=zero_grads,
                master_grads=self._master_grads,
                write_masters=self._write_masters,
                minibatch=self._graphed_minibatch(batch, settings))
        finally:
            self.model.eval()
        bi.raise_failed_checks()  # a bad value found on the device stops the step before its metrics count
        self.num_steps += num_updates
        return metrics

    def _graphed_minibatch(self, batch: TrainBatch, settings: UpdateSettings):
        """The padded, graphed minibatch run, or None (the eager one): invariance off (the negative
        control, on torch's kernels) always runs eagerly."""
        if self.minibatch_graphs is None or not self.invariant:
            return None
        return lambda idx, first, eager: self.minibatch_graphs.run(batch, idx, settings, first, eager)

    # ------------------------------------------------------------------ weights and state
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        tensors = self._canonical(lambda lay: lay.lora(self.lora), self.params, lora_shapes(self.cfg, self.lora))
        return {n: tensors[n] for n in self.names}

    def adapter(self) -> LoraAdapter:
        """A zmrl.lora.LoraAdapter holding the current factors (for the reference host or PEFT)."""
        out = LoraAdapter(self.cfg, self.lora, dtype=DTYPES[self.cfg.torch_dtype])
        with torch.no_grad():
            for k, t in self.adapter_tensors().items():
                out.factors[k].copy_(t)
        return out

    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the adapter (and its fp32 masters) from canonical tensors, e.g. a loaded PEFT adapter's factors."""
        shapes = lora_shapes(self.cfg, self.lora)
        bad = sorted(set(shapes) ^ set(tensors)) + [k for k in shapes if k in tensors and tuple(tensors[k].shape)
                                                    != tuple(shapes[k])]
        if bad:
            raise ValueError(f"adapter tensors do not fit this adapter: {bad[:6]}")
        with torch.no_grad():
            for m, n in zip(self.masters, self.names):
                m.copy_(tensors[n].float())
        self._write_masters()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The base weights mapped back to the HF checkpoint names (gathered from every rank)."""
        local = self._tensors()
        return self._canonical(lambda lay: lay.base(), {k: v for k, v in local.items() if ".lora_" not in k},
                               base_shapes(self.cfg))

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "num_steps": self.num_steps, "lora": lora_spec(self.lora),
                "adapter": {k: t.detach().cpu().clone() for k, t in self.adapter_tensors().items()},
                "masters": {k: m.detach().cpu().clone() for k, m in zip(self.names, self.masters)},
                "optimizer": state_to_cpu(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        check_trainer_state(state, STATE_FORMAT, self.lora, lora_shapes(self.cfg, self.lora))
        with torch.no_grad():
            for k, m in zip(self.names, self.masters):
                m.copy_(state["masters"][k])
            scatter(self.layout, self.lora_slots, state["adapter"], self.params)
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps = int(state["num_steps"])

    def save_adapter(self, out: str | Path, base_model_name_or_path: str | None = None) -> Path:
        adapter = self.adapter()  # every rank takes part in the gather; rank 0 writes
        if torch.distributed.get_rank() == 0:
            save_peft(adapter, out, base_model_name_or_path)
        if len(self.rank_layouts) > 1:
            torch.distributed.barrier(group=_world_group())
        return Path(out)


def _world_group():
    return torch.distributed.group.WORLD


TRAINER = MegatronTrainer
