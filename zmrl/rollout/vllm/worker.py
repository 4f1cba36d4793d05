"""Methods mixed into vLLM's worker (`LLM(worker_extension_cls=...)`), called by name through
`llm.collective_rpc`. Tensors travel by vLLM's own serialization, so the same calls work
in-process and with vLLM's worker processes, and no file is written.
"""
from __future__ import annotations

import torch


class ZmrlWorkerExtension:
    def zmrl_setup(self) -> None:
        runner = self.model_runner
        if runner.device.type == "cpu":
            _install_cpu_generator_rewind(runner)

    def zmrl_set_batch_invariant(self, on: bool) -> bool:
        """on: route this process's aten matmul/softmax/log_softmax/mean through zmrl's kernels,
        which is what makes vLLM's sampler compute the reported log-prob with
        zmrl.batch_invariant.log_softmax, the same kernel the trainer uses.

        off (the control): torch's own aten kernels for vLLM's sampler, and the model runs every
        zmrl op on the "torch" path. disable() must come with the torch path: that path calls
        plain torch ops, which enable() would route back into zmrl's kernels."""
        import zmrl.batch_invariant as bi

        if on:
            bi.enable()
        else:
            bi.disable()
        self.model_runner.model.set_batch_invariant(on)
        return bi.is_enabled()

    def zmrl_set_ordinary_all_reduce(self, on: bool) -> None:
        """on: this worker's cross-rank sums become one local GEMM or sum then an ordinary
        all-reduce (zmrl.batch_invariant.collectives.ordinary_all_reduce): the negative control of
        tensor parallelism, under which TP = 2 no longer gives the TP = 1 bits."""
        from zmrl.batch_invariant.collectives import set_ordinary_all_reduce

        set_ordinary_all_reduce(on)

    def zmrl_set_adapter(self, lora: dict | None) -> None:
        self.model_runner.model.set_adapter(lora)

    def zmrl_update_weights(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Copy tensors into the running model in place (base weights or LoRA factors)."""
        return self.model_runner.model.update_weights(tensors)

    def zmrl_weight_names(self) -> dict[str, tuple[list[int], str]]:
        """name -> (shape, dtype) of every tensor update_weights accepts."""
        return self.model_runner.model.weight_names()


class _Rewind:
    """What `_bookkeeping_sync` gets for a request whose sample is discarded (a partial prefill).

    vLLM 0.32 undoes that request's random draw with gen.set_offset(gen.get_offset() - 4),
    a Philox (CUDA) notion: a CPU generator raises "CPU Generator does not use offset", so
    any seeded request with chunked prefill crashes the engine. Here the undo restores the
    generator's state from just before this step's draw, which is what the rewind means."""

    def __init__(self, gen: torch.Generator, before: dict[int, torch.Tensor]):
        self.gen, self.before = gen, before

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        state = self.before.pop(id(self.gen), None)
        if state is not None:  # no snapshot: no draw happened this step, nothing to undo
            self.gen.set_state(state)


class _RewindableGenerators(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.before: dict[int, torch.Tensor] = {}

    def get(self, key, default=None):
        gen = super().get(key, default)
        return None if gen is None else _Rewind(gen, self.before)


def _install_cpu_generator_rewind(runner) -> None:
    batch = runner.input_batch
    if isinstance(batch.generators, _RewindableGenerators):
        return
    generators = _RewindableGenerators(batch.generators)
    batch.generators = generators
    sampler = runner.sampler.topk_topp_sampler
    draw = sampler.forward

    def forward(logits, gens, k, p, *args, **kwargs):
        generators.before = {id(g): g.get_state() for g in gens.values()}
        return draw(logits, gens, k, p, *args, **kwargs)

    sampler.forward = forward
