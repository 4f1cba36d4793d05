"""run.device / the engines' device argument: one resolution, clear errors."""
import pytest
import torch

from zmrl.model.device import resolve_device


def test_auto_is_cuda_when_present_else_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device(None).type == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "", "cuda:x"])
def test_unknown_device_names_the_choices(name):
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the property is about a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_device("cuda")


@pytest.mark.gpu
def test_cuda_index_past_the_visible_gpus_is_refused():
    with pytest.raises(ValueError, match="CUDA GPU"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
