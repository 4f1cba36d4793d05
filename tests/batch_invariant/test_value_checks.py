"""Value checks: at once on CPU tensors; deferred on GPU tensors by default (the failing call's
serial in a device-side slot, raised at a later check or at raise_failed_checks, without host
syncs), at once there too when ZMRL_DEFER_VALUE_CHECKS=0. The deferred mode is forced onto CPU
tensors here to test its bookkeeping, with a stand-in for the asynchronous copy whose arrival
the test decides; the `gpu` tests prove no op syncs (sync debug mode "error")."""
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
    monkeypatch.setattr(checks, "_states", {})
    yield
    checks.raise_failed_checks()  # nothing may stay pending for the next test


def test_cpu_checks_raise_at_once_with_values():
    bi.fail_if(torch.tensor(False), "never shown")
    with pytest.raises(ValueError, match=r"^ids must be small, got 7$"):
        bi.fail_if(torch.tensor(True), "ids must be small", lambda: "got 7")


def test_deferred_check_raises_later_with_its_message(deferred):
    bi.fail_if(torch.tensor(False), "ok check")
    bi.fail_if(torch.tensor(True), "the bad check")  # no raise here
    with pytest.raises(ValueError, match=r"^the bad check \(found on cpu\)$"):
        bi.raise_failed_checks()
    bi.raise_failed_checks()  # the flag was reset: a failure is reported once
    bi.fail_if(torch.tensor(False), "the bad check")
    bi.raise_failed_checks()


def test_deferred_checks_report_every_failed_site(deferred):
    bi.fail_if(torch.tensor(True), "first site")
    bi.fail_if(torch.tensor(True), "second site")
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


class _LateCopies(checks._DeviceChecks):
    """CPU slots mirrored as on a GPU, by copies that arrive when the test says so."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.mirrored, self.in_flight, self.arrived = True, None, False

    def _queue_copy(self):
        self.in_flight, self.arrived = self.failed.tolist(), False

    def _copy_arrived(self):
        return self.arrived

    def _copied(self):
        return self.in_flight


@pytest.fixture
def late_copies(deferred):
    state = checks._states[torch.device("cpu")] = _LateCopies()
    return state


def test_a_check_raises_at_the_first_later_check_that_sees_its_copy(late_copies):
    bi.fail_if(torch.tensor(True), "the bad check")  # queues a copy showing the failure
    bi.fail_if(torch.tensor(False), "a good check")  # the copy is still in flight: no raise, no wait
    late_copies.arrived = True
    with pytest.raises(ValueError, match=r"^the bad check \(found on cpu\)$"):
        bi.fail_if(torch.tensor(False), "a good check")
    late_copies.arrived = True
    bi.fail_if(torch.tensor(False), "a good check")  # reported once


def test_a_copy_landing_after_the_report_raises_nothing_more(late_copies):
    bi.fail_if(torch.tensor(True), "the bad check")  # the copy in flight shows it
    with pytest.raises(ValueError, match="the bad check"):
        bi.raise_failed_checks()
    stale = late_copies.in_flight
    late_copies.arrived = True
    bi.fail_if(torch.tensor(False), "a good check")  # the copy taken before the report lands now
    assert stale == late_copies.failed.tolist() and stale[0] != [0] * len(stale[0])  # it did show the failure
    late_copies.arrived = True
    bi.fail_if(torch.tensor(False), "a good check")
    bi.raise_failed_checks()


def test_negative_control_a_new_failure_after_the_report_does_raise(late_copies):
    bi.fail_if(torch.tensor(True), "the bad check")
    with pytest.raises(ValueError, match="the bad check"):
        bi.raise_failed_checks()
    bi.fail_if(torch.tensor(True), "the bad check")  # the same check fails again
    with pytest.raises(ValueError, match="the bad check"):
        bi.raise_failed_checks()


class _CountedCopies(_LateCopies):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def _queue_copy(self):
        super()._queue_copy()
        self.copies += 1
        self.arrived = True  # lands at once: only the interval holds a new copy back


@pytest.mark.parametrize("interval, copies", [(60.0, 1), (0.0, 5)])
def test_checks_in_quick_succession_share_one_copy(deferred, monkeypatch, interval, copies):
    """interval 0 is the negative control: a copy per check."""
    state = checks._states[torch.device("cpu")] = _CountedCopies()
    monkeypatch.setattr(checks, "COPY_INTERVAL_S", interval)
    for _ in range(5):
        bi.fail_if(torch.tensor(False), "a good check")
    assert state.copies == copies
    bi.fail_if(torch.tensor(True), "the bad check")  # no copy queued after it with the interval
    with pytest.raises(ValueError, match="the bad check"):
        bi.raise_failed_checks()  # the step's sync reports it all the same


def _sized_check(ok: bool, n: int):
    bi.fail_if(torch.tensor(not ok), f"indices must be < {n}")


def test_the_report_names_the_failing_call_not_the_latest(deferred):
    _sized_check(False, 5)
    _sized_check(True, 4096)  # the same check, later, with other sizes
    with pytest.raises(ValueError, match=r"^indices must be < 5 \(found on cpu\)$"):
        bi.raise_failed_checks()


def test_negative_control_the_latest_call_is_named_when_it_is_the_failing_one(deferred):
    _sized_check(True, 5)
    _sized_check(False, 4096)
    with pytest.raises(ValueError, match=r"^indices must be < 4096 \(found on cpu\)$"):
        bi.raise_failed_checks()


def test_checks_whose_messages_differ_only_by_digits_keep_their_own_slots(deferred):
    bi.fail_if(torch.tensor(True), "a must be < 5")
    bi.fail_if(torch.tensor(True), "a must be < 7")  # another check (another line), same words
    with pytest.raises(ValueError, match=r"a must be < 5 .*1 other failed check.*a must be < 7"):
        bi.raise_failed_checks()


def test_checks_first_run_in_inference_mode_still_work_outside_it(deferred):
    with torch.inference_mode():
        bi.fail_if(torch.tensor(False), "made in inference mode")
    bi.fail_if(torch.tensor(True), "outside")  # updates the slots inference mode created
    with pytest.raises(ValueError, match="^outside"):
        bi.raise_failed_checks()


def test_every_failing_replay_of_a_captured_check_is_reported(deferred):
    state = checks._states[torch.device("cpu")] = checks._DeviceChecks(torch.device("cpu"))
    for _ in range(2):  # a replayed graph repeats its captured call: only a count tells them apart
        state.record(0, torch.tensor(True), "captured check", capturing=True)  # bad
        with pytest.raises(ValueError, match=r"captured check \(in a CUDA graph replay\)"):
            bi.raise_failed_checks()
    state.record(0, torch.tensor(False), "captured check", capturing=True)  # good
    bi.raise_failed_checks()


def test_the_switch_takes_only_0_or_1(monkeypatch):
    monkeypatch.setenv("ZMRL_DEFER_VALUE_CHECKS", "yes")
    with pytest.raises(ValueError, match="ZMRL_DEFER_VALUE_CHECKS='yes' must be 1 .* or 0"):
        checks._defer_from_env()
    monkeypatch.setenv("ZMRL_DEFER_VALUE_CHECKS", "0")
    assert checks._defer_from_env() is False


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_checks_raise_at_once_when_deferral_is_off(monkeypatch):
    monkeypatch.setattr(checks, "DEFERRED", False)
    q, kv = torch.randn(3, 2, 16, device="cuda"), torch.randn(5, 16, device="cuda")
    with pytest.raises(ValueError, match="indices must be < 5: the cache holds 5 tokens, got 9"):
        bi.sparse_mla(q, None, kv, None, torch.tensor([[0, 1, 9]] * 3, device="cuda"), 0.25)


@pytest.mark.gpu
def test_gpu_checks_do_not_sync_and_bad_input_still_raises():
    assert checks.DEFERRED  # the default
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
    torch.cuda.set_sync_debug_mode("error")  # from here any host sync raises (a RuntimeError)
    raised = None
    try:
        rope_cos_sin(cfg, pos)
        embed(table, pos)
        bi.topk(scores, 8)
        bi.sparse_mla(q, None, kv, None, bad_idx, 0.25)  # bad input: deferred, no sync
    except ValueError as e:  # sparse_mla's next check found the flags' copy already arrived
        raised = e
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if raised is None:
        with pytest.raises(ValueError) as info:
            bi.raise_failed_checks()
        raised = info.value
    assert str(raised).startswith("indices must be < 5: the cache holds 5 tokens (found on cuda"), str(raised)
    bi.raise_failed_checks()  # reported once


@pytest.mark.gpu
def test_gpu_negative_control_the_sync_detector_sees_a_host_read():
    t = torch.arange(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            int(t.max())
    finally:
        torch.cuda.set_sync_debug_mode("default")
