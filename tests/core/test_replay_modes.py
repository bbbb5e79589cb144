"""The mode registry (core/replay_modes.py): the docs table equals it, and a mode registered from here trains."""

import math
import pickle
from pathlib import Path

import pytest

from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayGRPOConfig
from trl_moe_replay.core.model_card import card_identity
from trl_moe_replay.core.replay_modes import (
    DOCS_TABLE_HEADER,
    ModeSpec,
    ReplayMode,
    RouteSource,
    TrainerKind,
    docs_table,
    register_mode,
    unregister_mode,
)
from trl_moe_replay.testing import tiny_moe_model

from tests.trainer.test_grpo_trainer import logged, make_trainer


USAGE = Path(__file__).parents[2] / "docs" / "usage.md"
TOY_BIBTEX = "@misc{toy2026,\n    title = {{A toy replay mode}},\n    year = 2026,\n}"


def documented_table() -> str:
    """The mode table of docs/usage.md as written: from its header line to the first blank line."""
    text = USAGE.read_text()
    start = text.index(DOCS_TABLE_HEADER.splitlines()[0])
    end = text.index("\n\n", start)
    return text[start:end]


def test_the_docs_mode_table_is_the_registry():
    assert documented_table() == docs_table()
    assert [line.split(" | ")[0].split("`")[1].strip('"') for line in docs_table().splitlines()[2:]] == [
        str(mode) for mode in ReplayMode
    ]


def test_a_mode_is_its_registered_singleton_everywhere_it_travels():
    for mode in ReplayMode:
        assert ReplayMode(str(mode)) is mode and pickle.loads(pickle.dumps(mode)) is mode
        assert mode.spec.name == mode == mode.value
    with pytest.raises(ValueError, match="not a registered routing_replay mode"):
        ReplayMode("r4")


def test_the_registry_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="already registered"):
        register_mode(ModeSpec("r3", RouteSource.ENGINE, routes_text="x", backends_text="x"))
    with pytest.raises(ValueError, match="async trainer never has"):
        register_mode(ModeSpec("r2-async", RouteSource.OLD_PASS, routes_text="x", backends_text="x"))
    with pytest.raises(ValueError, match="'none' already is that mode"):
        register_mode(ModeSpec("off", None, routes_text="x", backends_text="x"))
    with pytest.raises(ValueError, match="built-in"):
        unregister_mode("r3")


@pytest.fixture
def toy_mode():
    """A mode declared here, as docs/maintaining.md ("Add a replay mode") says: the engine's routes, both trainers,
    its own paper on the model card, its row in the table."""
    mode = register_mode(
        ModeSpec(
            "toy",
            RouteSource.ENGINE,
            routes_text="the engine's routes, as R3 (a test's mode)",
            backends_text="all",
            papers=("toy2026",),
            bibtex={"toy2026": TOY_BIBTEX},
        )
    )
    try:
        yield mode
    finally:
        unregister_mode("toy")
    assert "toy" not in [str(m) for m in ReplayMode]


def test_a_registered_mode_is_a_choice_of_both_configs_and_writes_its_card(tmp_path, toy_mode):
    config = MoEReplayGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, routing_replay="toy")
    assert config.routing_replay is toy_mode and config.routing_metrics  # a replaying mode's defaults
    assert config.to_dict()["routing_replay"] == "toy" and type(config.to_dict()["routing_replay"]) is str
    asynchronous = MoEReplayAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, routing_replay="toy")
    assert asynchronous.routing_replay is toy_mode
    qualifier, citations, tags = card_identity(config, toy_mode)
    assert "routing_replay=toy" in qualifier and TOY_BIBTEX in citations and tags == ["routing-replay-toy"]
    assert docs_table().splitlines()[-1] == "| `\"toy\"` | the engine's routes, as R3 (a test's mode) | all |"
    assert toy_mode.async_trainer_accepts and toy_mode.needs_engine_routes
    assert TrainerKind.ASYNC in toy_mode.spec.trainers


def test_a_registered_mode_trains(tmp_path, toy_mode):
    trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), routing_replay="toy", max_steps=2)
    assert trainer.routing_replay is toy_mode
    trainer.train()
    # the engine's routes replayed: in fp32 the old pass reproduces the sampler's log-probs, nothing falls back
    assert len(logged(trainer, "mismatch/kl_k3")) == 2 and max(logged(trainer, "mismatch/kl_k3")) < 1e-6
    assert logged(trainer, "routing/fallback_frac") == [0.0, 0.0]
    assert all(math.isfinite(loss) for loss in logged(trainer, "loss"))
