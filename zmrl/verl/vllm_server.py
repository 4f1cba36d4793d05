"""verl's vLLM server and replica, serving zmrl's model with zmrl's worker extension.

verl's `vLLMHttpServer` (a Ray actor) builds `vllm serve` arguments and starts vLLM's
`AsyncLLM` with worker processes; vLLM's general plugin (zmrl.rollout.vllm.plugin) makes the
checkpoint's `ZmrlForCausalLM` resolve to zmrl's model in each of them. The subclasses here
change only what zmrl's numerics contract needs, through verl's own hooks:

- the worker extension is zmrl.verl.worker's (zmrl's and verl's methods; weight and LoRA sync
  land in zmrl's tensors and zmrl's LoraAdapter);
- after start-up each worker runs `zmrl_setup` and switches zmrl's batch-invariant kernels on
  (`zmrl.batch_invariant.enable()`: vLLM's sampler then computes the reported log-prob with the
  trainer's log_softmax);
- the rollout options that would make vLLM's log-probs differ from the trainer's are refused
  with the option's name: a dtype other than the checkpoint's, logprobs_mode other than
  "processed_logprobs" (log_softmax(logits / T) in fp32, zmrl's convention), top-k / top-p /
  repetition penalty (the trainer applies no such mask or penalty), verl's `full_determinism`
  (it sets VLLM_BATCH_INVARIANT, which breaks softmax/bmm on CPU; zmrl brings its own kernels);
- eager execution always (torch.compile's fusions would change the arithmetic) and real weights
  always: zmrl's model has no tensors before a load, and vLLM's start-up computes logits, so
  verl's "dummy" load format becomes "auto" (the trainer's first sync then overwrites in place);
- the paged latent cache gets an explicit size (vLLM's CPU default claims ~14 GiB);
- where vLLM has no sleep mode (its CPU platform), the engine keeps weights and cache between
  rollouts (verl's `enable_sleep_mode` and `free_cache_engine` are turned off for it).

Options of its own, under `actor_rollout_ref.rollout.engine_kwargs.zmrl` (the rest of that dict
goes to vLLM as for verl's vLLM rollout): `batch_invariant` (default true; false is the control:
torch's kernels on the rollout side) and `kv_cache_memory_bytes` (default 256 MiB).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import ray

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
from zmrl.verl.rollout import ROLLOUT_NAME, WORKER_EXTENSION

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 256 << 20


class ZmrlHttpServer(vLLMHttpServer):
    def _validate_configs(self) -> None:
        super()._validate_configs()
        from zmrl.rollout.vllm.engine import check_model_dir

        cfg = self.config
        model_dtype = str(check_model_dir(Path(self.model_config.local_path)).torch_dtype).removeprefix("torch.")
        problems = []
        if cfg.dtype not in (model_dtype, "auto"):
            problems.append(f"rollout.dtype={cfg.dtype} but the checkpoint (and so the trainer) is {model_dtype}: "
                            f"set actor_rollout_ref.rollout.dtype={model_dtype}")
        if cfg.logprobs_mode != "processed_logprobs":
            problems.append(f"rollout.logprobs_mode={cfg.logprobs_mode}: zmrl compares log_softmax(logits / T), "
                            "vLLM's 'processed_logprobs'")
        if cfg.top_k not in (-1, 0) or cfg.top_p != 1.0 or cfg.get("repetition_penalty", 1.0) != 1.0:
            problems.append(f"rollout top_k={cfg.top_k}, top_p={cfg.top_p}, repetition_penalty="
                            f"{cfg.get('repetition_penalty', 1.0)}: the trainer applies no such mask or penalty")
        if cfg.full_determinism:
            problems.append("rollout.full_determinism sets VLLM_BATCH_INVARIANT, which breaks softmax/bmm on CPU; "
                            "zmrl's own kernels make the rollout batch-invariant")
        if problems:
            raise ValueError("rollout 'zmrl': " + "; ".join(problems))
        from vllm.platforms import current_platform

        changes = {}  # verl's RolloutConfig is frozen: a changed copy replaces it
        if cfg.load_format == "dummy":
            logger.info("rollout 'zmrl': loading the checkpoint (load_format 'auto' for 'dummy'): zmrl's model "
                        "holds no tensors before a load and vLLM computes logits during start-up")
            changes["load_format"] = "auto"
        if not current_platform.is_sleep_mode_available() and (cfg.enable_sleep_mode or cfg.free_cache_engine):
            logger.info("rollout 'zmrl': vLLM has no sleep mode on %s: the engine keeps its weights and cache "
                        "between rollouts (enable_sleep_mode and free_cache_engine off)", current_platform.device_name)
            changes.update(enable_sleep_mode=False, free_cache_engine=False)
        if not cfg.enforce_eager:
            logger.info("rollout 'zmrl': eager execution (torch.compile would fuse zmrl's ops into other arithmetic)")
            changes["enforce_eager"] = True
        if changes:
            self.config = dataclasses.replace(cfg, **changes)

    def _get_engine_kwargs_key(self) -> str:
        return ROLLOUT_NAME

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        self._batch_invariant = bool(engine_kwargs.pop("batch_invariant", True))
        engine_kwargs.setdefault("kv_cache_memory_bytes", DEFAULT_KV_CACHE_BYTES)

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION

    @property
    def lora_as_adapter(self) -> bool:
        # the LoRA lives in zmrl's model (zmrl's LoraAdapter, synced by the worker extension), never
        # as a vLLM LoRA request: verl would otherwise ask vLLM for its native LoRA
        return False

    async def run_server(self, args) -> None:
        # verl turns on vLLM's native LoRA when the model config has a LoRA rank; zmrl's model
        # carries its own adapter (and vLLM refuses LoRA for it)
        args.enable_lora = False
        await super().run_server(args)
        await self.engine.collective_rpc("zmrl_setup")
        await self.zmrl_set_batch_invariant(self._batch_invariant)

    async def wake_up(self, tags: list[str] | None = None):
        if self.config.enable_sleep_mode:
            return await super().wake_up(tags)
        # nothing was put to sleep; what waking up after a sync still owes is a fresh prefix cache
        if self.node_rank == 0:
            await self.engine.reset_prefix_cache()

    async def sleep(self):
        if self.config.enable_sleep_mode:
            return await super().sleep()

    async def zmrl_set_batch_invariant(self, on: bool) -> None:
        """zmrl's kernels on (the contract) or off (the control) in every worker; the prefix
        cache's entries were computed under the other kernels, so it is dropped."""
        await self.engine.collective_rpc("zmrl_set_batch_invariant", args=(on,))
        await self.engine.reset_prefix_cache()
        self._batch_invariant = on

    async def zmrl_worker_call(self, method: str, *args):
        """A zmrl worker-extension method's answer from every worker (for tests and diagnostics)."""
        return await self.engine.collective_rpc(method, args=args)


class ZmrlReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(ZmrlHttpServer)

    def _get_server_name_prefix(self) -> str:
        # verl's ServerAdapter finds the servers as "<rollout name>_server_<replica>_<node>"
        return f"{ROLLOUT_NAME}_"
