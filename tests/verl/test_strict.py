"""The strict check (zmrl.verl.strict.compare) on verl's nested response tensors: equal log-probs
give mismatch metrics of exactly 0 and no stop; one bit of difference in one sampled token stops
the run naming that token, while a difference under a masked-out position (a tool or padding
token, no log-prob) does not count. And the settings under which the check means nothing are
refused by name."""
import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.verl


def _nested(rows, dtype):
    return torch.nested.as_nested_tensor([torch.as_tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(0)
    lens = [3, 5, 4]
    values = [-torch.rand(n, generator=gen) * 5 for n in lens]
    masks = [[1, 1, 1], [1, 0, 1, 1, 1], [1, 1, 1, 1]]
    tokens = [[7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18]]
    return values, _nested(masks, torch.int64), _nested(tokens, torch.int64)


def test_equal_log_probs_give_zero_mismatch_and_no_stop(batch):
    from zmrl.verl.strict import METRIC_KEYS, compare

    values, mask, tokens = batch
    metrics, message = compare(_nested(values, torch.float32), _nested([v.clone() for v in values], torch.float32),
                               mask, tokens, step=1)
    assert message is None
    assert set(metrics) == set(METRIC_KEYS)
    assert metrics == {"mismatch/logprob_abs_diff_max": 0.0, "mismatch/tokens_different": 0, "mismatch/kl": 0.0}


def test_one_bit_in_one_token_stops_naming_it(batch):
    from zmrl.verl.strict import compare

    values, mask, tokens = batch
    trainer = [v.clone() for v in values]
    trainer[1][3] = torch.nextafter(trainer[1][3], torch.tensor(0.0))  # one ulp
    metrics, message = compare(_nested(values, torch.float32), _nested(trainer, torch.float32), mask, tokens,
                               step=7, keys=["a", "b", "c"], decode=lambda ids: f"<{ids[0]}>")
    assert metrics["mismatch/tokens_different"] == 1
    assert 0 < metrics["mismatch/logprob_abs_diff_max"] < 1e-5
    want = (f"first at sample 1 (key b), response position 3 (token id 13 '<13>'): rollout {float(values[1][3])!r} "
            f"vs trainer {float(trainer[1][3])!r}")
    assert message.startswith("step 7: ") and want in message, message


def test_a_difference_under_a_masked_position_is_not_a_mismatch(batch):
    from zmrl.verl.strict import compare

    values, mask, tokens = batch
    trainer = [v.clone() for v in values]
    trainer[1][1] += 1.0  # response_mask is 0 there
    metrics, message = compare(_nested(values, torch.float32), _nested(trainer, torch.float32), mask, tokens, step=1)
    assert message is None and metrics["mismatch/tokens_different"] == 0


def _config(**changes):
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"calculate_log_probs": True, "full_determinism": False}},
                            "algorithm": {"rollout_correction": {"bypass_mode": False}}})
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("key, value, named", [
    ("algorithm.rollout_correction.bypass_mode", True, "bypass_mode"),
    ("actor_rollout_ref.rollout.calculate_log_probs", False, "calculate_log_probs"),
    ("actor_rollout_ref.rollout.full_determinism", True, "full_determinism"),
])
def test_settings_that_would_void_the_check_are_refused(key, value, named):
    from zmrl.verl.strict import StrictConfigError, check_strict_config

    check_strict_config(_config())
    with pytest.raises(StrictConfigError, match=named):
        check_strict_config(_config(**{key: value}))
