"""Bad inputs get errors naming the problem; init-model output loads; import zmrl stays light."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from zmrl.model.config import ConfigError, ModelConfig
from zmrl.model.presets import PRESETS


def _tiny(**over):
    return ModelConfig(**{**PRESETS["tiny"], **over})


@pytest.mark.parametrize("over, fields", [
    ({"qk_rope_head_dim": 48}, "qk_rope_head_dim.*index_head_dim"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok.*n_routed_experts"),
    ({"n_group": 3}, "n_group.*n_routed_experts"),
    ({"first_k_dense_replace": 5}, "first_k_dense_replace.*num_hidden_layers"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"eos_token_id": 512}, "eos_token_id.*vocab_size"),
])
def test_inconsistent_config_names_the_fields(over, fields):
    with pytest.raises(ConfigError, match=fields):
        _tiny(**over)


def test_config_missing_field_is_named():
    d = dict(PRESETS["tiny"])
    del d["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing required fields: kv_lora_rank"):
        ModelConfig.from_dict(d)


def test_init_model_output_loads_in_transformers(tiny_dir, tiny_model):
    from transformers import AutoConfig, AutoTokenizer

    from zmrl.model.checkpoint import load_checkpoint

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert cfg.model_type == "zmrl" and len(tok) == cfg.vocab_size == tiny_model.zcfg.vocab_size
    assert tok.eos_token_id == cfg.eos_token_id and tok.pad_token_id == cfg.pad_token_id
    assert tok.decode(tok("12 + 34 = 46")["input_ids"]) == "12 + 34 = 46"
    zcfg, weights = load_checkpoint(tiny_dir)
    assert zcfg == tiny_model.zcfg
    assert torch.equal(weights["model.embed_tokens.weight"], tiny_model.model.embed_tokens.weight)


def test_cli_init_model_k31_layer_writes_config_only(tmp_path):
    from zmrl.cli import main

    assert main(["init-model", "--preset", "k31-layer", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["n_routed_experts"], cfg["index_topk"],
            cfg["qk_rope_head_dim"]) == (7168, 96, 896, 2048, 0)


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_init_model_refuses_a_directory_of_other_files_even_with_force(tmp_path):
    from zmrl.model.factory import init_model

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("[run]\n")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    before = _files(tmp_path)
    for force in (False, True):
        with pytest.raises(FileExistsError, match=r"run is not empty and holds no model \(config.toml, metrics.jsonl\)"):
            init_model("k31-layer", str(run_dir), force=force)
    assert _files(tmp_path) == before
    (run_dir / "config.toml").unlink()  # control: the same call into an empty directory writes the model
    (run_dir / "metrics.jsonl").unlink()
    init_model("k31-layer", str(run_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and (run_dir / "config.json").is_file()


def test_an_interrupted_forced_init_model_leaves_the_old_model(tiny_dir, tmp_path, monkeypatch):
    import zmrl.model.factory as factory

    out = _copy(tiny_dir, tmp_path)
    before = _files(out)

    def fails(*args, **kwargs):  # after the weights are written, before the config
        raise OSError("disk full")

    monkeypatch.setattr(factory, "write_config", fails)
    with pytest.raises(OSError, match="disk full"):
        factory.init_model("tiny", str(out), seed=1, force=True)
    assert _files(out) == before, "the old model is untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "the failed call's temp dir is removed"
    monkeypatch.undo()
    factory.init_model("tiny", str(out), seed=1, force=True)
    after = _files(out)
    assert after.keys() == before.keys() and after["model.safetensors"] != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_new_model_dir_gets_the_mode_mkdir_would_give(tmp_path):
    from zmrl.model.factory import init_model

    (tmp_path / "plain").mkdir()
    init_model("k31-layer", str(tmp_path / "model"))
    assert (tmp_path / "model").stat().st_mode == (tmp_path / "plain").stat().st_mode


def _copy(tiny_dir, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, out)
    return out


def test_checkpoint_with_missing_or_extra_tensors_is_rejected(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from zmrl.model.checkpoint import load_checkpoint

    out = _copy(tiny_dir, tmp_path)
    w = load_file(str(out / "model.safetensors"))
    del w["model.layers.2.mlp.experts.down_proj"]
    w["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors: model.layers.2.mlp.experts.down_proj.*"
                                         "unexpected tensors: model.layers.0.extra.weight"):
        load_checkpoint(out)
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts.down_proj"):
        AutoModelForCausalLM.from_pretrained(out)


def test_tokenizer_size_mismatch_is_rejected(tiny_dir, tmp_path):
    from zmrl.model.checkpoint import load_checkpoint

    out = _copy(tiny_dir, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] += 16
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tokenizer .* has 512 tokens but config vocab_size is 528"):
        load_checkpoint(out)


def test_bad_forward_inputs(tiny_model):
    with pytest.raises(ValueError, match="token ids must lie in"):
        tiny_model(torch.tensor([[5, 9999]]))
    with pytest.raises(ValueError, match="input_ids must be"):
        tiny_model(torch.tensor([5, 6]))


def test_import_zmrl_is_light_and_registers_lazily():
    code = ("import sys, zmrl; assert 'torch' not in sys.modules and 'transformers' not in sys.modules;"
            "import transformers; from transformers import AutoConfig;"
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING;"
            "assert 'zmrl' in CONFIG_MAPPING, 'not registered'")
    subprocess.run([sys.executable, "-c", code], check=True)
