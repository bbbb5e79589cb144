"""Route checks (trl_moe_replay.routing.routes): validate_routes' fast certification against the row-by-row check it
replaced, the no-route sentinel of each dtype, and layer subsets."""

import numpy as np
import pytest
import torch

from trl_moe_replay.routing.errors import RouteValidationError
from trl_moe_replay.routing.routes import has_route, validate_routes


def test_uint8_routes_with_256_experts_keep_expert_255_and_rows_of_255_mean_no_route():
    routes = torch.tensor([[[[255, 3]], [[255, 255]], [[3, 255]]]], dtype=torch.uint8)  # [1, 3, 1, 2]
    assert has_route(routes).tolist() == [[[True], [False], [True]]]
    validate_routes(routes, num_layers=1, top_k=2, num_experts=256)
    with pytest.raises(RouteValidationError, match="expert ids must lie in \\[0, 200\\)"):
        validate_routes(routes, num_layers=1, top_k=2, num_experts=200)  # 255 is no id of a 200-expert model
    with pytest.raises(RouteValidationError, match="names the same expert twice"):
        validate_routes(torch.tensor([[[[7, 7]]]], dtype=torch.uint8), num_layers=1, top_k=2, num_experts=8)


# ----------------------------------------------------------------------------- validate_routes without a sort (issue 24)
def _plain_route_problem(routes, top_k, num_experts, layers):
    """Is any row of ``routes`` at ``layers`` neither "no route" nor top_k distinct ids in [0, num_experts)?"""
    sentinel = 255 if routes.dtype == torch.uint8 else -1
    for row in routes[:, :, layers].reshape(-1, top_k).tolist():
        if all(i == sentinel for i in row):
            continue
        if len(set(row)) < top_k or any(not 0 <= i < num_experts for i in row):
            return True
    return False


def test_validate_routes_fast_check_rejects_exactly_what_the_sorting_check_rejects(monkeypatch):
    """validate_routes certifies valid routes by flat passes (min, max, shifted comparisons) and hands anything else
    to the row-by-row check it replaced (``_raise_first_problem``, a sort per route). On random valid and corrupted
    routes of every accepted dtype: it raises exactly when that check raises, with the same message, agrees with a
    plain per-row loop, and valid routes never reach the sort."""
    from trl_moe_replay.routing import routes as routes_module

    exact = routes_module._raise_first_problem
    calls = []
    monkeypatch.setattr(routes_module, "_raise_first_problem", lambda *a, **kw: (calls.append(1), exact(*a, **kw)))

    def outcome(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except RouteValidationError as error:
            return str(error)
        return None

    rng = np.random.default_rng(0)
    dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    kinds = ["valid", "repeat", "zeros", "too_big", "below_minus_one", "partial_no_route", "sentinel_in_route"]
    seen = dict.fromkeys(kinds, 0)
    for trial in range(400):
        kind = kinds[int(rng.integers(len(kinds)))]
        dtype = torch.uint8 if kind == "sentinel_in_route" else dtypes[trial % len(dtypes)]
        top_k = int(rng.integers(1, 10))
        high = {torch.uint8: 257, torch.int8: 128}.get(dtype, 300)
        num_experts = int(rng.integers(top_k, min(high, top_k + 40)))
        if dtype == torch.uint8 and trial % 7 == 0 and top_k >= 2:
            num_experts = 256  # 255 is then an id of a route, and a row of 255s still "no route"
        batch, seq, num_layers = (int(x) for x in rng.integers(1, 4, 3))
        ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(batch * seq * num_layers)])
        routes = torch.from_numpy(ids.reshape(batch, seq, num_layers, top_k)).to(dtype)
        sentinel = 255 if dtype == torch.uint8 else -1
        no_route_rows = rng.random((batch, seq, num_layers)) < 0.3
        routes[torch.from_numpy(no_route_rows)] = sentinel
        b, s, layer, slot = (int(rng.integers(n)) for n in (batch, seq, num_layers, top_k))
        other = (slot + 1) % top_k
        if kind == "repeat" and top_k >= 2:
            routes[b, s, layer, slot] = routes[b, s, layer, other] if routes[b, s, layer, other] != sentinel else 0
            routes[b, s, layer, other] = routes[b, s, layer, slot]
        elif kind == "zeros" and top_k >= 2:
            routes[b, s, layer] = 0
        elif kind == "too_big" and num_experts < {torch.uint8: 255, torch.int8: 128}.get(dtype, 1 << 15):
            top = {torch.uint8: 255, torch.int8: 128}.get(dtype, 999)
            routes[b, s, layer, slot] = num_experts if rng.random() < 0.5 else int(rng.integers(num_experts, top))
        elif kind == "below_minus_one" and dtype != torch.uint8:
            routes[b, s, layer, slot] = -int(rng.integers(2, 100))
        elif kind == "partial_no_route" and top_k >= 2:
            routes[b, s, layer] = torch.from_numpy(rng.permutation(num_experts)[:top_k]).to(dtype)
            routes[b, s, layer, slot] = sentinel
        elif kind == "sentinel_in_route" and dtype == torch.uint8 and top_k >= 2:
            routes[b, s, layer] = torch.from_numpy(rng.permutation(min(num_experts, 255))[:top_k]).to(dtype)
            routes[b, s, layer, slot] = 255  # an id of a 256-expert model, out of range below
        else:
            kind = "valid"
        layers = (
            None
            if rng.random() < 0.5
            else sorted(rng.choice(num_layers, int(rng.integers(1, num_layers + 1)), replace=False).tolist())
        )
        if rng.random() < 0.2:
            routes = routes.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
        checked = list(range(num_layers)) if layers is None else layers
        expected_bad = _plain_route_problem(routes, top_k, num_experts, checked)
        moe = routes if layers is None else routes[:, :, layers]
        calls.clear()
        got = outcome(
            validate_routes, routes, num_layers=num_layers, top_k=top_k, num_experts=num_experts, layers=layers
        )
        assert got == outcome(exact, moe, top_k=top_k, num_experts=num_experts), (trial, kind, dtype, top_k)
        assert (got is not None) == expected_bad, (trial, kind, got)
        if not expected_bad:
            assert not calls, (trial, kind)  # a valid batch is certified without the sort
        seen[kind] += got is not None
    assert all(seen[kind] >= 5 for kind in kinds if kind != "valid"), str(seen)  # every corruption was exercised


def test_validate_routes_accepts_a_batch_whose_every_row_is_no_route_and_empty_layer_lists():
    for dtype, sentinel in ((torch.uint8, 255), (torch.int16, -1)):
        validate_routes(torch.full((2, 3, 2, 4), sentinel, dtype=dtype), num_layers=2, top_k=4, num_experts=3)
    validate_routes(torch.full((2, 3, 2, 2), 7, dtype=torch.uint8), num_layers=2, top_k=2, num_experts=8, layers=[])
    with pytest.raises(RouteValidationError, match="names the same expert twice"):
        validate_routes(torch.full((2, 3, 2, 2), 7, dtype=torch.uint8), num_layers=2, top_k=2, num_experts=8)
