import importlib

import pytest
import torch

import zmrl.batch_invariant as bi
from tests.batch_invariant.invariance import assert_bitwise

INF = float("inf")


def _both_paths(scores, k):
    out = {}
    for path in ("cpu", "reference"):
        with bi.use_path(path):
            out[path] = bi.topk(scores, k)
    assert_bitwise(out["cpu"], out["reference"], "cpu vs reference")
    return out["cpu"]


def _by_sorting(scores, k):
    """Independent oracle: Python's sort on (-value, index) pairs."""
    rows = []
    for row in scores.tolist():
        keyed = sorted((-(v + 0.0), i) for i, v in enumerate(row) if v != -INF)
        chosen = sorted(i for _, i in keyed[:k])
        rows.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(rows, dtype=torch.int64)


def test_exact_ties_keep_the_lowest_indices():
    s = torch.tensor([[1.0, 5.0, 5.0, 5.0, 2.0, 5.0]])
    assert _both_paths(s, 3).tolist() == [[1, 2, 3]]
    assert _both_paths(s, 5).tolist() == [[1, 2, 3, 4, 5]]


def test_all_equal_rows():
    s = torch.full((3, 50), 0.25)
    assert _both_paths(s, 7).tolist() == [list(range(7))] * 3


def test_negative_zero_equals_positive_zero():
    s = torch.tensor([[-0.0, 0.0, -0.0, -1.0], [0.0, -0.0, 0.0, -1.0]])
    assert _both_paths(s, 2).tolist() == [[0, 1], [0, 1]]


def test_k_larger_than_valid_length_pads_with_minus_one():
    s = torch.tensor([[3.0, -INF, 1.0, -INF], [-INF, -INF, -INF, -INF]])
    assert _both_paths(s, 3).tolist() == [[0, 2, -1], [-1, -1, -1]]
    assert _both_paths(s, 10).tolist() == [[0, 2] + [-1] * 8, [-1] * 10]


def test_matches_sorting_oracle_on_random_rows_with_many_ties():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(-4, 5, (40, 300), generator=g).float() / 4  # heavy ties, zeros of both signs
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    s[:, 250:] = -INF
    for k in (1, 5, 64, 250, 299, 400):
        assert_bitwise(_both_paths(s, k), _by_sorting(s, k), f"k={k}")


@pytest.mark.parametrize("cols", [8, 300, 1500])
def test_the_sort_and_the_threshold_give_the_same_indices(cols):
    # the CPU path sorts rows up to SORT_MAX_COLS wide and thresholds wider ones: both are exact
    topk_module = importlib.import_module("zmrl.batch_invariant.topk")  # the package re-exports the function

    g = torch.Generator().manual_seed(cols)
    s = torch.randint(-4, 5, (30, cols), generator=g).float() / 4  # heavy ties, zeros of both signs
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    s[:, cols * 5 // 6:] = -INF
    s[3] = -INF
    for k in (1, 7, cols - 1, cols + 3):
        want = _by_sorting(s, k)
        assert_bitwise(topk_module._topk_sorted(s, k), want, f"sort, k={k}")
        assert_bitwise(topk_module._topk_threshold(s, k), want, f"threshold, k={k}")


def test_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(130, 500, generator=g).bfloat16().float()  # bf16-rounded: many ties
    full = bi.topk(s, 37)
    for i in range(0, 130, 13):
        assert_bitwise(bi.topk(s[i:i + 1], 37), full[i:i + 1], f"row {i}")


def test_negative_control_torch_topk_picks_an_arbitrary_tied_set():
    # torch.topk keeps *some* 10 of 100 tied zeros (here not even the first 10 as a set),
    # so a selection built on it depends on the kernel, not on a rule.
    s = torch.zeros(1, 100)
    assert sorted(torch.topk(s, 10).indices[0].tolist()) != list(range(10))
    assert bi.topk(s, 10)[0].tolist() == list(range(10))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="NaN.*row 1, column 2"):
        bi.topk(torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, float("nan")]]), 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        bi.topk(torch.zeros(2, 3), 0)
    with pytest.raises(TypeError, match="k must be an int"):
        bi.topk(torch.zeros(2, 3), 2.0)
    with pytest.raises(ValueError, match="scores must be 2-D"):
        bi.topk(torch.zeros(3), 1)
