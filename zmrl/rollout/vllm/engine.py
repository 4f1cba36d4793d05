"""The vLLM rollout engine: n completions per prompt with per-token log-probs, and weight sync.

    from zmrl.rollout.vllm import VllmEngine
    engine = VllmEngine("runs/tiny-model", max_model_len=512)
    out = engine.generate([[1, 2, 3], [4, 5]], n=2, max_tokens=16, temperature=1.0, seed=0)
    engine.sync_weights({"model.layers.0.self_attn.q_a_proj.lora_B": b, ...})

Log-prob convention (the one zmrl uses everywhere): the reported value for a sampled token is
log_softmax(logits / T)[token] in fp32, T the request's temperature (T = 1 for greedy, T = 0),
no top-k/top-p. vLLM computes it itself (`logprobs_mode="processed_logprobs"`: fp32 cast, divide
by T, log_softmax); with invariance on, the worker has called `zmrl.batch_invariant.enable()`,
so that log_softmax *is* zmrl.batch_invariant.log_softmax, the kernel the trainer runs.
`zmrl.rollout.sample.token_logprobs` is the same computation on the trainer side.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with eager execution: no
torch.compile, whose fusions would change the arithmetic away from the trainer's.

Tensor parallel: `extra={"tensor_parallel_size": N}` runs the model on N vLLM worker processes
(vLLM's multiprocessing executor; gloo between them on CPU), each holding the shard of the
trainer's TP rank of the same index (see model.py): the same bits as TP = 1. N must divide the
canonical leaves of every split dimension (zmrl.model.sharding.check_divisible), checked before
vLLM starts. On CPU, vLLM's automatic thread binding wants one NUMA node per worker; unless
VLLM_CPU_OMP_THREADS_BIND is set, the engine sets it to "nobind" (the workers share the cores).
`num_threads` is then each worker's torch thread count. A script that starts a TP engine must
guard its entry point (`if __name__ == "__main__":`): the workers are spawned processes.

`batch_invariant=False` is the control: vLLM's sampler on torch's aten kernels
(`zmrl.batch_invariant.disable()`) and every zmrl op in the model on the "torch" path
(see model.py). It is process-wide while it lasts: call `set_batch_invariant(True)` to go back.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zmrl.rollout.sample import Sample, check_sampling, derive_seed


@dataclass(kw_only=True)
class EngineConfig:
    max_model_len: int = 1024
    """Longest prompt + completion."""
    max_num_seqs: int = 16
    """Most requests in one scheduler step."""
    max_num_batched_tokens: int = 256
    """Tokens per step; prompts longer than this are prefilled in chunks."""
    kv_cache_gib: float = 0.25
    """Memory for the paged latent cache (vLLM's CPU default would claim ~14 GiB)."""
    block_size: int = 16
    num_threads: int | None = None
    """torch threads in this process; None keeps the current setting (vLLM would cut it to 1)."""
    enable_prefix_caching: bool = True
    batch_invariant: bool = True
    """Route every op through zmrl.batch_invariant (off: default torch kernels, the control)."""
    seed: int = 0
    extra: dict = field(default_factory=dict)
    """Further keyword arguments for vllm.LLM (mapped by the caller, e.g. for GPU runs)."""


class VllmEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **overrides):
        cfg = config or EngineConfig()
        for key, value in overrides.items():
            if not hasattr(cfg, key):
                raise TypeError(f"unknown engine option {key!r}")
            setattr(cfg, key, value)
        self.config = cfg
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        self.model_config = check_model_dir(model_dir)  # fail before vLLM's ~20 s start, with names
        # in-process engine: callables and tensors pass to the worker without serialization,
        # and the worker's enable() switch is this process's switch
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if os.environ.get("VLLM_BATCH_INVARIANT") not in (None, "", "0"):
            raise RuntimeError("VLLM_BATCH_INVARIANT breaks softmax/bmm on CPU; zmrl brings its own kernels")
        threads = cfg.num_threads or torch.get_num_threads()
        # vLLM cuts torch to 1 thread unless OMP_NUM_THREADS is set
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)

        from vllm import LLM

        from zmrl.rollout.vllm.plugin import register

        check_extra(cfg.extra)

        tp = check_tensor_parallel(self.model_config, cfg.extra)
        self.tensor_parallel_size = tp
        if tp > 1 and not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

        register()  # the entry point does this too; here it also covers an un-installed checkout
        # vLLM's "auto" would serve an fp32 checkpoint in bf16: the trainer's dtype is the config's
        dtype = self.model_config.torch_dtype
        has_tokenizer = any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=not has_tokenizer,
            enforce_eager=True,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=True,
            enable_prefix_caching=cfg.enable_prefix_caching,
            block_size=cfg.block_size,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * (1 << 30)),
            logprobs_mode="processed_logprobs",
            worker_extension_cls="zmrl.rollout.vllm.worker.ZmrlWorkerExtension",
            seed=cfg.seed,
            **cfg.extra,
        )
        self.llm.collective_rpc("zmrl_setup")
        self.set_batch_invariant(cfg.batch_invariant)
        self.last_stats: dict[str, int] = {}
        """How vLLM scheduled the last generate call: prompt_tokens, prefix_cached_tokens (served
        from the prefix cache), prefill_chunks (scheduler steps that left a prompt part-prefilled)."""
        self._prefill_chunks = 0
        self._count_prefill_chunks()

    def _count_prefill_chunks(self) -> None:
        """Wrap the (in-process) scheduler's schedule(): after it, a scheduled request whose prompt
        is still not fully computed was given one chunk of it (chunked prefill)."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def counting(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self._prefill_chunks += sum(scheduler.requests[r].is_prefill_chunk for r in out.num_scheduled_tokens)
            return out

        scheduler.schedule = counting

    # ------------------------------------------------------------------ switches
    def set_batch_invariant(self, on: bool) -> None:
        self.llm.collective_rpc("zmrl_set_batch_invariant", args=(on,))
        self.config.batch_invariant = on
        self.llm.reset_prefix_cache()  # cached entries were computed under the other kernels

    def set_ordinary_all_reduce(self, on: bool) -> None:
        """The negative control of tensor parallelism: every worker's cross-rank sums become an
        ordinary all-reduce (zmrl.batch_invariant.collectives.ordinary_all_reduce) until switched
        back. Process-wide in each worker, like the invariance switch."""
        self.llm.collective_rpc("zmrl_set_ordinary_all_reduce", args=(on,))
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]] | list[str], n: int = 1, max_tokens: int = 16,
                 temperature: float = 1.0, seed: int | None = None,
                 stop_at_eos: bool = True) -> list[list[Sample]]:
        """prompts (token ids, or strings when the model dir has a tokenizer) -> [prompt][n] Samples.

        Completion j of prompt i is sampled with seed (seed, i, j), so a prompt's samples do not
        depend on which other prompts share the call."""
        check_sampling(n, max_tokens, temperature)
        if not prompts:
            return []
        requests, params = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                request = {"prompt": prompt}
            else:
                ids = [int(t) for t in prompt]
                if not ids:
                    raise ValueError(f"prompt {i} is empty")
                request = {"prompt_token_ids": ids}
            for j in range(n):
                requests.append(request)
                params.append(sampling_params(max_tokens, temperature,
                                              None if seed is None else derive_seed(seed, i, j), stop_at_eos))
        self._prefill_chunks = 0
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.last_stats = {"prompt_tokens": sum(len(out.prompt_token_ids) for out in outputs),
                           "prefix_cached_tokens": sum(out.num_cached_tokens or 0 for out in outputs),
                           "prefill_chunks": self._prefill_chunks}
        samples = [to_sample(out) for out in outputs]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    # ------------------------------------------------------------------ weights
    def set_adapter(self, lora_config) -> None:
        """Serve a canonical zmrl LoRA (a zmrl.lora.LoraConfig; None: base model only). Its B
        factors start at zero; `sync_weights(adapter=...)` brings the trainer's."""
        fields = None if lora_config is None else {
            "r": lora_config.r, "lora_alpha": lora_config.lora_alpha, "targets": list(lora_config.targets)}
        self.llm.collective_rpc("zmrl_set_adapter", args=(fields,))
        self.llm.reset_prefix_cache()

    def sync_weights(self, tensors: dict[str, torch.Tensor] | None = None, adapter=None) -> None:
        """Copy base weights (checkpoint names) and/or an adapter's factors (a zmrl.lora.LoraAdapter
        with the served LoraConfig) into the running model in place, no files, no restart; then
        drop the prefix cache, whose entries were computed with the old weights."""
        update = {k: v.detach() for k, v in (tensors or {}).items()}
        if adapter is not None:
            update.update({"lora:" + k: v.detach() for k, v in adapter.factors.items()})
        if not update:
            return
        self.llm.collective_rpc("zmrl_update_weights", args=(update,))
        self.llm.reset_prefix_cache()

    def weight_names(self) -> dict[str, tuple[list[int], str]]:
        return self.llm.collective_rpc("zmrl_weight_names")[0]

    def shutdown(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()



def sampling_params(max_tokens: int, temperature: float, seed: int | None, stop_at_eos: bool = True):
    """One completion's vllm.SamplingParams: the sampled token's log-prob only, no text."""
    from vllm import SamplingParams

    return SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature, seed=seed,
                          logprobs=0, detokenize=False, ignore_eos=not stop_at_eos)


def to_sample(output) -> Sample:
    """A finished vllm.RequestOutput (n = 1) -> Sample."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    lps = [step[t].logprob for step, t in zip(completion.logprobs, ids)]
    return Sample(ids, torch.tensor(lps, dtype=torch.float32), completion.finish_reason)


# vllm.LLM arguments the engine sets itself (extra must not repeat them)
ENGINE_SET = {"model", "skip_tokenizer_init", "enforce_eager", "dtype", "max_model_len", "max_num_seqs",
              "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "block_size",
              "kv_cache_memory_bytes", "logprobs_mode", "worker_extension_cls", "seed"}


def check_extra(extra: dict) -> None:
    """ValueError naming a key of `extra` that vllm.LLM does not take, or that the engine sets."""
    import dataclasses
    import inspect

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    for key in sorted(extra):
        if key in ENGINE_SET:
            raise ValueError(f"rollout.extra.{key}: set by zmrl itself (use the [rollout] key, if there is one)")
        if key not in known or key in ("self", "kwargs"):
            raise ValueError(f"rollout.extra.{key}: not an argument of vllm.LLM / EngineArgs")


def check_tensor_parallel(model_config, extra: dict) -> int:
    """rollout.extra's tensor_parallel_size (1 if absent) -> that size, after checking that it
    divides the canonical leaves of every dimension the model splits (one-line ValueError)."""
    from zmrl.model.sharding import check_divisible

    tp = extra.get("tensor_parallel_size", 1)
    check_divisible(model_config, tp, "rollout.extra.tensor_parallel_size")
    if extra.get("pipeline_parallel_size", 1) != 1 or extra.get("data_parallel_size", 1) != 1:
        raise ValueError("rollout.extra: zmrl's vLLM model runs tensor parallel only "
                         "(pipeline_parallel_size and data_parallel_size must be 1)")
    return tp


def check_model_dir(model_dir: Path):
    """zmrl.model.checkpoint.check_model_dir: the dir's files agree -> the ModelConfig (before vLLM starts)."""
    from zmrl.model.checkpoint import check_model_dir as check

    return check(model_dir)
