"""A checkpoint's dtype is one fact: config.json's `dtype` and `torch_dtype` (when both are set)
and the tensors in model.safetensors must all agree, else every host refuses it (the vLLM engine's
pre-start check, the transformers host, the reference engine and trainer all read it through
zmrl.model.checkpoint) with one line naming the file and both values. `zmrl init-model --dtype
bfloat16` writes a checkpoint that states it."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from zmrl.model.checkpoint import check_model_dir, load_checkpoint
from zmrl.model.config import ConfigError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir, **fields):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def _hosts(model_dir, weights: bool = False):
    """Every way a host loads a model dir, each a callable that raises on a bad one (weights: only
    those that read the tensors, which a config alone cannot refuse)."""
    import zmrl.model.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoConfig, AutoModelForCausalLM

    from zmrl.rollout.reference import ReferenceEngine
    from zmrl.rollout.vllm.engine import check_model_dir
    from zmrl.trainer.reference import ReferenceTrainer
    from zmrl.lora import LoraConfig

    hosts = {"load_checkpoint": lambda: load_checkpoint(model_dir),
             "vllm pre-start check": lambda: check_model_dir(model_dir),
             "reference engine": lambda: ReferenceEngine.from_dir(model_dir),
             "reference trainer": lambda: ReferenceTrainer.from_dir(model_dir, LoraConfig(r=2)),
             "transformers model": lambda: AutoModelForCausalLM.from_pretrained(model_dir)}
    if not weights:
        hosts["transformers config"] = lambda: AutoConfig.from_pretrained(model_dir)
    return hosts


def test_cli_init_model_bfloat16_states_its_dtype(tmp_path, tiny_dir):
    from zmrl.cli import main

    out = tmp_path / "m"
    assert main(["init-model", "--preset", "tiny", "--out", str(out), "--dtype", "bfloat16"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and "torch_dtype" not in cfg
    assert check_model_dir(out).torch_dtype == "bfloat16"
    weights = load_file(str(out / "model.safetensors"))
    fp32 = load_file(str(tiny_dir) + "/model.safetensors")  # the same seed's fp32 model
    assert weights.keys() == fp32.keys()
    for name, t in weights.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[name].bfloat16()), name


@pytest.mark.parametrize("stated", [{"dtype": "bfloat16", "torch_dtype": "bfloat16"},
                                    {"torch_dtype": "bfloat16"}])
def test_agreeing_dtype_fields_are_accepted_by_every_host(tiny_bf16_dir, tmp_path, stated):
    """The control for the refusal below: the same files, dtype stated consistently, load everywhere."""
    model = _copy(tiny_bf16_dir, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("dtype")
    (model / "config.json").write_text(json.dumps({**cfg, **stated}))
    for host, load in _hosts(model).items():
        load()  # raises on a refusal


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_disagreeing_dtype_and_torch_dtype_are_refused_by_every_host(tiny_bf16_dir, tiny_dir, tmp_path,
                                                                     dtype, torch_dtype):
    """The weights are in `dtype`'s format; only torch_dtype was changed (and the other way round)."""
    model = _copy(tiny_bf16_dir if dtype == "bfloat16" else tiny_dir, tmp_path / "m")
    _edit_config(model, dtype=dtype, torch_dtype=torch_dtype)
    for host, load in _hosts(model).items():
        with pytest.raises(ConfigError) as err:
            load()
        message = str(err.value)
        assert "\n" not in message, host
        assert str(model / "config.json") in message, (host, message)
        assert f"dtype={dtype!r}" in message and f"torch_dtype={torch_dtype!r}" in message, (host, message)


@pytest.mark.parametrize("stored, stated", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_weights_in_another_dtype_than_the_config_are_refused_by_every_host(tiny_dir, tiny_bf16_dir, tmp_path,
                                                                            stored, stated):
    """Weights cast and config left alone (or the config edited and the weights not)."""
    model = _copy(tiny_bf16_dir if stored == "bfloat16" else tiny_dir, tmp_path / "m")
    _edit_config(model, dtype=stated)
    for host, load in _hosts(model, weights=True).items():
        with pytest.raises(ValueError) as err:
            load()
        message = str(err.value)
        assert "\n" not in message and str(model) in message, (host, message)
        assert f"as {stored}" in message and f"dtype {stated!r}" in message, (host, message)


def test_one_tensor_in_another_dtype_is_named(tiny_dir, tmp_path):
    model = _copy(tiny_dir, tmp_path / "m")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"].bfloat16()
    save_file(weights, str(model / "model.safetensors"))
    for host, load in _hosts(model, weights=True).items():
        with pytest.raises(ValueError, match=r"stores 1 tensors as bfloat16 \(e.g. model.norm.weight\)"):
            load()


def test_saving_weights_in_another_dtype_is_refused(tiny_dir, tmp_path):
    from zmrl.model.checkpoint import save_weights

    cfg, weights = load_checkpoint(tiny_dir)
    with pytest.raises(ValueError, match="weights to save stores 79 tensors as bfloat16"):
        save_weights(cfg, {k: v.bfloat16() for k, v in weights.items()}, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
