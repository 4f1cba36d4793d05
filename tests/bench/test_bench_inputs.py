"""`zmrl bench` refuses bad arguments in one line, exit 2, before it builds or times anything and
without writing --out; a model whose weights cannot fit is refused instead of being killed for
memory partway through."""
import pytest
import torch

from zmrl.cli import main


def _bench(capsys, *argv):
    code = main(["bench", *argv])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


@pytest.mark.parametrize("argv, message", [
    (["kernels", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["kernels", "--only", "lin_ear"], "--only 'lin_ear' matches no op; the ops: linear, rms_norm"),
    (["kernels", "--out", "{tmp}/missing/table.md"], "missing is not a directory"),
    (["kernels", "--out", "{tmp}"], "is a directory"),
    (["vllm", "--presets", "tiny,huge"], "'huge' is not a preset vLLM can serve here; choose from small, tiny"),
    (["vllm", "--presets", "k31-layer"], "'k31-layer' is not a preset vLLM can serve here"),
    (["vllm", "--num-requests", "0"], "--num-requests must be >= 1, got 0"),
    (["throughput", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["vllm", "--out", "{tmp}/missing/table.md"], "missing is not a directory"),
    (["train", "--iters", "0"], "--warmup must be >= 0 and --iters >= 1, got 2, 0"),
    (["train", "--num-seqs", "1"], "need --num-seqs >= 2"),
    (["train", "--layers", "0"], "--layers must be >= 1, got 0"),
    (["train", "--systems", "on,fast"], "--systems must list some of baseline, on, off"),
])
def test_bad_arguments_exit_2_in_one_line_and_write_nothing(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = _bench(capsys, *argv)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert err[0].startswith(f"zmrl bench {argv[0]}: ") and out == ""
    assert list(tmp_path.iterdir()) == []


def test_weights_that_cannot_fit_are_refused_before_anything_is_built(capsys, monkeypatch):
    import zmrl.bench.train_throughput as bench

    monkeypatch.setattr(bench, "available_bytes", lambda device: 20 << 30)
    monkeypatch.setattr(bench, "zmrl_system", lambda *a, **k: pytest.fail("built a system"))
    code, out, err = _bench(capsys, "train", "--preset", "k31-layer", "--dtype", "float32")
    assert code == 2 and len(err) == 1, err
    assert "--preset k31-layer (1 layer(s), float32) needs 156.6 GiB for one copy of the weights" in err[0]
    assert " has 20.0 GiB " in err[0]


def test_the_weight_bytes_are_those_of_a_saved_checkpoint(model_dir, monkeypatch):
    """Counted from the config, checked against the tensors init-model wrote; the limit is exact."""
    from safetensors import safe_open

    import zmrl.bench.train_throughput as bench
    from zmrl.model.checkpoint import read_config
    from zmrl.bench import BenchInputError

    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        saved = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    cfg = read_config(model_dir)
    assert bench.weight_bytes(cfg, torch.float32) == saved
    assert bench.weight_bytes(cfg, torch.bfloat16) * 2 == saved
    cpu = torch.device("cpu")
    monkeypatch.setattr(bench, "available_bytes", lambda device: saved)
    bench.check_memory(cfg, torch.float32, cpu, "tiny")  # exactly enough
    monkeypatch.setattr(bench, "available_bytes", lambda device: saved - 1)
    with pytest.raises(BenchInputError, match="tiny .* needs"):
        bench.check_memory(cfg, torch.float32, cpu, "tiny")


def test_the_host_memory_is_read_from_meminfo():
    free = __import__("zmrl.bench.train_throughput", fromlist=["x"]).available_bytes(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < free <= total
