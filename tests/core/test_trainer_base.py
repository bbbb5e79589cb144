"""The shared trainer base: per-batch state stays off the trainers (values, not attributes), and both trainers go
through ``MoEReplayTrainerMixin``."""

from __future__ import annotations

import ast
import inspect
import textwrap

from trl_moe_replay import MoEReplayAsyncGRPOTrainer, MoEReplayGRPOTrainer
from trl_moe_replay.core.trainer_base import MoEReplayTrainerMixin


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
                        if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                and leaf.value.id == "self" and isinstance(leaf.ctx, ast.Store)):
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
    assert {cls.__name__ for cls in _own_classes(MoEReplayGRPOTrainer)} >= {"MoEObjectivesMixin", "RestoresEveryWeight"}


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
        for name in ("_claim_output_dir", "_checked_weight_sync", "_log_routing_agreement",
                     "_log_logprob_mismatch", "_aux_loss_under_replay"):
            assert getattr(trainer, name) is getattr(MoEReplayTrainerMixin, name), (trainer.__name__, name)
