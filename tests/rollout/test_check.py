"""`zmrl check`: rollout vs trainer log-probs bit for bit, on the session's vLLM engine.

The function API (`check(..., engine=...)`) runs on the shared engine; the CLI is exercised
only on bad inputs, which exit 2 before any engine would start.
"""
import json

import pytest

from zmrl.cli import main
from zmrl.commands.check import check

pytestmark = pytest.mark.vllm

PROMPTS = ["What is 12 + 30? The answer is", "Compute 7 * 8 = 56. Therefore 56 - 6 equals",
           "Question: 999 - 1? Let x be"]


def test_check_passes_bitwise_with_invariance_on(engine, model_dir):
    report = check(model_dir, PROMPTS, engine=engine, n=2, max_tokens=8, temperature=0.9, seed=0)
    assert report["total_tokens"] > 0
    assert (report["differing_tokens"], report["max_abs_diff"], report["kl_k1"]) == (0, 0.0, 0.0)


def test_check_reports_differences_with_invariance_off(engine, model_dir):
    """The negative control: default kernels on both sides differ (decode rows vs prefill rows),
    and the engine is back in invariant mode afterwards."""
    report = check(model_dir, PROMPTS, engine=engine, n=2, max_tokens=8, temperature=0.9, seed=0,
                   batch_invariant=False)
    assert report["batch_invariant"] == "off"
    assert report["differing_tokens"] > 0 and report["max_abs_diff"] > 0
    assert engine.config.batch_invariant is True
    again = check(model_dir, PROMPTS[:1], engine=engine, n=1, max_tokens=4, seed=1)
    assert again["differing_tokens"] == 0


def test_check_reference_rollout_on_and_off(model_dir):
    on = check(model_dir, PROMPTS[:2], rollout="reference", n=1, max_tokens=6, seed=0)
    off = check(model_dir, PROMPTS[:2], rollout="reference", n=1, max_tokens=6, seed=0, batch_invariant=False)
    assert on["differing_tokens"] == 0
    assert off["differing_tokens"] > 0


def _cli(tmp_path, capsys, model, lines, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(lines)
    code = main(["check", "--model", str(model), "--prompts", str(prompts), "--rollout", "reference", *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("lines, message", [
    ("", "no prompts"),
    ("\n\n", "no prompts"),
    ('{"prompt": "a"}\nnot json\n', "prompts.jsonl:2: not JSON"),
    ('{"text": "a"}\n', 'non-empty "prompt" string'),
    ('{"prompt": ""}\n', 'non-empty "prompt" string'),
    ('["a"]\n', 'non-empty "prompt" string'),
])
def test_cli_bad_prompts_file_exits_2(tmp_path, capsys, model_dir, lines, message):
    code, err = _cli(tmp_path, capsys, model_dir, lines)
    assert code == 2 and message in err, err


def test_cli_prompt_past_the_models_positions_exits_2(tmp_path, capsys, model_dir):
    """Refused before any engine starts, naming the prompt; vLLM would refuse it mid-run."""
    from zmrl.model.checkpoint import read_config

    limit = read_config(model_dir).max_position_embeddings
    lines = '{"prompt": "a"}\n' + json.dumps({"prompt": "a b " * limit}) + "\n"
    code, err = _cli(tmp_path, capsys, model_dir, lines, "--max-tokens", "2")
    assert code == 2 and "prompt 2 is " in err and f"max_position_embeddings ({limit})" in err, err
    code, err = _cli(tmp_path, capsys, model_dir, '{"prompt": "a"}\n', "--max-tokens", str(limit))
    assert code == 2 and "prompt 1 is 1 tokens; with --max-tokens" in err, err


def test_cli_error_mid_check_exits_3_not_the_mismatch_code(tmp_path, capsys, model_dir, monkeypatch):
    import zmrl.commands.check as check_command

    def engine_dies(*args, **kwargs):
        raise RuntimeError("the engine died")

    monkeypatch.setattr(check_command, "check", engine_dies)
    code, err = _cli(tmp_path, capsys, model_dir, '{"prompt": "a"}\n')
    assert code == 3 and "RuntimeError: the engine died" in err and "nothing was compared" in err, err


def test_cli_says_each_phase_on_stderr(tmp_path, capsys, model_dir):
    code, err = _cli(tmp_path, capsys, model_dir, '{"prompt": "1+2"}\n', "--n", "1", "--max-tokens", "2")
    assert code == 0, err
    assert "zmrl check: sampling 1 prompt(s) x 1 with reference (TP 1)" in err
    assert "zmrl check: scoring 1 sequence(s) with reference (TP 1)" in err and err.count("zmrl check: done in") == 2


def test_cli_bad_n_exits_2(tmp_path, capsys, model_dir):
    code, err = _cli(tmp_path, capsys, model_dir, '{"prompt": "a"}\n', "--n", "0")
    assert code == 2 and "--n must be >= 1" in err


@pytest.mark.parametrize("extra, message", [
    (["--rollout-tp", "3"], "--rollout-tp=3 must divide 8"),
    # the tiny model has 4 attention heads: 4 canonical leaves, which 8 ranks cannot split
    (["--trainer-tp", "8"], "--trainer-tp=8 must divide the canonical leaves (gcd(8, n)) of every split dimension; "
                            "it does not divide those of num_attention_heads=4 (4 leaves)"),
    (["--rollout-tp", "2"], "--rollout-tp > 1 needs --rollout vllm"),
    (["--trainer-tp", "2"], "--trainer-tp > 1 needs --trainer megatron"),
])
def test_cli_bad_tp_sizes_exit_2(tmp_path, capsys, model_dir, extra, message):
    """Refused in one line before any engine or trainer rank starts (--rollout reference here)."""
    code, err = _cli(tmp_path, capsys, model_dir, '{"prompt": "a"}\n', *extra)
    assert code == 2 and message in err, err


def test_cli_model_without_tokenizer_exits_2(tmp_path, capsys, model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((model_dir_path(model_dir) / f).read_bytes())
    code, err = _cli(tmp_path, capsys, bare, '{"prompt": "a"}\n')
    assert code == 2 and "no tokenizer.json" in err


def test_cli_mismatched_config_exits_2(tmp_path, capsys, model_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir_path(model_dir).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 256  # the safetensors still hold 128-wide tensors
    (bad / "config.json").write_text(json.dumps(cfg))
    code, err = _cli(tmp_path, capsys, bad, '{"prompt": "a"}\n')
    assert code == 2 and "does not match the config" in err and "wrong shapes" in err


def test_cli_adapter_that_does_not_fit_exits_2(tmp_path, capsys, model_dir):
    from zmrl.lora import LoraAdapter, LoraConfig, save_peft
    from zmrl.model.checkpoint import read_config

    cfg = read_config(model_dir)
    other = type(cfg)(**{**cfg.to_dict(), "kv_lora_rank": 32})  # another model's adapter
    save_peft(LoraAdapter(other, LoraConfig(r=4, lora_alpha=8.0)), tmp_path / "adapter")
    code, err = _cli(tmp_path, capsys, model_dir, '{"prompt": "a"}\n', "--adapter", str(tmp_path / "adapter"))
    assert code == 2 and "does not fit this model" in err, err


def model_dir_path(model_dir):
    from pathlib import Path

    return Path(model_dir)
