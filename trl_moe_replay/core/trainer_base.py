"""``MoEReplayTrainerMixin``: what both trainers do around TRL's, written once.

``MoEReplayGRPOTrainer`` (TRL's ``GRPOTrainer``) and ``MoEReplayAsyncGRPOTrainer`` (TRL's ``AsyncGRPOTrainer``) name it
first in their bases; TRL's class follows (the sync trainer has ``PR2TrainerMixin`` between them). A TRL or
transformers method is overridden in one class of ours only (tests/core/test_trainer_base.py): where a trainer adds
to one of this base's, it does so through a named hook (:meth:`_train_context`, :meth:`_training_step_context`,
:meth:`_optimizer_load_context`, :attr:`_settle_gloo_at_end`).

* the setup, in the order both ``__init__`` run it: the preamble before TRL's ``__init__``
  (:meth:`_resolve_replay_settings`: TRL checked, its notices quieted, the options resolved once, the launch's
  precision checked), the checks right after it (:meth:`_check_after_trl`: PEFT under replay, the launch's distributed
  engine), the aux-loss rule (:meth:`_aux_loss_under_replay`) and, last, what the run holds
  (:meth:`_hold_run`: the output-dir lock, the update probe);
* one run per ``output_dir`` (``core/output_lock.py``): held from ``__init__``, claimed in :meth:`train`;
* resume integrity (``checkpointing/checkpoint_weights.py``, whose functions these overrides call): the checkpoint
  ``train`` resumes from checked first, every weight restored or a one-line refusal (``_load_from_checkpoint``,
  ``_load_best_model``), the optimizer of a model sharded at load time in shards, no step past ``max_steps``
  (``get_batch_samples``);
* one cleanup (:meth:`_cleanup`), at :meth:`end` and on an exception out of :meth:`train`: every hook of ours off
  the model (it forwards as a plain transformers model again) and the output-dir lock released; a later
  :meth:`train` puts the hooks back;
* the engine sync check around each weight sync (:meth:`_checked_weight_sync`);
* the micro-batch replay lifecycle: a micro-batch's routes stay replayed from its training forward until its
  backward has returned, so ``training_step``/``prediction_step`` end it (:class:`~.route_flow.MicroBatchReplay`);
* the ``mismatch/*`` and ``routing/*`` metrics (:meth:`_log_logprob_mismatch`, :meth:`_log_routing_agreement`,
  threshold replay's :meth:`_log_replace_rate`).

Each trainer's ``__init__`` sets what the mixin reads: ``replay_settings``, ``_route_replay`` (and the sync trainer's
``_ref_route_replay``), ``_sync_check``, ``_micro_replay`` and ``_output_lock``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers.utils import logging

from ..checkpointing.checkpoint_weights import (
    restore_trainer_weights,
    restore_training_state,
    resume_argument,
    save_training_state,
    stop_if_resumed_complete,
)
from ..routing import RouterReplay
from ..upstream import assert_async_trl_compatible, assert_trl_compatible, end_trainer, quiet_upstream_notices
from ..weight_sync.sync_check import SyncCheck, checked_weight_sync
from .launch import check_launched_engine, check_launched_precision
from .metrics import (
    AGREEMENT_RATIOS,
    FALLBACK_RATIOS,
    MISMATCH_RATIOS,
    REPLACE_RATE,
    fallback_sums,
    log_ratio_metrics,
    logprob_mismatch_sums,
    routing_agreement_sums,
)
from .output_lock import OutputDirLock, claim_output_dir, hold_output_dir
from .peft_replay import check_peft_replay
from .precision import attach_update_probe
from .route_flow import MicroBatchReplay
from .routing_options import ReplayMode, ReplaySettings, TrainerKind


if TYPE_CHECKING:
    from transformers import PreTrainedModel, Trainer as _TrainerHost

    from ..rollouts.route_intake import RouteIntake
else:
    _TrainerHost = object  # the type checker sees the Trainer this mixes into; at run time a plain mixin

logger = logging.get_logger(__name__)

__all__ = ["MoEReplayTrainerMixin"]


class MoEReplayTrainerMixin(_TrainerHost):
    """The shared part of both MoE replay trainers (module docstring); the first of their bases."""

    replay_settings: ReplaySettings
    _route_replay: RouterReplay | None = None
    _ref_route_replay: RouterReplay | None = None
    _sync_check: SyncCheck | None = None
    _micro_replay: MicroBatchReplay | None = None
    _output_lock: OutputDirLock | None = None
    _route_intake: RouteIntake | None
    #: the sync trainer's: a gloo barrier before :meth:`end` destroys the process group
    _settle_gloo_at_end: bool = False
    # TRL's trainer, the host class, sets these (declared for the type checker only)
    # the Trainer's is optional; TRL's trainers always hold one after __init__ (a PEFT model forwards its methods)
    model: PreTrainedModel
    # per mode ("train", "eval"), each metric's values since the last log (TRL's GRPOTrainer and AsyncGRPOTrainer)
    _metrics: dict[str, defaultdict[str, list[float]]]
    aux_loss_enabled: bool

    @property
    def routing_replay(self) -> ReplayMode:
        """``routing_replay`` as resolved for this run."""
        return self.replay_settings.mode

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _resolve_replay_settings(args: Any, kind: TrainerKind) -> ReplaySettings:
        """The preamble both ``__init__`` run before TRL's: the installed TRL checked against the seams this trainer
        relies on, TRL's notices quieted, the routing options resolved once, and the launch's precision checked
        (before TRL's ``__init__``: DeepSpeed's own check would fail there less clearly). Plain TRL ("none") is only
        warned."""
        (assert_async_trl_compatible if kind is TrainerKind.ASYNC else assert_trl_compatible)()
        quiet_upstream_notices()
        settings = ReplaySettings.from_args(args, kind)
        check_launched_precision(args, strict=settings.mode.replays)
        return settings

    def _check_after_trl(self, *, adapter_only_sync: bool = False) -> None:
        """The checks both ``__init__`` run right after TRL's: a PEFT policy whose routes cannot be replayed
        faithfully (``core/peft_replay.py``), and a launch that asked for FSDP or DeepSpeed and got another engine
        (``core/launch.py``; plain TRL only warned)."""
        check_peft_replay(
            self.accelerator.unwrap_model(self.model), self.routing_replay, adapter_only_sync=adapter_only_sync
        )
        check_launched_engine(self.args, self.accelerator.state.distributed_type, strict=self.routing_replay.replays)

    def _hold_run(self) -> None:
        """The last setup step of both ``__init__``: one run per ``output_dir`` (claimed by the main process in
        :meth:`train`, held until :meth:`end`, an exception out of :meth:`train` or garbage collection), and the probe
        of what the first optimizer steps changed (a warning if ~nothing; ``precision/updated_frac`` with the routing
        metrics)."""
        self._output_lock = hold_output_dir(self)
        attach_update_probe(self, self._metrics, log_metric=self.replay_settings.routing_metrics)

    def _new_route_replay(self, model: Any) -> RouterReplay:
        """The hooks on ``model`` (the policy, or a separate reference model), replaying by this run's replay rule
        (``replay_score_threshold``: ``routing/replay_rule.py``)."""
        return RouterReplay(model, self.replay_settings.replay_score_threshold)

    def _aux_loss_under_replay(self) -> bool:
        """TRL's ``aux_loss_enabled``, turned off (with a warning) under routing replay."""
        if self.routing_replay.replays and self.aux_loss_enabled:
            logger.warning(
                "Router load-balancing aux loss turned OFF under routing replay: transformers' loss recounts the "
                "router's natural top-k, not the replayed experts, so it would balance routes that are not used."
            )
            return False
        return self.aux_loss_enabled

    # ------------------------------------------------------------------ one run per output_dir
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """TRL's ``train``, after claiming ``output_dir`` for this run (:mod:`trl_moe_replay.core.output_lock`), with
        the checkpoint to resume from checked (``checkpoint_weights.resume_argument``: ``True`` is the newest complete
        checkpoint), inside the trainer's :meth:`_train_context`.

        Raises ``OutputDirInUseError`` on every rank when another live trainer writes there (with
        ``routing_replay="none"``, plain TRL, a loud warning instead). On an exception out of it, the cleanup
        (:meth:`_cleanup`) runs before it propagates; a later ``train()`` (a resume) puts the hooks back.
        """
        with self._train_context():
            try:
                for rr in self._router_replays():
                    rr.attach()  # removed by an earlier cleanup (an exception out of train(), end()); else a no-op
                self._claim_output_dir()
                resume_from_checkpoint = resume_argument(self, resume_from_checkpoint)
                return super().train(resume_from_checkpoint, *args, **kwargs)
            except BaseException:
                self._cleanup()
                raise

    def _train_context(self) -> contextlib.AbstractContextManager:
        """Hook: a context around the whole of :meth:`train` (the async trainer's CPU tree attention); none here."""
        return contextlib.nullcontext()

    def _claim_output_dir(self) -> None:
        assert self._output_lock is not None  # each trainer's __init__ holds it
        claim_output_dir(self._output_lock, self.accelerator, strict=self.routing_replay.replays)

    def end(self) -> None:
        """``Trainer.end`` (finish the trackers, destroy the process group; seam entry ``trainer_end``: transformers
        5.16-5.17 have none), after the cleanup (:meth:`_cleanup`); in the sync trainer
        (:attr:`_settle_gloo_at_end`), after letting gloo's worker threads settle.

        On CPU data parallelism (gloo), destroying the group while a worker thread still drops a Python-owned tensor
        deadlocks (the main thread joins it holding the GIL), and exiting without destroying it can abort the
        interpreter at shutdown; a barrier and a short pause first avoid both.
        """
        if self._settle_gloo_at_end and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.barrier()
            time.sleep(0.2)
        self._cleanup()
        end_trainer(self)

    def _router_replays(self) -> list[RouterReplay]:
        """The ``RouterReplay`` hooks this trainer put on its models (the policy's, a separate reference model's)."""
        return [rr for rr in (self._route_replay, self._ref_route_replay) if rr is not None]

    def _cleanup(self) -> None:
        """The one cleanup of a run, at :meth:`end` and on an exception out of :meth:`train`: every hook of ours off
        the models (they forward as plain transformers models again) and ``output_dir`` released. Idempotent. The
        other hooks of ours live within one call and are removed on its way out (the recorder of transformers'
        ``generate``, the async trainer's log-prob hook)."""
        for rr in self._router_replays():
            rr.remove()
        if self._output_lock is not None:
            self._output_lock.release()

    # ------------------------------------------------------------------ weight sync
    def _checked_weight_sync(self, sync: Callable[[], None], mode: str = "train") -> None:
        """``sync`` (the trainer's weight sync) inside the engine sync check, if any (``weight_sync/sync_check.py``)."""
        checked_weight_sync(
            self._sync_check, sync, self.accelerator.unwrap_model(self.model), self.accelerator, self._metrics[mode]
        )

    # ------------------------------------------------------------------ resume integrity (checkpointing/)
    # A checkpoint restores every weight of the model, or it is refused in one line: checkpoint_weights.py's module
    # docstring. transformers' own load (load_state_dict(strict=False)) leaves what it does not find at its initial
    # value (transformers#48805, empty or partial files); a model sharded at load time keeps its optimizer in shards.
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """No batch, and the stop, for a run resumed at or past its last step (seam entry ``resume_at_max_steps``)."""
        if stop_if_resumed_complete(self):
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not restore_trainer_weights(self, resume_from_checkpoint, model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        assert self.state.best_model_checkpoint is not None  # the Trainer calls this only when there is one
        if not restore_trainer_weights(self, self.state.best_model_checkpoint):
            super()._load_best_model()

    def _save_optimizer_and_scheduler(self, output_dir):
        save_training_state(self, output_dir, super()._save_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with self._optimizer_load_context(checkpoint):  # PR2: its checks first, its predictors' state after
            restore_training_state(self, checkpoint, super()._load_optimizer_and_scheduler)

    def _optimizer_load_context(self, checkpoint: str | None) -> contextlib.AbstractContextManager:
        """Hook: a context around loading a checkpoint's optimizer and scheduler, whichever engine does (PR2's
        checkpoint checks and predictors, ``pr2/trainer_mixin.py``); none here."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ micro-batch replay lifecycle
    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            with self._training_step_context():
                return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._end_micro_batch()  # only now: the backward (and any recompute in it) has returned

    def _training_step_context(self) -> contextlib.AbstractContextManager:
        """Hook: a context around TRL's ``training_step`` (PR2's optimizer-step window and gradient averaging,
        ``pr2/trainer_mixin.py``); none here."""
        return contextlib.nullcontext()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        finally:
            self._end_micro_batch()

    def _end_micro_batch(self) -> None:
        """Let go of the micro-batch's replayed routes (no-op when none are held); log threshold replay's replace rate
        of the forwards replayed since the last micro-batch (old-logprob, reference, training)."""
        if self._micro_replay is not None:
            self._micro_replay.end()
        self._log_replace_rate()

    # ------------------------------------------------------------------ metrics
    def _metrics_mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _log_logprob_mismatch(
        self, sampling: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, *, as_rate: bool = False
    ) -> None:
        """``mismatch/*``: the sampler's against the trainer's log-probs over ``mask`` (``metrics.py``)."""
        sums = logprob_mismatch_sums(sampling, trainer, mask, self.replay_settings.extreme_token_threshold)
        log_ratio_metrics(
            self._metrics[self._metrics_mode()], self.accelerator, sums, MISMATCH_RATIOS, as_rate=as_rate
        )

    def _log_replace_rate(self) -> None:
        """``routing/replace_rate`` (and ``routing/replace_rate/layer_<i>``): under threshold replay, the share of
        replayed (position, MoE layer, slot) choices the trainer's router rejected and refilled from its own top-k."""
        rr = self._route_replay
        if rr is None or not self.replay_settings.replay_score_threshold:
            return
        per_layer = rr.take_replace_sums()
        if not per_layer:  # every rank replays the same forwards: none replayed here, none anywhere
            return
        device = next(iter(per_layer.values())).device  # a model split over devices: its layers' counts meet here
        total = torch.stack([counts.to(device) for counts in per_layer.values()]).sum(dim=0)
        sums = {"replaced": total[0], "slots": total[1]}
        ratios = {REPLACE_RATE: ("replaced", "slots")}
        for layer, counts in sorted(per_layer.items()):
            sums[f"replaced_{layer}"], sums[f"slots_{layer}"] = counts[0], counts[1]
            ratios[f"{REPLACE_RATE}/layer_{layer}"] = (f"replaced_{layer}", f"slots_{layer}")
        log_ratio_metrics(
            self._metrics[self._metrics_mode()],
            self.accelerator,
            sums,
            ratios,
            as_rate=self.replay_settings.trainer is TrainerKind.ASYNC,
        )

    def _log_routing_agreement(
        self, natural: torch.Tensor | None, reference: torch.Tensor, positions: torch.Tensor, *, as_rate: bool = False
    ) -> None:
        """``routing/*``: the trainer's ``natural`` top-k against the engine's (``reference``) at ``positions``;
        without a natural routing to compare (``None``), the fallback fraction alone. NaN where nothing counted."""
        metrics = self._metrics[self._metrics_mode()]
        assert self._route_replay is not None  # routes are compared only where the trainer records them
        moe_layers = self._route_replay.moe_layers
        # routing/fallback_samples_frac: the samples the intake aligned since the last log, and those that fell back whole
        samples = self._route_intake.take_sample_sums() if self._route_intake is not None else {}
        if natural is None:
            log_ratio_metrics(
                metrics,
                self.accelerator,
                {**fallback_sums(reference, positions, moe_layers), **samples},
                FALLBACK_RATIOS,
                as_rate=as_rate,
            )
            return
        sums = {**routing_agreement_sums(natural, reference, positions, moe_layers), **samples}
        log_ratio_metrics(metrics, self.accelerator, sums, {**AGREEMENT_RATIOS, **FALLBACK_RATIOS}, as_rate=as_rate)
