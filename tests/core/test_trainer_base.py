"""The shared trainer base: per-batch state stays off the trainers (values, not attributes), both trainers go
through ``MoEReplayTrainerMixin``, each upstream method has one override of ours (three bases for the sync trainer),
and its one cleanup leaves the model as transformers built it."""

from __future__ import annotations

import ast
import inspect
import math
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_moe_replay import MoEReplayAsyncGRPOTrainer, MoEReplayGRPOTrainer
from trl_moe_replay.core.output_lock import LOCK_NAME
from trl_moe_replay.core.trainer_base import MoEReplayTrainerMixin
from trl_moe_replay.testing import tiny_moe_model

from tests.helpers import hooks_of_ours, module_hooks, random_ids
from tests.trainer.test_grpo_trainer import make_trainer, reward_len


# the most attributes either trainer may set on itself outside __init__ (state that outlives one call)
MAX_ATTRIBUTES_SET_OUTSIDE_INIT = 3


def _own_classes(trainer: type) -> list[type]:
    """The trainer class and the mixins of this package in its MRO (TRL's and transformers' classes are not ours)."""
    return [cls for cls in trainer.__mro__ if cls.__module__.startswith("trl_moe_replay.")]


def attributes_set_outside_init(classes: list[type]) -> dict[str, list[str]]:
    """``self.X = ...`` (also augmented, annotated and tuple targets) in any method but ``__init__`` of ``classes``:
    attribute -> ``Class.method`` where it is set."""
    found: dict[str, list[str]] = {}
    for cls in classes:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for method in ast.walk(tree.body[0]):
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) or method.name == "__init__":
                continue
            for node in ast.walk(method):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if (
                            isinstance(leaf, ast.Attribute)
                            and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"
                            and isinstance(leaf.ctx, ast.Store)
                        ):
                            found.setdefault(leaf.attr, []).append(f"{cls.__name__}.{method.name}")
    return found


def test_the_scan_sees_an_attribute_set_outside_init():
    class Probe(MoEReplayTrainerMixin):
        def __init__(self):
            self.allowed = 1

        def step(self):
            self.counter += 1
            self.a, self.b = 1, 2

    assert sorted(attributes_set_outside_init([Probe])) == ["a", "b", "counter"]


def test_the_scan_reads_the_trainers_mixins():
    assert MoEReplayTrainerMixin in _own_classes(MoEReplayGRPOTrainer)
    assert "PR2TrainerMixin" in {cls.__name__ for cls in _own_classes(MoEReplayGRPOTrainer)}


def test_each_trainer_sets_at_most_three_attributes_outside_init():
    for trainer in (MoEReplayGRPOTrainer, MoEReplayAsyncGRPOTrainer):
        found = attributes_set_outside_init(_own_classes(trainer))
        listing = ", ".join(f"{name} ({', '.join(where)})" for name, where in sorted(found.items()))
        assert len(found) <= MAX_ATTRIBUTES_SET_OUTSIDE_INIT, (
            f"{trainer.__name__} sets {len(found)} attributes outside __init__: {listing}. Per-batch state travels "
            "as a value (core/route_flow.py: MicroBatch, GenerationBatch), not on the trainer."
        )


def test_both_trainers_share_the_base_first_in_their_bases():
    for trainer in (MoEReplayGRPOTrainer, MoEReplayAsyncGRPOTrainer):
        assert trainer.__bases__[0] is MoEReplayTrainerMixin  # train() claims output_dir before anything else runs
        # the lifecycle and the output-dir lock are the base's, not written again in a trainer
        for name in (
            "_claim_output_dir",
            "_checked_weight_sync",
            "_log_routing_agreement",
            "_log_logprob_mismatch",
            "_aux_loss_under_replay",
        ):
            assert getattr(trainer, name) is getattr(MoEReplayTrainerMixin, name), (trainer.__name__, name)


# ----------------------------------------------------------------------------- one override per upstream method
# Each TRL/transformers/torch method has at most one override of ours in a trainer's MRO: where two of our classes add
# to one method, the one override calls the other's part as a named hook or helper (a chain of super() overrides
# across mixins hid which ran first). The sync trainer's bases: MoEReplayTrainerMixin, PR2TrainerMixin, GRPOTrainer.
UPSTREAM_PACKAGES = ("trl", "transformers", "torch")
SYNC_BASES = 3


def _package(cls: type) -> str:
    return cls.__module__.split(".")[0]


def overridden_twice(trainer: type) -> dict[str, list[str]]:
    """Each attribute an upstream class in ``trainer``'s MRO defines that two or more of our classes define too, with
    the classes that do (empty: none). Dunder names (``__module__``, ``__doc__`` ...) every class has are left out."""
    upstream = {
        name
        for cls in trainer.__mro__
        if _package(cls) in UPSTREAM_PACKAGES
        for name in vars(cls)
        if not (name.startswith("__") and name.endswith("__"))
    }
    ours = [cls for cls in trainer.__mro__ if _package(cls) == "trl_moe_replay"]
    found = {name: [cls.__name__ for cls in ours if name in vars(cls)] for name in upstream}
    return {name: where for name, where in sorted(found.items()) if len(where) > 1}


def test_the_scan_sees_a_method_overridden_in_two_of_our_classes():
    class Twice(MoEReplayGRPOTrainer):  # train in the base and here: two overrides of ours
        __module__ = MoEReplayGRPOTrainer.__module__

        def train(self, *args, **kwargs):
            return super().train(*args, **kwargs)

    assert {"Twice", "MoEReplayTrainerMixin"} <= set(overridden_twice(Twice)["train"])
    assert "end" not in overridden_twice(Twice)


def test_no_upstream_method_is_overridden_in_two_of_our_classes():
    for trainer in (MoEReplayGRPOTrainer, MoEReplayAsyncGRPOTrainer):
        assert overridden_twice(trainer) == {}, trainer.__name__


def test_the_sync_trainer_has_three_bases_and_the_async_two():
    assert len(MoEReplayGRPOTrainer.__bases__) == SYNC_BASES, MoEReplayGRPOTrainer.__bases__
    assert len(MoEReplayAsyncGRPOTrainer.__bases__) == 2, MoEReplayAsyncGRPOTrainer.__bases__


# ----------------------------------------------------------------------------- one cleanup
def only_transformers_hooks_added(before: dict, after: dict) -> list:
    """The hooks in ``after`` that were not in ``before`` and that transformers did not define (empty: none)."""
    return [
        (key, count - before.get(key, 0))
        for key, count in after.items()
        if count > before.get(key, 0) and not key[2].startswith("transformers.")
    ]


def assert_forwards_as_plain_transformers(model, path) -> None:
    """``model``'s logits equal, bit for bit, those of a fresh transformers load of its weights."""
    model.save_pretrained(path)
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_ids(2, 7)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, fresh(ids).logits)


def test_after_train_and_end_the_model_has_no_hook_of_ours_and_forwards_as_plain_transformers(tmp_path):
    model = tiny_moe_model("qwen3_moe")
    before = module_hooks(model)
    trainer = make_trainer(tmp_path / "run", model, routing_replay="r3", max_steps=1)
    assert hooks_of_ours(model) == 7  # the routers, MoE blocks and stack of the 2-layer model, while it trains
    trainer.train()
    trainer.end()
    after = module_hooks(model)
    assert hooks_of_ours(model) == 0
    # what is left beside the hooks it had: transformers' own (the input-grads hooks of gradient checkpointing)
    assert only_transformers_hooks_added(before, after) == []
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert_forwards_as_plain_transformers(model, tmp_path / "saved")


def test_an_exception_out_of_train_cleans_up_and_a_later_train_puts_the_hooks_back(tmp_path):
    failures = [RuntimeError("reward server down")]

    def flaky_reward(completions, **kwargs):
        if failures:
            raise failures.pop()
        return reward_len(completions)

    model = tiny_moe_model("qwen3_moe")
    before = module_hooks(model)
    trainer = make_trainer(tmp_path / "run", model, routing_replay="r3", max_steps=1)
    trainer.reward_funcs = [flaky_reward]
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert hooks_of_ours(model) == 0 and only_transformers_hooks_added(before, module_hooks(model)) == []
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # another run may take output_dir now
    trainer.train()  # a retry: the hooks are back, and R3 replays the rollout's routes exactly
    mismatch = [h["routing/mismatch_frac"] for h in trainer.state.log_history if "routing/mismatch_frac" in h]
    assert mismatch == [0.0] and not math.isnan(mismatch[0])
    assert hooks_of_ours(model) == 7 and (tmp_path / "run" / LOCK_NAME).exists()
    trainer.end()
    assert hooks_of_ours(model) == 0
