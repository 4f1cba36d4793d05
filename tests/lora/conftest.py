"""Shared fixtures: one tiny checkpoint per session (made locally by init-model).

Torch runs on one thread here: on a shared 2-core machine, two OpenMP threads spin against
other processes and a 64-row GEMM takes 20 ms instead of 0.1 ms. (Bits do not depend on it.)
"""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from zmrl.commands.init_model import init_model

    return init_model("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    import zmrl.model.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = (a != b).nonzero()
    if not len(bad):
        return "equal"
    i = tuple(bad[0].tolist())
    return f"{len(bad)} elements differ; first at {i}: {a[i].item()!r} vs {b[i].item()!r}"
