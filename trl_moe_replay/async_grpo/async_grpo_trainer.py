"""``MoEReplayAsyncGRPOTrainer``: TRL's ``AsyncGRPOTrainer`` with R3 (routes tagged with the version that sampled them).

How the routes travel (docs/async.md has the picture; ``core/route_flow.py`` the shared steps):

1. Rollout child (``async_rollout_worker.py``): every ``/v1/completions`` choice's ``routed_experts`` is decoded to
   its compact dtype and kept per turn; each training row (``RoutedRolloutSample``) carries the turns that produced its
   tokens, through TRL's ``mp.Queue``, next to TRL's ``model_version`` tag.
2. Trainer, main process, as the sample leaves the queue (``_RoutedQueueDataset``): the turns go through the one entry
   point, ``RouteIntake.align`` (per-sample fallback, first-batch rule), as a batch of one with the row's own widths:
   the sample's ``CheckedRoutes``, an opaque value in its dict.
3. Packing (``RoutedTreeRow``): samples share a prefix position only where their tokens and their routes agree, so
   every packed position has exactly one route: its samples' own. ``pack()`` lays the checked routes onto packed
   positions (checked by construction); the collator keeps the main process's row in the trainer's ``RouteBuffer``
   and the batch carries its ``route_rows``.
4. ``compute_loss``: the row's routes are gathered from the buffer and replayed in the training forward; they stay in
   force until its backward has returned (gradient checkpointing recomputes the routers there); the natural top-k is
   recorded in the same forward for ``routing/*``, the log-probs for ``mismatch/*``. With several processes, TRL's
   dispatcher broadcasts the collated batch from the main process: the other ranks' rows cross a process boundary as
   ``replay_routes`` tensors and are checked in full where they enter their rank.

With ``routing_replay="none"`` (and no ``routing_metrics``) nothing of this is built: it is TRL's trainer.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import logging

from ..core.launch import checked_model_name
from ..core.model_card import write_model_card
from ..core.route_flow import ROUTE_ROWS, MicroBatchReplay, RouteBuffer
from ..core.routing_options import TrainerKind, option, resolve_weight_sync
from ..core.trainer_base import MoEReplayTrainerMixin
from ..parallel.expert_parallel import check_sharded_at_load, sharded_at_load_construction
from ..rollouts.route_intake import RouteIntake
from ..rollouts.route_source import RouteSourceProtocol
from ..routing.routes import CheckedRoutes, check_routes
from ..upstream import (
    AsyncGRPOTrainer,
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    async_adapter_only_sync,
    async_trainer_globals,
    batcher_rows,
    pad,
    tree_attention_kernel,
    worker_loop_kwargs,
)
from ..weight_sync.sync_check import async_trainer_check
from ..weight_sync.weight_reload import ReloadWeightTransfer, async_trainer_weight_transfer
from .async_grpo_config import MoEReplayAsyncGRPOConfig
from .async_rollout_worker import RoutedAsyncRolloutWorker, SampleRoutes
from .packing import RoutedTreeRow, TorchVarlenAttention


logger = logging.get_logger(__name__)

__all__ = ["MoEReplayAsyncGRPOTrainer", "cpu_tree_attention"]


def cpu_tree_attention() -> contextlib.AbstractContextManager:
    """Within the context, TRL's packed tree attention runs without a GPU (pure torch, per segment); TRL's
    FlashAttention-3 lookup is back in place on exit (the trainer holds it only while it trains)."""
    return tree_attention_kernel(TorchVarlenAttention)


def _no_peak_flops(*args, **kwargs) -> None:
    return None  # TRL's lookup asks CUDA for the device name; off CUDA there is no MFU to report


def _version_problem(version: Any, current: int) -> str | None:
    """Why a sample's ``model_version`` cannot be the policy version that sampled it, or ``None``."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        return f"model_version {version!r} is not an integer"
    if not 0 <= int(version) <= current:  # int: exact for an Integral
        return f"model_version {version} is outside 0..{current}, the versions this trainer has published"
    return None


class _LastTakenQueue:
    """TRL's queue, remembering the sample last taken: ``RolloutQueueDataset.__iter__`` yields right after it
    (seam entry ``async_trainer_globals``), so it is the sample behind the dict just yielded.

    It also drops, before TRL sees them, samples whose ``model_version`` the trainer never published (not an integer,
    negative, or newer than its current version): their lag and staleness would be nonsense (a version 10**9 gave a
    lag of -62,499,999) and whatever sampled them is not this run's policy. Each is counted in
    ``sample/dropped_bad_version_total``, with a warning; the run goes on."""

    def __init__(self, inner):
        self.inner = inner
        self.last = None
        self.version_fn: Callable[[], int] | None = None  # set by the dataset: the trainer's current version
        self.metrics = None
        self.dropped_bad_version = 0

    def get(self, *args, **kwargs):
        while True:
            sample = self.inner.get(*args, **kwargs)
            problem = None if self.version_fn is None else _version_problem(sample.model_version, self.version_fn())
            if problem is None:
                self.last = sample
                return sample
            self.dropped_bad_version += 1
            if self.metrics is not None:
                self.metrics["sample/dropped_bad_version_total"].append(1.0)
            logger.warning(f"dropping a rollout sample: its {problem} (a confused or foreign rollout worker?)")

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _RoutedQueueDataset(RolloutQueueDataset):
    """TRL's queue dataset, adding each sample's checked ``replay_routes`` and its ``model_version``."""

    def __init__(self, rollout_queue, *args, align: Callable[[Any], CheckedRoutes], **kwargs):
        super().__init__(_LastTakenQueue(rollout_queue), *args, **kwargs)
        self._align = align
        self.queue.version_fn, self.queue.metrics = self.model_version_fn, self.metrics

    def __iter__(self):
        for item in super().__iter__():
            # TRL checks the worker only when the queue runs dry; a dead worker then leaves the run training on its
            # last buffered samples for a while before it fails. Checked per sample (a waitpid), it fails at once.
            self.check_health_fn(self.stale_after_s)
            sample = self.queue.last
            item["replay_routes"] = self._align(sample)
            item["model_version"] = sample.model_version
            yield item


class _RoutedRows:
    """Mixed into TRL's two batchers: their rows are ``row_class`` (rows that carry routes), built by TRL's own
    ``__iter__`` (seam entry ``async_batcher_rows``: TRL's module global ``TreeRow`` is never replaced)."""

    def __init__(self, *args, row_class, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_class = row_class

    def __iter__(self):
        return batcher_rows(super().__iter__, self.row_class)  # type: ignore[misc]  # the batcher's, mixed in after


class _RoutedFixedCountBatcher(_RoutedRows, FixedCountBatcher):
    pass


class _RoutedTokenBudgetBatcher(_RoutedRows, TokenBudgetBatcher):
    pass


class _RoutedCollator(DataCollatorForRollout):
    """TRL's collator; keeps the main process's packed routes in the trainer's buffer (the batch carries their
    ``route_rows``; with several processes, the other rows' routes as ``replay_routes``), and logs the version lag of
    the micro-batch's routed samples."""

    def __init__(self, *args, version_fn: Callable[[], int], route_buffer: RouteBuffer, **kwargs):
        super().__init__(*args, **kwargs)
        self.version_fn = version_fn
        self.route_buffer = route_buffer

    def torch_call(self, examples):
        (rows,) = examples
        batch = super().torch_call(examples)
        # row i goes to rank i (TRL's DataLoaderDispatcher); rank 0, the main process, is this one
        own = self.route_buffer.store(rows[0].packed_routes)
        batch[ROUTE_ROWS] = torch.cat([own, torch.full((len(rows) - 1, 2), -1, dtype=own.dtype)])
        if len(rows) > 1:  # the other ranks' rows cross a process boundary: as tensors, checked where they enter
            batch["replay_routes"] = pad([row.packed_routes.tensor()[0] for row in rows], padding_value=0)
        version = self.version_fn()
        lags = [
            version - sample["model_version"]
            for row in rows
            for sample in row.samples
            if sample.get("replay_routes") is not None and bool(sample["replay_routes"].has_route().any())
        ]
        if lags:
            self.metrics["routing/version_lag_mean"].append(sum(lags) / len(lags))
            self.metrics["routing/version_lag_max"].append(float(max(lags)))
        versions = {sample["model_version"] for row in rows for sample in row.samples}
        self.metrics["routing/batch_versions_max"].append(float(len(versions)))
        return batch


class MoEReplayAsyncGRPOTrainer(MoEReplayTrainerMixin, AsyncGRPOTrainer):
    """TRL's ``AsyncGRPOTrainer`` with R3 for Mixture-of-Experts models (see the module docstring).

    Same constructor as ``trl.experimental.async_grpo.AsyncGRPOTrainer``; configure it with
    [`MoEReplayAsyncGRPOConfig`]. Swapping two imports is the whole change::

        from trl_moe_replay import MoEReplayAsyncGRPOTrainer as AsyncGRPOTrainer
        from trl_moe_replay import MoEReplayAsyncGRPOConfig as AsyncGRPOConfig

    Off CUDA (no CUDA, or ``use_cpu=True``) it also runs on CPU: the packed tree attention in plain torch (only while
    ``train()`` runs), no MFU lookup, and (``vllm_weight_sync`` "auto") weights synced by vLLM's reload instead of NCCL.
    """

    _tag_names = ["trl", "async-grpo", "moe-routing-replay"]
    _name = "MoE Replay Async GRPO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        # a configuration this trainer cannot run is refused before the model is looked at
        model = checked_model_name(model, args)  # a mistyped path or unreachable Hub id: one line; `~` expanded
        if args is None:
            args = MoEReplayAsyncGRPOConfig(f"{str(model).split('/')[-1]}-AsyncGRPO")
        settings = self.replay_settings = self._resolve_replay_settings(args, TrainerKind.ASYNC)  # + launch precision
        mode = settings.mode
        carries_routes = settings.carries_routes
        # the device the trainer will train on, not whether the machine has CUDA: use_cpu on a CUDA machine is CPU
        on_cpu = args.device.type != "cuda"
        self._on_cpu = on_cpu
        if weight_transfer is None:
            method = resolve_weight_sync(args, mode, settings.routing_metrics, TrainerKind.ASYNC)
            weight_transfer = async_trainer_weight_transfer(method, args)
        swaps: dict[str, Any] = {}
        if on_cpu:
            swaps["get_peak_flops_per_device"] = _no_peak_flops  # TRL asks CUDA for the name of the trainer's device
        if carries_routes:
            swaps["AsyncRolloutWorker"] = RoutedAsyncRolloutWorker  # TRL builds it when no rollout_worker is given
        # expert parallelism (distributed_config): as in the sync trainer; TRL streams each DTensor's full_tensor()
        with async_trainer_globals(**swaps), sharded_at_load_construction(args, model):
            super().__init__(
                model,
                reward_funcs,
                args,
                train_dataset,
                processing_class,
                callbacks,
                optimizers,
                peft_config,
                tools,
                environment_factory,
                rollout_worker,
                weight_transfer,
            )
        check_sharded_at_load(self)  # a PEFT adapter on such a model: refused in one line
        self._check_after_trl(adapter_only_sync=async_adapter_only_sync(self))  # PEFT, the launch's engine

        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        if isinstance(self.weight_transfer, ReloadWeightTransfer) and self.weight_transfer.model is None:
            self.weight_transfer.model = base  # names the checkpoint layout vLLM loads
        self._carries_routes = carries_routes
        self._route_replay = self._new_route_replay(unwrapped) if carries_routes else None
        self._route_intake = None
        self._route_buffer = RouteBuffer()
        self._micro_replay = MicroBatchReplay()  # a packed row's routes, from its training forward through backward
        self.aux_loss_enabled = self._aux_loss_under_replay()
        self._sync_check = None
        if weight_transfer is not None or not async_adapter_only_sync(self):  # the main process has a transfer
            self._sync_check = async_trainer_check(
                settings.vllm_sync_check,
                accelerator=self.accelerator,
                base_url=args.vllm_server_base_url,
                tolerance=option(args, "sync_check_tolerance"),
            )
        self._hold_run()  # the output-dir lock, the update probe
        if not carries_routes:
            return
        attempts = option(args, "vllm_request_attempts")
        if isinstance(self.rollout_worker, RoutedAsyncRolloutWorker) and attempts is not None:
            worker_loop_kwargs(self.rollout_worker)["max_request_attempts"] = attempts
        # samples are aligned one by one as they leave the queue: the intake's batch is an optimizer step's worth
        samples_per_step = (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        )
        self._route_intake = RouteIntake(
            _MainProcessOnly(self.accelerator),
            source=self._route_source.name,
            required=mode.needs_engine_routes,
            remedy=self._route_source.remedy,
            batch_samples=samples_per_step,
            max_fallback_batches=option(args, "max_route_fallback_steps"),
        )

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):  # type: ignore[override]  # TRL's
        """TRL's model card, with the routing mode (name and tag) and the citations of the methods used."""
        return write_model_card(self, super().create_model_card, model_name, dataset_name, tags)

    def _train_context(self) -> contextlib.AbstractContextManager:
        """``MoEReplayTrainerMixin.train``'s hook: the packed tree attention in plain torch off CUDA."""
        return cpu_tree_attention() if self._on_cpu else contextlib.nullcontext()

    # ------------------------------------------------------------------ rollout samples -> rows
    @property
    def _route_source(self) -> RouteSourceProtocol:
        """Where the samples' routes come from: the rollout worker, where it is a route source (ours is), else the
        turns its samples carry."""
        worker = getattr(self, "rollout_worker", None)
        return worker if isinstance(worker, RouteSourceProtocol) else SampleRoutes()

    def _align_sample(self, sample) -> CheckedRoutes:
        """One sample's engine turns -> its ``[1, len(input_ids), L, K]`` checked routes, through the route source and
        the one entry point."""
        input_ids = list(sample.input_ids)
        length = len(input_ids)
        prompt = getattr(sample, "route_prompt_length", 0) or 0
        rr, intake = self._route_replay, self._route_intake
        assert rr is not None and intake is not None  # built by __init__ wherever samples carry routes
        rollout = self._route_source.rollout_turns(
            [input_ids[:prompt]], [input_ids[prompt:]], {"route_turns": getattr(sample, "route_turns", None)}
        )
        if rollout is None:
            turns, prompt = [_no_rows(length)], length  # "no routes": counted as a fallback by the intake
        else:
            (turns,) = rollout.turns
        return intake.align(
            [turns],
            rr.layout,
            prompt_lengths=[prompt],
            completion_lengths=[length - prompt],
            prompt_width=prompt,
            completion_width=length - prompt,
        )

    def get_train_dataloader(self):
        if not self._carries_routes:
            return super().get_train_dataloader()
        assert self._route_replay is not None  # built by __init__ wherever routes are carried
        row_class = RoutedTreeRow.for_layout(self._route_replay.layout)
        swaps = {
            "RolloutQueueDataset": _bind(_RoutedQueueDataset, align=self._align_sample),
            "FixedCountBatcher": _bind(_RoutedFixedCountBatcher, row_class=row_class),
            "TokenBudgetBatcher": _bind(_RoutedTokenBudgetBatcher, row_class=row_class),
            "DataCollatorForRollout": _bind(
                _RoutedCollator, version_fn=lambda: self.model_version, route_buffer=self._route_buffer
            ),
        }
        with async_trainer_globals(**swaps):
            return super().get_train_dataloader()

    # ------------------------------------------------------------------ training forward
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        route_rows = inputs.pop(ROUTE_ROWS, None)
        shipped = inputs.pop("replay_routes", None)
        expected = inputs.pop("route_expected", None)
        if self._route_replay is None or route_rows is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        rr = self._route_replay
        mask = inputs["attention_mask"].bool()
        if self.accelerator.is_main_process:  # its own row: held by the trainer since packing
            routes = self._route_buffer.gather(route_rows.cpu(), take=True)
        else:  # a row that came over the wire from the main process: checked in full where it enters this rank
            routes = check_routes(shipped[mask][None].cpu(), rr.layout)
        expected = expected[mask][None]  # [1, N]: the packed row's positions an engine forwarded
        # the collator holds every packed row's CheckedRoutes; __init__ built the micro-batch replay
        assert routes is not None and self._micro_replay is not None
        log_probs: list[torch.Tensor] = []
        handle = model.register_forward_hook(lambda module, args, output: log_probs.append(output.log_probs.detach()))
        # replayed in force through the backward: training_step ends it
        replay = self._micro_replay.replay(rr, routes) if self.routing_replay.replays else contextlib.nullcontext()
        try:
            with replay, rr.record() as recording:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            handle.remove()
        assert recording.checked is not None  # the training forward ran inside record(): its routes are set
        self._log_route_metrics(recording.checked, routes, expected, inputs, log_probs)
        return loss

    def _log_route_metrics(self, natural: CheckedRoutes, routes: CheckedRoutes, expected, inputs, log_probs) -> None:
        """``routing/*`` and ``mismatch/*`` of one training forward, as rates over the logging window (the sync
        trainer's code: ``MoEReplayTrainerMixin``)."""
        self._log_routing_agreement(natural.tensor(), routes.tensor(), expected, as_rate=True)
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        sampling = inputs["old_log_probs"][selected]
        trainer = log_probs[0].flatten()[token_index] if log_probs else torch.full_like(sampling, float("nan"))
        self._log_logprob_mismatch(sampling, trainer, torch.ones_like(sampling), as_rate=True)

    # ------------------------------------------------------------------ resume
    # ------------------------------------------------------------------ weight sync
    def _sync_weight(self):
        self._checked_weight_sync(super()._sync_weight, "train")


def _no_rows(length: int):
    from ..routing.codec import EngineTurn

    return EngineTurn(None, length, 0, 0)


def _bind(cls, **extra):
    """``cls`` with ``extra`` keyword arguments bound, usable where TRL calls the class by its name."""

    def build(*args, **kwargs):
        return cls(*args, **kwargs, **extra)

    return build


class _MainProcessOnly:
    """The accelerator as seen by code that runs on the main process alone (TRL's queue dataset): nothing to gather."""

    def __init__(self, accelerator):
        self.device = accelerator.device

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor
