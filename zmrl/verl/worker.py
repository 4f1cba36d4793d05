"""The vLLM worker extension of the rollout "zmrl": zmrl's methods and verl's in one class.

verl's vLLM server names one `worker_extension_cls`; vLLM mixes it into each worker process.
This class is zmrl's extension (`zmrl_setup`, `zmrl_set_batch_invariant`, `zmrl_update_weights`,
...) plus verl's (`update_weights_from_ipc`, `monkey_patch_model`, the ZMQ handle, LoRA hijack),
with the two verl methods that assume a vLLM-native model replaced, and the weight-sync socket's
path made unique to the host's Ray cluster (zmrl.verl.rollout.cluster_socket):

- `update_weights_from_ipc` receives verl's weight buckets exactly as verl's does (ZMQ, CUDA IPC
  or, on a CPU, shared memory) and lands them in zmrl's model: base weights are copied in place
  into zmrl's checkpoint-named tensors; a LoRA sync (verl sends `peft_config` with
  `base_sync_done=True`: PEFT-named factors) becomes zmrl's canonical `LoraAdapter`, never
  vLLM's native LoRA, whose punica kernels are not the trainer's arithmetic.
- `monkey_patch_model` would put verl's logits mask (out-of-vocabulary tail, vision
  placeholders) into compute_logits. The trainer applies no such mask, so a masked row would
  give other log-probs than the trainer's: the mask is refused when it would change anything
  and skipped when it would not.
"""
from __future__ import annotations

import logging

import torch

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from zmrl.rollout.vllm.model import LORA_PREFIX
from zmrl.rollout.vllm.worker import ZmrlWorkerExtension
from zmrl.verl.rollout import cluster_socket

logger = logging.getLogger(__name__)


class ZmrlVerlWorkerExtension(ZmrlWorkerExtension, vLLMColocateWorkerExtension):
    def monkey_patch_model(self, vocab_size: int, banned_token_ids: list[int] | None = None) -> None:
        model_vocab = self.model_runner.model.cfg.vocab_size
        if banned_token_ids:
            raise ValueError(f"verl asks the rollout to ban token ids {banned_token_ids[:8]} (vision placeholders); "
                             "zmrl's trainer applies no logits mask, so rollout and trainer log-probs would differ")
        if vocab_size < model_vocab:
            raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocabulary is {model_vocab}: verl "
                             "would mask logits the trainer keeps; give the model a tokenizer covering its vocabulary")

    def _get_zmq_handle(self) -> str:
        """verl's socket path with this host's Ray cluster in it, as zmrl.verl.adapter's sender
        names it (two local clusters on one host would otherwise share one path)."""
        return cluster_socket(super()._get_zmq_handle())

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        """Receive one weight sync from verl's ServerAdapter and copy it into zmrl's model.

        A bucket that does not fit the model (a name it lacks, a wrong shape) is refused whole
        and nothing after it is copied; the remaining buckets are still received and acknowledged
        (verl's sender blocks on each acknowledgement, so raising mid-stream would hang the
        trainer), and the error is raised once the stream has ended."""
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        model = self.model_runner.model
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=model.device, use_shm=use_shm)
        lora = bool(peft_config) and base_sync_done
        factors: dict[str, torch.Tensor] = {}
        copied: list[str] = []
        failure: list[str] = []

        def on_bucket(weights, is_last):
            if failure:
                return
            try:
                if lora:
                    # a bucket's tensors are views of the reused transfer buffer: keep copies
                    factors.update((name, t.clone()) for name, t in weights)
                    if is_last:
                        self._load_lora(peft_config, factors)
                else:
                    copied.extend(model.update_weights(dict(weights)))  # checks the bucket whole first
            except Exception as e:  # noqa: BLE001  (raised below, after the stream ends)
                # the message only: the exception's traceback would hold views of the shared-memory
                # buffer, which the receiver must close ("cannot close exported pointers exist")
                failure.append(f"{type(e).__name__}: {e}")

        receiver.receive_weights(on_bucket_received=on_bucket)
        if failure:
            done = f" ({len(copied)} tensors of earlier buckets were copied)" if copied else " (nothing was copied)"
            raise ValueError(f"verl weight sync refused{done}: {failure[0]}")

    def _load_lora(self, peft_config: dict, tensors: dict[str, torch.Tensor]) -> None:
        from zmrl.lora import adapter_from_peft

        model = self.model_runner.model
        incoming = adapter_from_peft(peft_config, tensors, model.cfg, dtype=model.dtype, where="verl LoRA sync")
        lcfg = incoming.lcfg
        if model.adapter is None or model.adapter.lcfg != lcfg:
            model.set_adapter({"r": lcfg.r, "lora_alpha": lcfg.lora_alpha, "targets": list(lcfg.targets)})
        model.update_weights({LORA_PREFIX + k: v.data for k, v in incoming.factors.items()})
        logger.info("zmrl LoRA sync: %d factors, r=%d, %d targets", len(incoming.factors), lcfg.r, len(lcfg.targets))

    # Answers for tests and diagnostics, as nested lists of Python floats: vLLM's RPC from worker
    # processes does not hand tensors back as tensors (fp32 values survive the float round trip).
    def zmrl_tensor(self, name: str) -> list:
        """One served tensor (checkpoint name, or "lora:" + factor key; this worker's shard under TP)."""
        return self.model_runner.model.shard.tensors()[name].detach().float().tolist()

    def zmrl_adapter_factors(self) -> dict[str, list] | None:
        """The served adapter's factors (checkpoint keys), or None: what a LoRA sync landed."""
        adapter = self.model_runner.model.adapter
        return None if adapter is None else {k: v.detach().float().tolist() for k, v in adapter.factors.items()}
