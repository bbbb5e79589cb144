"""``MoEReplayAsyncGRPOTrainer``: TRL's ``AsyncGRPOTrainer`` with R3 (routes tagged with the version that sampled them).

How the routes travel (docs/async.md has the picture):

1. Rollout child (``engines/async_rollout.py``): every ``/v1/completions`` choice's ``routed_experts`` is decoded to
   its compact dtype and kept per turn; each training row (``RoutedRolloutSample``) carries the turns that produced its
   tokens, through TRL's ``mp.Queue``, next to TRL's ``model_version`` tag.
2. Trainer, main process, as the sample leaves the queue (``_RoutedQueueDataset``): the turns go through the one entry
   point, ``RouteIntake.align`` (per-sample fallback, first-batch rule), as a batch of one with the row's own widths:
   ``replay_routes`` ``[len(input_ids), L, K]``.
3. Packing (``RoutedTreeRow``): samples share a prefix position only where their tokens and their routes agree, so
   every packed position has exactly one route: its samples' own. ``pack()`` lays the routes onto packed positions
   and flags a row built only from routes the intake checked (``replay_routes_checked``).
4. ``compute_loss``: the row's routes are replayed in the training forward (a flagged row is not checked again)
   and stay in force until its backward has returned (gradient checkpointing recomputes the routers there); the
   natural top-k is recorded in the same forward for ``routing/*``, the log-probs for ``mismatch/*``.

With ``routing_replay="none"`` (and no ``routing_metrics``) nothing of this is built: it is TRL's trainer.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import logging
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
)

from ..engines.async_rollout import RoutedAsyncRolloutWorker
from ..engines.sync_check import build_sync_check, checked_weight_sync
from ..engines.weight_reload import ReloadWeightTransfer, build_weight_sync
from ..engines.route_intake import RouteIntake
from ..routing import RouterReplay
from ..routing.routes import has_route, mark_checked, route_dtype
from ..upstream import (
    assert_async_trl_compatible,
    async_adapter_only_sync,
    async_trainer_globals,
    quiet_upstream_notices,
    tree_attention_kernel,
    worker_loop_kwargs,
)
from .async_grpo_config import MoEReplayAsyncGRPOConfig
from .expert_parallel import refuse_async_sharded_at_load
from .async_packing import RoutedTreeRow, TorchVarlenAttention
from .checkpoint_weights import RestoresEveryWeight
from .launch import checked_model_name
from .metrics import logprob_mismatch_sums, routing_agreement_sums
from .peft_replay import check_peft_replay

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
    if not 0 <= version <= current:
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
    """TRL's queue dataset, adding each sample's aligned ``replay_routes`` and its ``model_version``."""

    def __init__(self, rollout_queue, *args, align: Callable[[Any], torch.Tensor | None], **kwargs):
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


def _scoped_rows(make_iterator: Callable[[], Any], row_class: Callable[[], Any]):
    """Iterate a TRL batcher with its ``TreeRow`` replaced by ``row_class`` only while the batcher's own code runs."""
    iterator = None
    while True:
        with async_trainer_globals(TreeRow=row_class):
            if iterator is None:
                iterator = make_iterator()
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


class _RoutedFixedCountBatcher(FixedCountBatcher):
    def __init__(self, *args, row_class, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_class = row_class

    def __iter__(self):
        return _scoped_rows(super().__iter__, self.row_class)


class _RoutedTokenBudgetBatcher(TokenBudgetBatcher):
    def __init__(self, *args, row_class, **kwargs):
        super().__init__(*args, **kwargs)
        self.row_class = row_class

    def __iter__(self):
        return _scoped_rows(super().__iter__, self.row_class)


class _RoutedCollator(DataCollatorForRollout):
    """TRL's collator; also logs the version lag of the micro-batch's routed samples."""

    def __init__(self, *args, version_fn: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self.version_fn = version_fn

    def torch_call(self, examples):
        (rows,) = examples
        batch = super().torch_call(examples)
        version = self.version_fn()
        lags = [version - sample["model_version"] for row in rows for sample in row.samples
                if sample.get("replay_routes") is not None and bool(has_route(sample["replay_routes"]).any())]
        if lags:
            self.metrics["routing/version_lag_mean"].append(sum(lags) / len(lags))
            self.metrics["routing/version_lag_max"].append(float(max(lags)))
        versions = {sample["model_version"] for row in rows for sample in row.samples}
        self.metrics["routing/batch_versions_max"].append(float(len(versions)))
        return batch


class MoEReplayAsyncGRPOTrainer(RestoresEveryWeight, AsyncGRPOTrainer):
    """TRL's ``AsyncGRPOTrainer`` with R3 for Mixture-of-Experts models (see the module docstring).

    Same constructor as ``trl.experimental.async_grpo.AsyncGRPOTrainer``; configure it with
    [`MoEReplayAsyncGRPOConfig`]. Swapping two imports is the whole change::

        from trl_moe_replay import MoEReplayAsyncGRPOTrainer as AsyncGRPOTrainer
        from trl_moe_replay import MoEReplayAsyncGRPOConfig as AsyncGRPOConfig

    Off CUDA (no CUDA, or ``use_cpu=True``) it also runs on CPU: the packed tree attention in plain torch (only while
    ``train()`` runs), no MFU lookup, and (``vllm_weight_sync`` "auto") weights synced by vLLM's reload instead of NCCL.
    """

    _tag_names = ["trl", "async-grpo", "moe-routing-replay"]

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, processing_class=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, tools=None, environment_factory=None, rollout_worker=None,
                 weight_transfer=None):
        # a configuration this trainer cannot run is refused before the model is looked at
        refuse_async_sharded_at_load(args, model)  # expert parallelism (distributed_config): one-line refusal
        model = checked_model_name(model, args)  # a mistyped path or unreachable Hub id: one line; `~` expanded
        if args is None:
            args = MoEReplayAsyncGRPOConfig(f"{str(model).split('/')[-1]}-AsyncGRPO")
        assert_async_trl_compatible()
        quiet_upstream_notices()
        self.routing_replay = getattr(args, "routing_replay", "r3")
        carries_routes = getattr(args, "carries_routes", self.routing_replay != "none")
        # the device the trainer will train on, not whether the machine has CUDA: use_cpu on a CUDA machine is CPU
        on_cpu = args.device.type != "cuda"
        self._on_cpu = on_cpu
        if weight_transfer is None:
            weight_transfer = build_weight_sync(args, asynchronous=True)
        swaps: dict[str, Any] = {}
        if on_cpu:
            swaps["get_peak_flops_per_device"] = _no_peak_flops  # TRL asks CUDA for the name of the trainer's device
        if carries_routes:
            swaps["AsyncRolloutWorker"] = RoutedAsyncRolloutWorker  # TRL builds it when no rollout_worker is given
        with async_trainer_globals(**swaps):
            super().__init__(model, reward_funcs, args, train_dataset, processing_class, callbacks, optimizers,
                             peft_config, tools, environment_factory, rollout_worker, weight_transfer)

        unwrapped = self.accelerator.unwrap_model(self.model)
        check_peft_replay(unwrapped, self.routing_replay, adapter_only_sync=async_adapter_only_sync(self))
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        if isinstance(self.weight_transfer, ReloadWeightTransfer) and self.weight_transfer.model is None:
            self.weight_transfer.model = base  # names the checkpoint layout vLLM loads
        self._carries_routes = carries_routes
        self._route_replay = RouterReplay(unwrapped) if carries_routes else None
        self._route_intake = None
        self._train_replay = contextlib.ExitStack()
        self._sync_check = None
        if weight_transfer is not None or not async_adapter_only_sync(self):  # the main process has a transfer
            self._sync_check = build_sync_check(args, asynchronous=True, accelerator=self.accelerator,
                                                base_url=args.vllm_server_base_url)
        if not carries_routes:
            return
        attempts = getattr(args, "vllm_request_attempts", None)
        if isinstance(self.rollout_worker, RoutedAsyncRolloutWorker) and attempts is not None:
            worker_loop_kwargs(self.rollout_worker)["max_request_attempts"] = attempts
        rr = self._route_replay
        self._route_shape = (rr.num_layers, rr.top_k)
        self._route_dtype = route_dtype(rr.num_experts, rr.top_k)
        self._route_layout = dict(num_layers=rr.num_layers, top_k=rr.top_k, num_experts=rr.num_experts,
                                  layers=rr.moe_layers)  # what RouterReplay.replay checks routes for
        # samples are aligned one by one as they leave the queue: the intake's batch is an optimizer step's worth
        samples_per_step = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                            * self.accelerator.num_processes)
        self._route_intake = RouteIntake(
            _MainProcessOnly(self.accelerator), source="vLLM", required=self.routing_replay == "r3",
            remedy="Is the server started with --enable-return-routed-experts and serving the trainer's checkpoint?",
            batch_samples=samples_per_step, max_fallback_batches=getattr(args, "max_route_fallback_steps", None),
        )
        if self.routing_replay == "r3" and self.aux_loss_enabled:
            logger.warning(
                "Router load-balancing aux loss turned OFF under routing replay: transformers' loss recounts the "
                "router's natural top-k, not the replayed experts, so it would balance routes that are not used."
            )
            self.aux_loss_enabled = False

    def train(self, *args, **kwargs):
        with cpu_tree_attention() if self._on_cpu else contextlib.nullcontext():
            return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ rollout samples -> rows
    def _align_sample(self, sample) -> torch.Tensor | None:
        """One sample's engine turns -> its ``[len(input_ids), L, K]`` routes, through the one entry point."""
        turns = list(getattr(sample, "route_turns", None) or [])
        length = len(sample.input_ids)
        prompt = getattr(sample, "route_prompt_length", 0) or 0
        rr = self._route_replay
        if not turns:
            turns, prompt = [_no_rows(length)], length  # "no routes": counted as a fallback by the intake
        routes = self._route_intake.align(
            [turns], prompt_lengths=[prompt], completion_lengths=[length - prompt], prompt_width=prompt,
            completion_width=length - prompt, num_layers=rr.num_layers, top_k=rr.top_k, moe_layers=rr.moe_layers,
            num_experts=rr.num_experts,
        )
        return routes[0]

    def get_train_dataloader(self):
        if not self._carries_routes:
            return super().get_train_dataloader()
        swaps = {
            "RolloutQueueDataset": _bind(_RoutedQueueDataset, align=self._align_sample),
            "FixedCountBatcher": _bind(_RoutedFixedCountBatcher, row_class=self._new_row),
            "TokenBudgetBatcher": _bind(_RoutedTokenBudgetBatcher, row_class=self._new_row),
            "DataCollatorForRollout": _bind(_RoutedCollator, version_fn=lambda: self.model_version),
        }
        with async_trainer_globals(**swaps):
            return super().get_train_dataloader()

    def _new_row(self) -> RoutedTreeRow:
        return RoutedTreeRow(self._route_shape, self._route_dtype, self._route_layout)

    # ------------------------------------------------------------------ training forward
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        routes = inputs.pop("replay_routes", None)
        expected = inputs.pop("route_expected", None)
        checked = inputs.pop("replay_routes_checked", None)
        if self._route_replay is None or routes is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mask = inputs["attention_mask"].bool()
        routes, expected = routes[mask][None], expected[mask][None]  # [1, N, L, K], [1, N]: the packed row
        if checked is not None and bool(checked.all()):
            # RoutedTreeRow.pack built the row from routes checked where they entered and said so; the collator's
            # padding, accelerate's dispatch (a concatenation, a copy to the device) and the mask above copy the
            # row unchanged, so the copy is marked checked too: replay() costs an O(1) look-up, no host pass.
            mark_checked(routes, **self._route_layout)
        rr = self._route_replay
        if self.routing_replay == "r3":  # in force through the backward: training_step closes it (no grad: below)
            self._train_replay.enter_context(rr.replay(routes))
        log_probs: list[torch.Tensor] = []
        handle = model.register_forward_hook(lambda module, args, output: log_probs.append(output.log_probs.detach()))
        try:
            with rr.record() as recording:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            handle.remove()
            if not torch.is_grad_enabled():
                self._train_replay.close()
        self._log_route_metrics(recording.routes, routes, expected, inputs, log_probs)
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._train_replay.close()  # only now: the backward (and any recompute in it) has returned

    def _log_route_metrics(self, natural, routes, expected, inputs, log_probs) -> None:
        metrics = self._metrics["train"]
        device = self.accelerator.device
        agreement = routing_agreement_sums(natural, routes, expected, self._route_replay.moe_layers)
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        sampling = inputs["old_log_probs"][selected]
        trainer = log_probs[0].flatten()[token_index] if log_probs else torch.full_like(sampling, float("nan"))
        mismatch = logprob_mismatch_sums(sampling, trainer, torch.ones_like(sampling),
                                          getattr(self.args, "extreme_token_threshold", 2.0))
        sums = {**{f"routing.{k}": v for k, v in agreement.items()}, **{f"mismatch.{k}": v for k, v in mismatch.items()}}
        names = list(sums)
        total = self.accelerator.reduce(torch.stack([sums[n].float().to(device) for n in names]), reduction="sum")
        total = dict(zip(names, total.tolist(), strict=True))
        # (numerator, denominator) pairs: TRL's log reduces them as a rate over the logging window
        metrics["routing/fallback_frac"].append((total["routing.fallback_positions"], total["routing.positions"]))
        if total["routing.pairs"] > 0:
            metrics["routing/mismatch_frac"].append((total["routing.mismatch_pairs"], total["routing.pairs"]))
            metrics["routing/topk_agreement"].append((total["routing.overlap"], total["routing.pairs"]))
            metrics["routing/token_any_mismatch"].append(
                (total["routing.tokens_any_mismatch"], total["routing.tokens"]))
        if total["mismatch.tokens"] > 0:
            for name in ("kl_k1", "kl_k3"):
                metrics[f"mismatch/{name}"].append((total[f"mismatch.{name}"], total["mismatch.tokens"]))
            metrics["mismatch/extreme_frac"].append((total["mismatch.extreme"], total["mismatch.tokens"]))

    # ------------------------------------------------------------------ resume
    # ------------------------------------------------------------------ weight sync
    def _sync_weight(self):
        checked_weight_sync(self._sync_check, super()._sync_weight, self.accelerator.unwrap_model(self.model),
                            self.accelerator, self._metrics["train"])


def _no_rows(length: int):
    from ..routing.engine import EngineTurn

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

