"""Threshold replay (``replay_score_threshold=1``) under expert parallelism, against DDP on the same data: R3 for a
generation batch's two updates in ``tests/scripts/expert_parallel_run.py``'s ``train`` launch (its ``threshold``
report), the launch test_expert_parallel.py's tests read.
"""

import json
import math

import pytest

from tests.parallel.test_expert_parallel import LOSS_TOL, MOE_LAYERS, WEIGHT_TOL, close, launch


pytestmark = [pytest.mark.slow, pytest.mark.serial]  # two processes per launch, as test_expert_parallel.py's
STEPS = 2  # optimizer steps of the threshold run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The ``train`` launch's reports: those test_expert_parallel.py's ``trained`` wrote in this session's temporary
    folder (pytest runs that file first), else a launch of this module's own (this file run alone)."""
    for out in sorted(tmp_path_factory.getbasetemp().glob("ep_train*")):
        files = [out / f"rank{rank}.json" for rank in range(2)]  # written once a launch has ended well
        if all(file.exists() for file in files):
            ranks = [json.loads(file.read_text()) for file in files]
            if [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)] and "threshold" in ranks[0]:
                return ranks
    return launch(tmp_path_factory.mktemp("ep_train"), "train")


def test_threshold_replay_trains_on_the_sharded_experts_and_logs_its_replace_rate(trained):
    """The experts modules (8 of 16 experts per rank, tokens dispatched by all-to-all) ran the replayed experts the
    router kept and, in place of each rejected one, one the replay counted (the refill never brings a rejected expert
    back: it ranks below the router's own top-k), the same ids in the backward recompute, no expert twice in a token."""
    for rank in trained:
        threshold = rank["threshold"]
        storage = threshold["storage"]
        assert storage["sharded_at_load"] and storage["experts_full"][0] == 16 and storage["experts_local"][0] == 8
        assert len(threshold["loss"]) == STEPS and all(map(math.isfinite, threshold["loss"]))
        rates = threshold["replace_rate"]
        assert len(rates) == STEPS and all(0.0 <= rate <= 1.0 for rate in rates), rates
        # the on-policy update replays its own router's choice: nothing rejected; the off-policy one's router moved
        assert rates[0] == 0.0 and rates[1] > 0.0, rates
        assert set(threshold["replace_rate_layers"]) == {f"routing/replace_rate/layer_{i}" for i in range(MOE_LAYERS)}
        checks = threshold["routes"]
        # steps x MoE layers x (forward + gradient-checkpointing recompute), on the EP dispatch's global ids
        assert checks["calls"] == STEPS * MOE_LAYERS * 2 and checks["rows"] > 0, checks
        assert checks["replaced_seen"] == checks["replaced_counted"] > 0, checks
        assert checks["slots_counted"] == checks["rows"] * threshold["top_k"], checks
        assert checks["recompute_differs"] == 0 and checks["duplicates"] == 0, checks
    # summed over ranks before it is logged: every rank logs the same rate
    assert trained[0]["threshold"]["replace_rate"] == trained[1]["threshold"]["replace_rate"]


def test_threshold_replay_ends_at_the_weights_of_ddp(trained):
    """Losses, replace rates and every weight as DDP's (test_expert_parallel.py's tolerances). The rule's choice is
    discrete: after the first update, whose weights differ from DDP's by the rounding of another gradient reduction
    order only, a score within that rounding of its bar could flip one slot; none is that close here (each rank
    replaced the very slots DDP's rank did), and a flipped slot would move a weight by a whole step (~1e-3)."""
    for rank in trained:
        threshold = rank["threshold"]
        assert close(threshold["loss"], threshold["ddp_loss"], LOSS_TOL), (threshold["loss"], threshold["ddp_loss"])
        assert close(threshold["replace_rate"], threshold["ddp_replace_rate"], LOSS_TOL)
        assert threshold["replace_rate_layers"].keys() == threshold["ddp_replace_rate_layers"].keys()
        for name, rates in threshold["replace_rate_layers"].items():
            assert close(rates, threshold["ddp_replace_rate_layers"][name], LOSS_TOL), name
        assert threshold["routes"] == threshold["ddp_routes"]  # the same rows on this rank, the same slots replaced
        worst = max(threshold["weight_diff"].items(), key=lambda item: item[1])
        assert worst[1] <= WEIGHT_TOL, worst
        assert any("experts" in name for name in threshold["weight_diff"])  # the experts were compared too
