"""The model family's configuration: a plain, validated dataclass (no torch, no transformers).

Field names follow the DeepSeek-V3 / Kimi-K2 HF configs where one exists, so a config.json
written by `zmrl init-model` reads naturally next to theirs. `ZmrlConfig` in
`zmrl.model.hf` is the transformers face of the same fields.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config whose fields contradict each other; the message names the fields."""


DTYPE_NAMES = ("float32", "bfloat16")
"""The dtypes a checkpoint may be stored (and hence served and trained) in."""


def stated_dtype(data: dict, source: str = "config") -> str | None:
    """The dtype a config states: `dtype` (transformers >= 4.56 writes this) or `torch_dtype`
    (older ones). Hosts read different ones of the two (vLLM and transformers prefer `dtype`, older
    code `torch_dtype`), so a config where both are set and differ would run the same weights in
    two dtypes: refused here, naming `source` and both values. -> the name ("bfloat16"), or None."""
    names = {key: str(data[key]).removeprefix("torch.") for key in ("dtype", "torch_dtype")
             if data.get(key) is not None}
    if len(set(names.values())) > 1:
        raise ConfigError(f"{source}: dtype={names['dtype']!r} but torch_dtype={names['torch_dtype']!r}; "
                          f"they must name the dtype model.safetensors is stored in (set both alike, or only dtype)")
    return next(iter(names.values()), None)


@dataclass(kw_only=True)
class ModelConfig:
    vocab_size: int
    """Rows of the embedding and of the LM head; must equal the tokenizer's size."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    """Query down-projection rank (the indexer reads the normed query latent too)."""
    kv_lora_rank: int
    """C: width of the cached KV latent."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    """R: 0 means NoPE (no rope channel at all: nothing rotated, nothing cached)."""
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    """Tokens each query attends to; shorter contexts attend densely (k_eff = min(k, t + 1))."""
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    """Width of the dense MLP of the first `first_k_dense_replace` layers."""
    first_k_dense_replace: int
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    extra: dict = field(default_factory=dict)
    """Unknown keys read from a config.json (kept, never interpreted)."""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived values
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5 (the naive head dim, not the absorbed C + R), no YaRN."""
        return self.qk_head_dim ** -0.5

    @property
    def is_nope(self) -> bool:
        return self.qk_rope_head_dim == 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                    "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "intermediate_size", "n_group", "topk_group", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("qk_rope_head_dim", "n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (rotate-half RoPE), got {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} exceeds index_head_dim="
                              f"{self.index_head_dim} (the indexer rotates its first qk_rope_head_dim dims)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"n_routed_experts={self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in the "
                              f"topk_group={self.topk_group} kept groups of n_group={self.n_group}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                              f"num_hidden_layers={self.num_hidden_layers}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0 or not self.routed_scaling_factor > 0:
            raise ConfigError("rms_norm_eps, rope_theta and routed_scaling_factor must be > 0, got "
                              f"{self.rms_norm_eps}, {self.rope_theta}, {self.routed_scaling_factor}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name}={value} is outside the vocabulary [0, vocab_size={self.vocab_size})")
        if self.torch_dtype not in DTYPE_NAMES:
            raise ConfigError(f"torch_dtype must be 'float32' or 'bfloat16', got {self.torch_dtype!r}")

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **out}

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "ModelConfig":
        """`data` may state its dtype as `dtype` or `torch_dtype` (see stated_dtype); `source`
        names it in errors."""
        dtype = stated_dtype(data, source)
        data = {k: v for k, v in data.items() if k != "dtype"}
        if dtype is not None:
            data["torch_dtype"] = dtype
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name in names and f.default is dataclasses.MISSING and f.name not in known)
        if missing:
            raise ConfigError(f"{source} is missing required fields: {', '.join(missing)}")
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()), source=str(path))
