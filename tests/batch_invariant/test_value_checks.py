"""Value checks: at once on CPU tensors and, by default, on GPU tensors; deferred on GPU tensors
when ZMRL_DEFER_VALUE_CHECKS=1 (a device-side flag raised at a later check or at
raise_failed_checks, without host syncs). The deferred mode is forced onto CPU
tensors here to test its bookkeeping; the `gpu` tests prove no op syncs (sync debug mode "error")."""
import importlib

import pytest
import torch

import zmrl.batch_invariant as bi

checks = importlib.import_module("zmrl.batch_invariant._checks")
sparse_mla_mod = importlib.import_module("zmrl.batch_invariant.sparse_mla")


@pytest.fixture
def deferred(monkeypatch):
    """Defer every value check, as for CUDA tensors (CPU flags have no asynchronous copy)."""
    monkeypatch.setattr(checks, "defers_checks", lambda t: True)
    monkeypatch.setattr(sparse_mla_mod, "defers_checks", lambda t: True)
    monkeypatch.setattr(checks, "_flags", {})
    yield
    checks.raise_failed_checks()  # nothing may stay pending for the next test


def test_cpu_checks_raise_at_once_with_values():
    bi.check_values(torch.tensor(True), "never shown")
    with pytest.raises(ValueError, match=r"^ids must be small, got 7$"):
        bi.check_values(torch.tensor(False), "ids must be small", lambda: "got 7")


def test_deferred_check_raises_later_with_its_message(deferred):
    bi.check_values(torch.tensor(True), "ok check")
    bi.check_values(torch.tensor(False), "the bad check")  # no raise here
    with pytest.raises(ValueError, match=r"^the bad check \(found on cpu\)$"):
        bi.raise_failed_checks()
    bi.raise_failed_checks()  # the flag was reset: a failure is reported once
    bi.check_values(torch.tensor(True), "the bad check")
    bi.raise_failed_checks()


def test_deferred_checks_report_every_failed_site(deferred):
    bi.check_values(torch.tensor(False), "first site")
    bi.check_values(torch.tensor(False), "second site")
    with pytest.raises(ValueError, match=r"first site .*1 other failed check.*second site"):
        bi.raise_failed_checks()


def test_sparse_mla_bad_index_deferred_is_harmless_then_raises(deferred):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 16, generator=g)
    kv = torch.randn(5, 16, generator=g)
    good = torch.tensor([[0, 1, -1], [2, 3, 4], [4, -1, -1]])
    bad = good.clone()
    bad[1, 2] = 9  # past the 5 cached tokens
    out_bad = bi.sparse_mla(q, None, kv, None, bad, 0.25)[0]  # runs: the bad slot is dropped
    with pytest.raises(ValueError, match="indices must be < 5: the cache holds 5 tokens"):
        bi.raise_failed_checks()
    dropped = good.clone()
    dropped[1, 2] = -1
    assert torch.equal(out_bad, bi.sparse_mla(q, None, kv, None, dropped, 0.25)[0])
    bi.sparse_mla(q, None, kv, None, good, 0.25)
    bi.raise_failed_checks()


def test_negative_control_the_same_bad_index_raises_at_once_without_deferral():
    q, kv = torch.randn(3, 2, 16), torch.randn(5, 16)
    with pytest.raises(ValueError, match="indices must be < 5: the cache holds 5 tokens, got 9"):
        bi.sparse_mla(q, None, kv, None, torch.tensor([[0, 1, 9]] * 3), 0.25)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_checks_raise_at_once_by_default():
    q, kv = torch.randn(3, 2, 16, device="cuda"), torch.randn(5, 16, device="cuda")
    assert not checks.DEFERRED
    with pytest.raises(ValueError, match="indices must be < 5: the cache holds 5 tokens"):
        bi.sparse_mla(q, None, kv, None, torch.tensor([[0, 1, 9]] * 3, device="cuda"), 0.25)


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="the opt-in deferred mode reported a failed index check after valid "
                                       "inputs only (H200, 2026-12-01; not yet explained): why deferral is off")
def test_gpu_checks_do_not_sync_and_bad_input_still_raises(monkeypatch):
    monkeypatch.setattr(checks, "DEFERRED", True)
    from zmrl.model.attention import rope_cos_sin
    from zmrl.model.config import ModelConfig
    from zmrl.model.layers import embed
    from zmrl.model.presets import PRESETS

    dev = "cuda"
    cfg = ModelConfig(**PRESETS["tiny"])
    pos = torch.arange(4, device=dev)
    table = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, 8, device=dev)}
    scores = torch.randn(4, 64, device=dev)
    q, kv = torch.randn(3, 2, 16, device=dev), torch.randn(5, 16, device=dev)
    good_idx = torch.tensor([[0, 1, 4]] * 3, device=dev)
    bad_idx = torch.tensor([[0, 1, 9]] * 3, device=dev)
    for _ in range(2):  # warm-up rounds on good input: compile kernels, upload the rope table
        rope_cos_sin(cfg, pos)
        embed(table, pos)
        bi.topk(scores, 8)
        bi.sparse_mla(q, None, kv, None, good_idx, 0.25)
    torch.cuda.synchronize()
    bi.raise_failed_checks()  # nothing failed so far
    torch.cuda.set_sync_debug_mode("error")  # from here any host sync raises
    try:
        rope_cos_sin(cfg, pos)
        embed(table, pos)
        bi.topk(scores, 8)
        bi.sparse_mla(q, None, kv, None, bad_idx, 0.25)  # bad input: deferred, no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="indices must be < 5: the cache holds 5 tokens"):
        bi.raise_failed_checks()
    bi.raise_failed_checks()


@pytest.mark.gpu
def test_gpu_negative_control_the_sync_detector_sees_a_host_read():
    t = torch.arange(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            int(t.max())
    finally:
        torch.cuda.set_sync_debug_mode("default")
