"""The router's selection in one launch (zmrl.batch_invariant.triton.route_select) gives the ids of
the composed selection (moe.route_select_composed: torch.topk for the group scores, the canonical
top-k of groups and of experts), compiled on a GPU and under the interpreter here: plain and
group-limited routers, heavy ties, signed zeros, -inf scores, non-power-of-two widths. moe_route on
the Triton path takes it. Negative control: the same scores without the group limit select other
experts, so the group rule is exercised."""
import pytest
import torch

import zmrl.batch_invariant.triton as tri
from zmrl.batch_invariant import moe_route, use_path
from zmrl.batch_invariant.moe import route_select_composed

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (E, top_k, n_group, topk_group)
ROUTERS = [(64, 6, 4, 2), (64, 6, 1, 1), (8, 2, 1, 1), (16, 4, 4, 2), (64, 8, 8, 3), (48, 6, 3, 2),
           (32, 32, 1, 1), (12, 3, 12, 4), (256, 8, 8, 4), (20, 20, 5, 5)]


def _scores(n, e, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        s = torch.rand(n, e, generator=g) + torch.randn(n, e, generator=g) * 0.1
    elif kind == "ties":  # few distinct values and both zeros: ranks decided by index
        s = torch.tensor([0.25, 0.5, 0.0, -0.0, 0.75])[torch.randint(0, 5, (n, e), generator=g)]
    else:  # some experts, and some whole rows' halves, at -inf
        s = torch.rand(n, e, generator=g)
        s[torch.rand(n, e, generator=g) < 0.3] = float("-inf")
        s[: n // 4, : e // 2] = float("-inf")
    return s.to(DEV)


@pytest.mark.parametrize("kind", ["random", "ties", "-inf"])
@pytest.mark.parametrize("e,k,n_group,topk_group", ROUTERS)
def test_the_kernel_selects_the_composed_ids(e, k, n_group, topk_group, kind):
    biased = _scores(97, e, kind, seed=e + k)
    got = tri.route_select(biased, k, n_group, topk_group)
    if kind == "-inf" and n_group > 1:  # rows whose finite groups are fewer than topk_group:
        top2 = torch.topk(biased.view(97, n_group, -1), min(2, e // n_group), dim=-1).values
        ok = (top2.sum(-1) > float("-inf")).sum(1) >= topk_group  # the composed path cannot take them
        assert ok.sum() > len(ok) // 2
        biased, got = biased[ok], got[ok]
    want = route_select_composed(biased, k, n_group, topk_group)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), f"{int((got != want).any(1).sum())} rows differ"


def test_moe_route_on_the_triton_path_takes_the_kernel(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 40, generator=g).to(DEV)
    router, bias = torch.randn(64, 40, generator=g).to(DEV), (torch.randn(64, generator=g) * 0.1).to(DEV)
    with use_path("triton"):
        w, ids = moe_route(x, router, bias, 6, n_group=4, topk_group=2, routed_scaling_factor=2.5)
        calls = []
        monkeypatch.setattr(tri, "route_select", lambda *a: calls.append(a) or route_select_composed(*a))
        w2, ids2 = moe_route(x, router, bias, 6, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert len(calls) == 1 and torch.equal(ids, ids2) and torch.equal(w, w2)


def test_negative_control_without_the_group_limit_other_experts():
    biased = _scores(97, 64, "random", seed=1)
    assert not torch.equal(tri.route_select(biased, 6, 4, 2), tri.route_select(biased, 6, 1, 1))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="route_select takes fp32"):
        tri.route_select(torch.zeros(2, 300, device=DEV), 6, 1, 1)
    with pytest.raises(ValueError, match="route_select takes fp32"):
        tri.route_select(torch.zeros(2, 64, device=DEV, dtype=torch.bfloat16), 6, 1, 1)
