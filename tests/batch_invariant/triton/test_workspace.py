"""The split-K workspace kept per (device, stream, thread), and the environment reader of the
launch plans' keys. No GPU needed: the buffers are CPU tensors here; `_may_keep` stands for "a
CUDA call outside a graph capture"."""
import importlib
import threading

import pytest
import torch

workspace = importlib.import_module("zmrl.batch_invariant.triton._workspace")
common = importlib.import_module("zmrl.batch_invariant.triton._common")

CPU = torch.device("cpu")


@pytest.fixture
def kept(monkeypatch):
    workspace.release()
    monkeypatch.setattr(workspace, "_may_keep", lambda device: True)
    yield
    workspace.release()


def test_one_stream_and_thread_reuse_one_buffer(kept):
    first = workspace.workspace(100, CPU, 0, stream=7)
    assert first.dtype == torch.float32 and first.numel() >= 100
    assert workspace.workspace(60, CPU, 0, stream=7) is first  # a smaller call fits the kept buffer


def test_a_larger_call_replaces_the_buffer(kept):
    small = workspace.workspace(100, CPU, 0, stream=7)
    large = workspace.workspace(1000, CPU, 0, stream=7)
    assert large is not small and large.numel() >= 1000
    assert workspace.workspace(100, CPU, 0, stream=7) is large


def test_another_stream_device_or_thread_gets_its_own_buffer(kept):
    mine = workspace.workspace(100, CPU, 0, stream=7)
    assert workspace.workspace(100, CPU, 0, stream=8) is not mine
    assert workspace.workspace(100, CPU, 1, stream=7) is not mine
    other = []
    t = threading.Thread(target=lambda: other.append(workspace.workspace(100, CPU, 0, stream=7)))
    t.start()
    t.join()
    assert other[0] is not mine
    assert workspace.workspace(100, CPU, 0, stream=7) is mine


def test_nothing_is_kept_during_a_capture_or_past_the_size_limit(monkeypatch, kept):
    big = workspace.KEEP_MAX_BYTES // 4 + 1
    a, b = workspace.workspace(big, CPU, 0, stream=7), workspace.workspace(big, CPU, 0, stream=7)
    assert a is not b and not workspace._KEPT
    monkeypatch.setattr(workspace, "_may_keep", lambda device: False)
    a, b = workspace.workspace(100, CPU, 0, stream=7), workspace.workspace(100, CPU, 0, stream=7)
    assert a is not b and not workspace._KEPT


def test_a_cpu_tensor_call_keeps_nothing():
    workspace.release()
    workspace.workspace(100, CPU, 0, stream=7)
    assert not workspace._KEPT


def test_the_env_reader_follows_the_variable(monkeypatch):
    monkeypatch.delenv("ZMRL_TEST_SWITCH", raising=False)
    read = common.env_reader("ZMRL_TEST_SWITCH")
    other = common.env_reader("ZMRL_TEST_OTHER")
    assert read() is None
    monkeypatch.setenv("ZMRL_TEST_SWITCH", "off")
    off = read()
    assert off is not None
    monkeypatch.setenv("ZMRL_TEST_SWITCH", "auto")
    assert read() not in (None, off)
    monkeypatch.setenv("ZMRL_TEST_SWITCH", "off")
    assert read() == off
    assert other() is None  # control: another name's reader does not see this one
    monkeypatch.delenv("ZMRL_TEST_SWITCH")
    assert read() is None


def test_the_number_of_kept_buffers_is_bounded(monkeypatch, kept):
    monkeypatch.setattr(workspace, "KEEP_MAX_BUFFERS", 3)
    bufs = [workspace.workspace(10, CPU, 0, stream=s) for s in range(3)]
    assert len(workspace._KEPT) == 3
    assert workspace.workspace(10, CPU, 0, stream=1) is bufs[1]  # a known key is served, nothing dropped
    workspace.workspace(10, CPU, 0, stream=3)  # a fourth key: the kept ones are dropped first
    assert len(workspace._KEPT) == 1
