"""PR2 beside the sync trainer: ``MoEReplayGRPOTrainer`` mixes :class:`PR2TrainerMixin` in, after the base both
trainers share and before TRL's ``GRPOTrainer``.

The trainer calls PR2 at four named points of a generation batch, each a no-op (or ``contextlib.nullcontext``) without
PR2:

* ``_new_pr2(args)``, in ``__init__`` after ``self._route_replay`` exists: the per-run state
  (:class:`~trl_moe_replay.pr2.state.PredictiveRoutingReplay`) when ``routing_replay="pr2"``, else None;
* ``_pr2_generate()``, around transformers ``generate``: routes it by the predicted routes
  (``pr2_rollout_prediction``);
* ``_pr2_old_pass_chunk(...)``, around each chunk of the old-logprob pass: steers to the predicted routes (unless the
  rollout's are replayed) and caches the predictors' inputs;
* ``_pr2_on_generation_batch(batch)``, before the batch's routes are stored: the cache becomes per-sample inputs of
  the ``GenerationBatch``, kept in the trainer's route buffer beside the routes and gathered by each micro-batch's
  ``route_rows`` (``core/route_flow.py``); TRL's batch dict carries no PR2 tensor.

Three more wrap a Trainer method that the trainer or its base overrides (each TRL method has one override of ours), and
hand straight on without PR2:

* ``_with_pr2_loss(inputs, compute_loss)``, from the trainer's ``_compute_loss``: the predictor loss in the policy
  loss's graph;
* ``_pr2_training_step()``, around TRL's ``training_step`` (the base's ``_training_step_context`` hook): the
  optimizer-step window, DDP gradient averaging;
* ``_pr2_optimizer_load(checkpoint)``, around the base's ``_load_optimizer_and_scheduler`` (its
  ``_optimizer_load_context`` hook, whichever engine restores the optimizer): the checks of a resumed checkpoint
  first, ``pr2_predictors.safetensors`` after.

The rest are Trainer overrides of its own that hand straight to the next class without PR2: ``create_optimizer`` (the
predictors' own param group), ``_clip_grad_norm`` (their own norm), ``_save_checkpoint``
(``pr2_predictors.safetensors``).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core.route_flow import GenerationBatch, RouteFlow
from ..core.routing_options import RouteSource, option
from ..upstream import checkpoint_run_dir, exclude_from_weight_sync
from .state import (
    MODULE_NAME,
    PREDICTORS_FILE,
    PR2CheckpointError,
    PR2StateError,
    PredictiveRoutingReplay,
)


if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from transformers import PreTrainedModel
    from trl import GRPOTrainer as _GRPOTrainerHost

    from ..core.replay_modes import ReplayMode
    from ..routing import RouterReplay
else:
    _GRPOTrainerHost = object  # the type checker sees the GRPOTrainer this mixes into; at run time a plain mixin


class PR2TrainerMixin(_GRPOTrainerHost):
    """PR2 (``routing_replay="pr2"``) for ``MoEReplayGRPOTrainer``: R2 whose old-logprob pass (or, with
    ``pr2_rollout_prediction``, ``generate``) routes by the predicted routes, with the predictors trained alongside."""

    _pr2: PredictiveRoutingReplay | None = None  # the trainer's __init__ sets it from _new_pr2
    # set by the trainer this mixes into (MoEReplayTrainerMixin, TRL's GRPOTrainer); declared for the type checker
    _route_replay: RouterReplay | None
    _routes: RouteFlow | None
    model: PreTrainedModel  # TRL's GRPOTrainer always holds one (Trainer's is Optional)
    _global_sums: Callable[..., dict[str, torch.Tensor]]

    if TYPE_CHECKING:  # MoEReplayTrainerMixin's property

        @property
        def routing_replay(self) -> ReplayMode: ...

    @property
    def _pr2_averages_gradients(self) -> bool:
        """PR2 under plain data parallelism: DDP ignores the predictors (see PredictiveRoutingReplay), so the trainer
        averages their gradients; DeepSpeed and FSDP reduce them themselves."""
        return (
            self._pr2 is not None
            and self.accelerator.num_processes > 1
            and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        )

    # ------------------------------------------------------------------ named points the trainer calls
    def _new_pr2(self, args) -> PredictiveRoutingReplay | None:
        """In ``__init__``, once ``self._route_replay`` exists: PR2's state (None without PR2)."""
        return self._build_pr2(args) if self.routing_replay.source is RouteSource.PREDICTED else None

    def _pr2_generate(self) -> contextlib.AbstractContextManager:
        """Around transformers ``generate``: the predicted routes (``pr2_rollout_prediction``), else nothing."""
        if self._pr2 is not None and self._pr2.rollout_prediction:
            return self._pr2.steering()
        return contextlib.nullcontext()

    def _pr2_old_pass_chunk(
        self, attention_mask: torch.Tensor, logits_to_keep: int, *, steer: bool
    ) -> contextlib.AbstractContextManager:
        """Around one chunk of the old-logprob pass: predicted routes (``steer``: unless the rollout's are replayed)
        and, in training, the predictors' inputs cached at the chunk's completion positions."""
        assert self._pr2 is not None  # ForwardPlan.pr2 is set only with PR2 built
        return self._pr2.old_pass_chunk(attention_mask, logits_to_keep, steer=steer, cache=self.model.training)

    def _pr2_on_generation_batch(self, batch: GenerationBatch) -> None:
        """Before the batch's routes are stored: the old pass's cache as per-sample inputs of ``batch``."""
        if self._pr2 is not None:
            batch.per_sample.update(self._pr2.take_old_pass_cache(self.state.global_step))

    def _build_pr2(self, args) -> PredictiveRoutingReplay:
        if self.optimizer is not None:
            raise NotImplementedError(
                "routing_replay='pr2' adds the predictors' param group in create_optimizer; pass no optimizer (or "
                "subclass and call PredictiveRoutingReplay.add_to_optimizer yourself)."
            )
        assert self._route_replay is not None  # PR2 replays: the trainer's hooks are on the model
        pr2 = PredictiveRoutingReplay(
            self._route_replay,
            cached_tokens_per_sequence=option(args, "pr2_cached_tokens_per_sequence"),
            rollout_prediction=option(args, "pr2_rollout_prediction"),
        )
        if self.use_vllm:  # vLLM's model has no predictors: keep them out of the weight sync
            exclude_from_weight_sync(self.vllm_generation, lambda name: name.split(".")[0] == MODULE_NAME)
        return pr2

    # ------------------------------------------------------------------ training
    def _with_pr2_loss(self, inputs: dict, compute_loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The trainer's ``_compute_loss`` of micro-batch ``inputs`` (``compute_loss``: TRL's), in training under PR2
        with the predictors watching the forward and their loss added (:meth:`_add_pr2_predictor_loss`)."""
        if self._pr2 is None or not self.model.training:
            return compute_loss()
        # the micro-batch's own rows of the cache, held with its routes (route_flow step 4) and named by its route_rows
        assert self._routes is not None  # PR2 replays: the trainer carries routes
        held = self._routes.micro_rows(inputs)
        with self._pr2.watch_training_forward(held.per_sample if held is not None else {}):
            loss = compute_loss()
        return self._add_pr2_predictor_loss(loss)

    @contextlib.contextmanager
    def _pr2_training_step(self) -> Iterator[None]:
        """Around TRL's ``training_step`` (the trainer's ``_training_step_context``): PR2's optimizer-step window, and
        under plain data parallelism the predictors' gradients averaged after the backward."""
        if self._pr2 is None:
            yield
            return
        self._pr2.begin_micro_step(self.state.global_step)
        yield
        if self._pr2_averages_gradients and self.accelerator.sync_gradients:
            self._pr2.average_gradients(self.accelerator.num_processes)  # before the Trainer clips them

    def create_optimizer(self, model=None):
        if self._pr2 is None:
            return super().create_optimizer(model)
        with self._pr2.hidden_from_optimizer():  # not in the Trainer's groups (weight decay, lr) ...
            optimizer = super().create_optimizer(model)
        lr = self.args.learning_rate * option(self.args, "pr2_lr_multiplier")
        # ... but in their own; checked for NaN after each step where every rank holds them whole (DeepSpeed and
        # FSDP: through the predictor loss and at each checkpoint)
        self._pr2.add_to_optimizer(optimizer, lr, check_finite=not (self.is_deepspeed_enabled or self.is_fsdp_enabled))
        return optimizer

    def _add_pr2_predictor_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the predictor loss of the micro-batch in the graph: the value stays the policy loss (what
        TRL logs as ``loss``), the one backward also trains the predictors."""
        # DeepSpeed keeps a parameter's previous gradient when a backward gives it none (measured under ZeRO-3:
        # the on-policy step's grad norm still held the last off-policy step's predictor gradient), so there the
        # predictors take part in every backward, with a zero gradient on the steps they do not train
        assert self._pr2 is not None  # the trainer adds the predictor loss only under PR2
        result = self._pr2.training_loss(
            self.state.global_step,
            grad_scale=1.0 / self.current_gradient_accumulation_steps,
            always_in_graph=self.is_deepspeed_enabled,
        )
        if result is None:
            return loss
        predictor_loss, sums = result
        totals = self._global_sums(sums, self.accelerator.device)
        if "kl" in totals and not torch.isfinite(totals["kl"]):  # summed over ranks: every rank stops together
            raise PR2StateError(
                f"the PR2 predictor loss is {totals['kl'].item()} at step {self.state.global_step}: the predictors' "
                "weights or their cached inputs are not finite, and every route they predict would be garbage. "
                "Resume from an earlier checkpoint with a lower pr2_lr_multiplier, or train with routing_replay='r2'."
            )
        for name, value in self._pr2.metrics(totals).items():
            self._metrics["train"][name].append(value)
        if predictor_loss is None:
            return loss
        # x - x.detach() is exactly 0 in value and carries x's gradient; the predictor loss reaches only the
        # predictors (detached inputs), and the policy loss never reaches them (they steer no-grad forwards only)
        return loss + (predictor_loss - predictor_loss.detach()).to(loss.device)

    def _clip_grad_norm(self, model):
        """Clip the policy's gradients by their own norm and the predictors' by theirs (both to ``max_grad_norm``):
        the two losses are independent, so neither gradient scales the other's update, and PR2 with frozen
        predictors clips exactly like R2. The returned (logged) ``grad_norm`` is the policy's; ``pr2/grad_norm``
        the predictors'. DeepSpeed clips every parameter it holds by one norm, predictors included."""
        if self._pr2 is None or self.is_deepspeed_enabled:
            return super()._clip_grad_norm(model)
        # the Trainer's clipping (fp16 unscaling of every gradient included) over the model's other parameters
        grad_norm = super()._clip_grad_norm(self._pr2.without_predictors(model))
        predictor_norm = self._pr2.clip_gradients(self.args.max_grad_norm)
        if predictor_norm is not None:
            self._metrics["train"]["pr2/grad_norm"].append(predictor_norm)
        return grad_norm

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        # PR2: the predictors first (atomically), then TRL's files, whose trainer_state.json comes last: a checkpoint
        # that has it has its predictors too, whenever the process is killed
        if self._pr2 is not None:
            state = self._pr2.full_state_dict()  # every rank: a collective under FSDP2 and ZeRO-3
            self._pr2.check_finite(state, "at a checkpoint")  # every rank holds the same full weights: all stop
            if self.args.should_save:
                checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder super() writes next
                self._pr2.save(os.path.join(checkpoint_run_dir(self, trial), checkpoint), state)
        super()._save_checkpoint(model, trial)

    @contextlib.contextmanager
    def _pr2_optimizer_load(self, checkpoint: str | None) -> Iterator[None]:
        """Around loading a checkpoint's optimizer and scheduler (the trainer's ``_optimizer_load_context``, whichever
        engine loads them): the PR2 checks first, the predictors' weights after."""
        if checkpoint is not None:  # before torch loads the optimizer state (every engine passes here)
            self._check_pr2_checkpoint(checkpoint)
        yield
        if self._pr2 is None or checkpoint is None:
            return
        restored_by_engine = self.is_deepspeed_enabled or self.is_fsdp_enabled
        self._pr2.load(checkpoint, restored_by_engine=restored_by_engine)

    def _check_pr2_checkpoint(self, checkpoint: str) -> None:
        """Refuse to resume PR2 state from a checkpoint without it, or a PR2 checkpoint without PR2 (before torch's
        optimizer load fails on the predictors' extra param group with a generic message)."""
        has_predictors = os.path.isfile(os.path.join(checkpoint, PREDICTORS_FILE))
        complete = os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME))  # the Trainer writes it last
        if self._pr2 is not None and not complete:
            raise PR2CheckpointError(
                f"routing_replay='pr2' cannot resume from {checkpoint}: it has no {TRAINER_STATE_NAME}, which the "
                "Trainer writes last, so the run was stopped while saving it (or it is no checkpoint folder). Resume "
                "from an earlier checkpoint-N."
            )
        if self._pr2 is not None and not has_predictors:
            raise PR2CheckpointError(
                f"routing_replay='pr2' cannot resume from {checkpoint}: it has no {PREDICTORS_FILE}. Either the "
                "run that saved it did not use PR2 (resume it with its own routing_replay, or start a new PR2 run "
                "from its weights without resume_from_checkpoint), or it was stopped while saving this checkpoint "
                "(resume from an earlier checkpoint-N). Restarting the predictors from zero under their restored "
                "optimizer state would train them wrongly."
            )
        if self._pr2 is None and has_predictors:
            raise PR2CheckpointError(
                f"{checkpoint} was saved by a routing_replay='pr2' run (it holds {PREDICTORS_FILE} and the "
                f"predictors' optimizer state), but this run uses routing_replay={self.routing_replay!r}. Resume it "
                "with routing_replay='pr2', or start a new run from its weights without resume_from_checkpoint."
            )
