"""The transformers host: ZmrlConfig, ZmrlForCausalLM (the reference engine), and register().

The modules only *hold* parameters under the checkpoint names; forward() gathers them into
mappings and runs the functional model (zmrl.model.packed.forward_packed), so this host's
arithmetic is the same code vLLM and Megatron run. Each row of a padded batch is handled as
its own sequence (its real tokens only, positions counted from its first real token), so a
sequence's logits are bitwise the same alone or in any padded batch.

Adapters: pass a zmrl.lora adapter as `adapter=` (or `set_adapter`) for the canonical
unmerged LoRA. If PEFT has wrapped the modules instead, the weights are read as
W + PEFT's delta (PEFT's own, merged semantics: equal to zmrl's LoRA within rounding only).

Registration with the Auto classes happens when this module is imported (its last line), and
`import zmrl` installs an import hook (zmrl.model.autoregister) that imports this module once
transformers is imported, so `import zmrl` itself never imports torch or transformers.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from zmrl.batch_invariant import linear, log_softmax, rms_norm
from zmrl.model.config import ModelConfig, stated_dtype
from zmrl.model.layers import check_weights, layer_param_shapes
from zmrl.model.packed import SequenceCache, forward_packed

_FIELDS = [f for f in ModelConfig.__dataclass_fields__ if f not in ("extra", "bos_token_id", "eos_token_id",
                                                                     "pad_token_id", "tie_word_embeddings",
                                                                     "torch_dtype")]


class ZmrlConfig(PretrainedConfig):
    model_type = "zmrl"

    def __init__(self, **kwargs):
        # before transformers merges the two names (it keeps `dtype`): a config stating two dtypes is refused
        where = kwargs.get("name_or_path")
        stated_dtype(kwargs, f"{where}/config.json" if where else "config")
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in _FIELDS}
        super().__init__(**kwargs)
        for k, v in own.items():
            setattr(self, k, v)

    def to_model_config(self) -> ModelConfig:
        """The validated plain config (raises ConfigError naming inconsistent fields)."""
        d = {k: getattr(self, k) for k in _FIELDS if hasattr(self, k)}
        dtype = getattr(self, "dtype", None) or getattr(self, "torch_dtype", None) or "float32"
        dtype = str(dtype).replace("torch.", "")
        return ModelConfig.from_dict({**d, "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                                      "pad_token_id": self.pad_token_id, "torch_dtype": dtype,
                                      "tie_word_embeddings": bool(getattr(self, "tie_word_embeddings", False))})

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "ZmrlConfig":
        d = cfg.to_dict()
        d["dtype"] = d.pop("torch_dtype")
        return cls(**d)


class _Weight(nn.Module):
    """A module holding one parameter named `weight` (norms, and linears PEFT can wrap)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class ZmrlLinear(nn.Linear):
    """nn.Linear without bias whose forward is the batch-invariant linear (PEFT wraps it)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return linear(x, self.weight)


class ZmrlRMSNorm(_Weight):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim)
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class ZmrlExperts(nn.Module):
    """Routed experts as 3-D parameters, gate_up_proj [E, 2I, D] registered *before*
    down_proj [E, D, I] so PEFT's target_parameters nesting names them as vLLM expects."""

    def __init__(self, e: int, inter: int, d: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, inter))


class ZmrlRouter(nn.Module):
    def __init__(self, e: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(e, d))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e), requires_grad=False)


def _build(module: nn.Module, rel_name: str, shape: tuple[int, ...]) -> None:
    """Create the submodule chain for checkpoint name `rel_name` with the right module type."""
    *path, pname = rel_name.split(".")
    for i, part in enumerate(path):
        if not hasattr(module, part):
            last = i == len(path) - 1
            if last and part == "experts":
                setattr(module, part, ZmrlExperts(shape[0], shape[1] // 2, shape[2]))
            elif last and part == "gate":
                setattr(module, part, ZmrlRouter(*shape))
            elif last and pname == "weight" and len(shape) == 2:
                setattr(module, part, ZmrlLinear(*shape))
            elif last and pname == "weight":
                setattr(module, part, ZmrlRMSNorm(shape[0]))
            else:
                setattr(module, part, nn.Module())
        module = getattr(module, part)


def _resolve(root: nn.Module, name: str) -> torch.Tensor:
    """The effective tensor for checkpoint name `name` under `root`: the parameter, plus the
    delta of every active PEFT wrapper that targets it (PEFT semantics, see module doc)."""
    mod_path, pname = name.rsplit(".", 1)
    m = root.get_submodule(mod_path)
    deltas = []
    while hasattr(m, "base_layer") and hasattr(m, "lora_A"):
        target = getattr(m, "parameter_name", "weight")
        if target == pname and not m.merged and not m.disable_adapters:
            deltas += [m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A]
        m = m.base_layer
    w = getattr(m, pname)
    for d in deltas:
        w = w + d.to(w.dtype)
    return w


class ZmrlPreTrainedModel(PreTrainedModel):
    config_class = ZmrlConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = []

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (ZmrlRMSNorm,)):
            module.weight.fill_(1.0)
        elif isinstance(module, ZmrlRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, ZmrlExperts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)


class ZmrlForCausalLM(ZmrlPreTrainedModel, GenerationMixin):  # generate() below is zmrl's own
    def __init__(self, config: ZmrlConfig):
        super().__init__(config)
        self.zcfg = config.to_model_config()
        cfg = self.zcfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList()
        for i in range(cfg.num_hidden_layers):
            layer = nn.Module()
            for name, shape in layer_param_shapes(cfg, i).items():
                _build(layer, name, shape)
            self.model.layers.append(layer)
        self.model.norm = ZmrlRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = ZmrlLinear(cfg.vocab_size, cfg.hidden_size)
        self.__dict__["_zmrl_adapter"] = None
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_adapter(self, adapter) -> None:
        """Use a zmrl.lora adapter in every forward (None removes it). Not a submodule: the
        adapter's parameters stay out of this model's state_dict."""
        self.__dict__["_zmrl_adapter"] = adapter

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """A local model dir is checked first as every host checks it (zmrl.model.checkpoint):
        tensors of the config's shapes and dtype, a tokenizer of vocab_size tokens."""
        from pathlib import Path

        from zmrl.model.checkpoint import check_model_dir

        if args and Path(str(args[0]), "model.safetensors").is_file():
            check_model_dir(args[0])
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise ValueError(f"checkpoint does not match the config: {bad}")
        return (model, info) if want_info else model

    # ------------------------------------------------------------------ weights
    def weight_maps(self) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        cfg = self.zcfg
        w_model = {"model.embed_tokens.weight": self.model.embed_tokens.weight,
                   "model.norm.weight": self.model.norm.weight}
        if not cfg.tie_word_embeddings:
            w_model["lm_head.weight"] = _resolve(self, "lm_head.weight")
        w_layers = [{n: _resolve(layer, n) for n in layer_param_shapes(cfg, i)}
                    for i, layer in enumerate(self.model.layers)]
        return w_model, w_layers

    def check_weights(self) -> None:
        w_model, w_layers = self.weight_maps()
        flat = dict(w_model)
        for i, w in enumerate(w_layers):
            flat.update({f"model.layers.{i}.{k}": v for k, v in w.items()})
        check_weights(self.zcfg, flat, "model")

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: list[SequenceCache] | None = None, use_cache: bool = False,
                labels: torch.Tensor | None = None, adapter=None, **unused) -> CausalLMOutputWithPast:
        """input_ids [B, L] (new tokens), attention_mask [B, L] (1 = real token; any padding
        side) -> logits [B, L, V] (zeros at padding). With past_key_values (one SequenceCache
        per row, from a previous call with use_cache=True) the new tokens continue each row."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        bsz, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape[-1] != length:  # HF-style mask over past + new: keep the new part
            attention_mask = attention_mask[:, -length:]
        mask = attention_mask.bool()
        caches = past_key_values
        if caches is None and use_cache:
            caches = [SequenceCache(self.zcfg.num_hidden_layers) for _ in range(bsz)]
        if caches is not None and len(caches) != bsz:
            raise ValueError(f"past_key_values holds {len(caches)} sequences, input_ids {bsz}")
        adapter = adapter if adapter is not None else self.__dict__["_zmrl_adapter"]
        projections = adapter.projections if adapter is not None else None
        w_model, w_layers = self.weight_maps()
        seqs = [input_ids[b][mask[b]] for b in range(bsz)]
        outs = forward_packed(self.zcfg, w_model, w_layers, seqs, caches, projections)
        logits = outs[0].new_zeros(bsz, length, outs[0].shape[-1]) if outs else None
        for b in range(bsz):
            logits[b, mask[b]] = outs[b]
        loss = None
        if labels is not None:
            logp = log_softmax(logits[:, :-1].float(), -1)
            target = labels[:, 1:]
            keep = (target != -100) & mask[:, 1:] & mask[:, :-1]
            nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
            loss = nll[keep].sum() / keep.sum().clamp(min=1)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=caches if use_cache else None)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        """Present for PEFT's wrapper; generation itself is `generate` below."""
        return {"input_ids": input_ids, **kwargs}

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 16, do_sample: bool = False, temperature: float = 1.0,
                 generator: torch.Generator | None = None, eos_token_id: int | None = None,
                 adapter=None, **unused) -> torch.Tensor:
        """Prefill once, then one token per step through the per-sequence KV cache.
        Returns [B, L + max_new_tokens]: the input, then new tokens (pad_token_id after eos).
        Sampling: softmax of logits.float() / temperature (zmrl's temperature convention)."""
        eos = self.zcfg.eos_token_id if eos_token_id is None else eos_token_id
        pad = self.zcfg.pad_token_id if self.zcfg.pad_token_id is not None else (eos or 0)
        bsz, length = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        out = self(input_ids, mask, use_cache=True, adapter=adapter)
        caches = out.past_key_values
        last = torch.stack([out.logits[b, int(mask[b].nonzero().max())] for b in range(bsz)])
        done = torch.zeros(bsz, dtype=torch.bool)
        new = []
        for _ in range(max_new_tokens):
            logp = log_softmax(last.float() / temperature, -1)
            if do_sample:
                tok = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            else:
                tok = logp.argmax(-1)
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            new.append(tok)
            if eos is not None:
                done |= tok == eos
            if bool(done.all()):
                break
            step = self(tok[:, None], (~done)[:, None].long() | 1, past_key_values=caches, use_cache=True,
                        adapter=adapter)
            last = step.logits[:, 0]
        gen = torch.stack(new, 1) if new else input_ids.new_zeros(bsz, 0)
        if gen.shape[1] < max_new_tokens:
            gen = torch.cat([gen, gen.new_full((bsz, max_new_tokens - gen.shape[1]), pad)], 1)
        return torch.cat([input_ids, gen.to(input_ids.dtype)], 1)


_registered = False


def register() -> None:
    """Register model_type "zmrl" with AutoConfig / AutoModelForCausalLM (idempotent)."""
    global _registered
    if _registered:
        return
    AutoConfig.register("zmrl", ZmrlConfig, exist_ok=True)
    AutoModelForCausalLM.register(ZmrlConfig, ZmrlForCausalLM, exist_ok=True)
    _registered = True


register()  # importing this module registers; zmrl.model.autoregister relies on it
