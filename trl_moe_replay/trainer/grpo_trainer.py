"""``MoEReplayGRPOTrainer``: TRL's ``GRPOTrainer`` with expert-routing replay (R2/R3/PR2) and mismatch metrics.

The overrides are thin; the routing work lives in ``trl_moe_replay.routing``, and the routes' path through the
trainer, from intake to every forward, in ``trl_moe_replay.core.route_flow`` (read it top to bottom). Per
generation batch:

1. ``_generate_single_turn`` (transformers path): ``generate`` runs inside a ``TransformersRolloutRecorder``,
   which records the routes and the sampling log-probs, like an inference engine would return them. With vLLM
   (server or colocate), ``rollouts/vllm_routes.py`` keeps the ``routed_experts`` vLLM returns, this rank's only.
2. ``_generate``: right after generation, the engine's rows are checked once, at the widths TRL pads to
   (``GenerationBatch.align``: ``RouteIntake``, per-sample fallback, first-batch rule).
3. ``_generate_and_score_completions``: TRL's old-logprob and reference passes run through our
   ``_get_per_token_logps_and_entropies``, which does what ``RouteFlow.plan`` says (replay, record, steer); the routes
   to replay stay in the trainer's buffer and the batch dict carries their ``route_rows``.
4. ``_compute_loss``/``training_step``: each micro-batch (a ``MicroBatch`` value) gathers its rows, replays them in the
   training forward and keeps them in force until its backward has returned (gradient checkpointing recomputes the
   routers in backward; ``MoEReplayTrainerMixin.training_step`` ends it).

Three bases: ``MoEReplayTrainerMixin``, ``PR2TrainerMixin``, ``GRPOTrainer``; no TRL or transformers method is
overridden in two of our classes (tests/core/test_trainer_base.py). What both trainers share (init preamble,
aux-loss rule, output-dir lock, resume integrity, sync check, micro-batch lifecycle, metrics) is
``MoEReplayTrainerMixin`` (``trl_moe_replay.core.trainer_base``).

The loss options (``gspo``, ``rspo``, ``minirl``, router-shift weighting) are a component, ``MoEObjectives``
(``trl_moe_replay.trainer.objectives``, ``self._objectives``): this class's ``_get_per_token_logps_and_entropies``
wraps TRL's forward with its router-shift measurement in the training forward, and its ``get_gamma_weights`` and
``log`` ask it for MiniRL's weight and metric name.

PR2 (``routing_replay="pr2"``) is R2 whose old-logprob pass (or, with ``pr2_rollout_prediction``, ``generate``) routes
by the predicted routes; it lives beside the trainer in ``trl_moe_replay.pr2``, whose ``PR2TrainerMixin`` this class
mixes in and calls at its named points (``_new_pr2``, ``_pr2_generate``, ``_pr2_old_pass_chunk``,
``_pr2_on_generation_batch``) in 1. and 3., and in ``_compute_loss`` (``_with_pr2_loss``), the base's training-step
and optimizer-load hooks; its own Trainer overrides hand straight on without PR2.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import cast

import torch
from accelerate.utils import is_peft_model
from transformers.utils import logging
from trl import GRPOTrainer

from ..core.launch import checked_model_name
from ..core.metrics import global_sums, routable_positions
from ..core.model_card import write_model_card
from ..core.route_flow import (
    ROUTE_ROWS,
    Forward,
    ForwardPlan,
    GenerationBatch,
    MicroBatch,
    MicroBatchReplay,
    RouteFlow,
)
from ..core.routing_options import TrainerKind, option, resolve_weight_sync
from ..core.trainer_base import MoEReplayTrainerMixin
from ..parallel.expert_parallel import check_sharded_at_load, sharded_at_load_construction
from ..pr2.trainer_mixin import PR2TrainerMixin
from ..rollouts.hf_generate import TransformersRouteSource
from ..rollouts.route_choice import sync_trainer_engine_classes, sync_trainer_route_source
from ..rollouts.route_intake import RouteIntake
from ..rollouts.route_source import RouteSourceProtocol, TurnRequest
from ..upstream import (
    disable_gradient_checkpointing,
    engine_logprob_correction,
    is_reference_forward,
    mark_vllm_weights_synced,
    pad,
    profiling_context,
    tool_loop_samples,
    vllm_generation_classes,
    vllm_weights_stale,
)
from ..weight_sync.sync_check import sync_trainer_check
from ..weight_sync.weight_reload import WeightSyncMethod, client_without_communicator, sync_trainer_weight_sync
from .grpo_config import MoEReplayGRPOConfig, check_generation_support
from .objectives import MoEObjectives


logger = logging.get_logger(__name__)


class MoEReplayGRPOTrainer(MoEReplayTrainerMixin, PR2TrainerMixin, GRPOTrainer):
    """``GRPOTrainer`` for Mixture-of-Experts models with routing replay.

    Same constructor as ``trl.GRPOTrainer``; configure it with [`MoEReplayGRPOConfig`] (a plain ``GRPOConfig``
    gets the defaults: R3). Swapping two imports in a TRL GRPO script is the whole change::

        from trl_moe_replay import MoEReplayGRPOTrainer as GRPOTrainer, MoEReplayGRPOConfig as GRPOConfig

    With ``routing_replay="none"`` (and ``routing_metrics`` left off) it is ``GRPOTrainer`` itself: every override
    hands straight to TRL, no hook is registered, and it logs TRL's keys, no other (``routing_metrics=True`` adds the
    ``mismatch/*``, ``routing/*`` and ``precision/*`` metrics).
    """

    _tag_names = ["trl", "grpo", "moe-routing-replay"]
    _name = "MoE Replay GRPO"
    # set in __init__; class defaults keep the generation overrides usable on a trainer built without it (TRL's own
    # unit tests build one with object.__new__ and set only what TRL's methods read)
    _weight_sync = None
    _sync_check = None
    _routes: RouteFlow | None = None
    _route_source: RouteSourceProtocol | None = None
    _objectives: MoEObjectives | None = None  # the loss options (trainer/objectives.py), resolved in __init__
    _micro_batch: MicroBatch | None = None  # the micro-batch whose loss is being computed, else None
    _settle_gloo_at_end = True  # MoEReplayTrainerMixin.end: a gloo barrier before the process group goes

    def __init__(self, model, reward_funcs=None, args=None, *pos_args, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config.name_or_path
            args = MoEReplayGRPOConfig(f"{name.split('/')[-1]}-GRPO")
        model = checked_model_name(model, args)  # a mistyped path or unreachable Hub id: one line; `~` expanded
        check_generation_support(args)
        settings = self.replay_settings = self._resolve_replay_settings(args, TrainerKind.SYNC)  # + launch precision
        mode = settings.mode
        sync_method = resolve_weight_sync(args, mode, settings.routing_metrics, TrainerKind.SYNC)
        # the classes TRL's VLLMGeneration builds, chosen here (seam entry vllm_generation_classes): the engine's route
        # capture (rollouts/route_choice.py), then the weight sync's client
        vllm_classes = sync_trainer_engine_classes(args, keep_routes=settings.generation_routes)
        if args.use_vllm and args.vllm_mode == "server" and sync_method is WeightSyncMethod.RELOAD:
            vllm_classes["VLLMClient"] = client_without_communicator
        with vllm_generation_classes(**vllm_classes), sharded_at_load_construction(args, model):  # expert parallelism
            super().__init__(model, reward_funcs, args, *pos_args, **kwargs)
        check_sharded_at_load(self)  # expert parallelism: what it does not support, and full tensors to vLLM
        self._check_after_trl()  # PEFT under replay, the launch's distributed engine

        hooks_needed = settings.carries_routes or bool(option(args, "router_shift_weighting"))
        self._route_replay = (
            self._new_route_replay(self.accelerator.unwrap_model(self.model)) if hooks_needed else None
        )
        self._ref_route_replay = (
            self._new_route_replay(self.ref_model) if self.ref_model is not None and mode.replays else None
        )
        # where the rollouts' routes come from: one interface for every engine (rollouts/route_source.py)
        self._route_source = self._build_route_source(args)
        self._route_intake = self._build_route_intake() if settings.generation_routes else None
        self.aux_loss_enabled = self._aux_loss_under_replay()
        self._pr2 = self._new_pr2(args)
        vllm_generation = self.vllm_generation if args.use_vllm else None
        self._weight_sync = sync_trainer_weight_sync(
            sync_method, args, vllm_generation=vllm_generation, model=self.accelerator.unwrap_model(self.model)
        )
        self._sync_check = sync_trainer_check(
            settings.vllm_sync_check,
            accelerator=self.accelerator,
            vllm_generation=vllm_generation,
            tolerance=option(args, "sync_check_tolerance"),
        )
        self._warned_on_policy = False
        self._objectives = MoEObjectives.resolve(self, self.args, self._route_replay)
        # the routes' one state: None when there is nothing to record or replay (every override hands to TRL)
        self._routes = None
        if not self._is_plain_trl:
            self._routes = RouteFlow(
                settings,
                self._route_replay,
                self._ref_route_replay,
                pr2=self._pr2 is not None,
                router_shift=self._objectives.router_probes is not None,
            )
        self._micro_replay = MicroBatchReplay()  # a micro-batch's routes, from its training forward through backward
        self._hold_run()  # the output-dir lock, the update probe

    def _build_route_source(self, args) -> RouteSourceProtocol | None:
        """The engine's side of the routes (``rollouts/route_choice.py`` picks it from the configuration)."""
        settings = self.replay_settings
        generate_source = None
        if settings.records_generation:  # transformers generate inside the rollout recorder
            generate_source = TransformersRouteSource(
                self._route_replay if settings.generation_routes else None,
                self._generating_model,
                self.temperature,
                self._tokenizer.pad_token_id,
                return_logprobs=settings.transformers_importance_sampling_correction,
            )
        return sync_trainer_route_source(
            args,
            keep_routes=settings.generation_routes,
            required=settings.mode.needs_engine_routes,
            vllm_generation=getattr(self, "vllm_generation", None),
            accelerator=self.accelerator,
            generate_source=generate_source,
            rollout_func=self.rollout_func,
        )

    def _generating_model(self):
        """The module whose forward ``generate`` steps through (for PEFT, the base causal LM)."""
        causal_lm = self.accelerator.unwrap_model(self.model)
        return causal_lm.get_base_model() if is_peft_model(causal_lm) else causal_lm

    def _build_route_intake(self) -> RouteIntake:
        """The one entry point every engine's rows go through (per-sample fallback, first-batch rule)."""
        source = self._route_source
        assert source is not None  # the trainer keeps engine routes: some source returns them
        return RouteIntake(
            self.accelerator,
            source=source.name,
            required=self.replay_settings.mode.needs_engine_routes,
            remedy=source.remedy,
        )

    @property
    def moe_loss_type(self) -> str:
        """``loss_type`` as configured: ours (``gspo``, ``rspo``, ``minirl``) or TRL's."""
        assert self._objectives is not None  # set in __init__
        return self._objectives.loss_type

    @property
    def _is_plain_trl(self) -> bool:
        """Nothing to record or replay: every override hands straight to TRL."""
        settings = self.replay_settings
        return self._route_replay is None and not settings.records_generation and not settings.generation_routes

    def _engine_correction(self, enabled: bool = True):
        """TRL's engine log-prob correction on the transformers path, when configured (seam entry
        ``engine_logprob_correction``)."""
        if not self.replay_settings.transformers_importance_sampling_correction:
            return contextlib.nullcontext()
        return engine_logprob_correction(self, enabled)

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """One generation turn: the first of the batch, or (TRL's tool loop) a later turn of the tool-calling
        samples, prompted with their whole sequence so far. The route source runs it and returns the engine's rows,
        kept per sample and turn."""
        parent = super()._generate_single_turn
        batch = self._routes.batch if self._routes is not None else None
        source = self._route_source
        if batch is None or source is None:
            return parent(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        later_turn = batch.begin_turn()
        samples = None  # a later turn's samples: those TRL's tool loop generates it for (seam entry tool_loop_samples)
        held = None
        if later_turn:
            if batch.turns is not None:
                samples = batch.turns.match(prompt_ids, owners=tool_loop_samples(len(prompt_ids)))
                held = batch.turns.held_positions(samples)
            else:
                held = 0

        def generate():
            with self._pr2_generate():  # PR2's predicted routes in transformers generate (pr2_rollout_prediction)
                return parent(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

        output, turn = source.generate_turn(TurnRequest(prompt_ids, later_turn, held), generate)
        batch.add_turn(prompt_ids, output[0], turn.rows, turn.prompt_start, samples)
        batch.record_sampling_logprobs(turn.sampling_logprobs)
        return output

    def _generate(self, prompts):
        if self.use_vllm and (self._weight_sync or self._sync_check) and vllm_weights_stale(self):
            self._sync_vllm_weights()
        batch = self._routes.batch if self._routes is not None else None
        if batch is None:
            return super()._generate(prompts)
        with self._engine_correction(enabled=False):  # generate on the transformers path, as configured
            output = super()._generate(prompts)
        prompt_ids, completion_ids, extra_fields = output[0], output[1], output[5]
        source = self._route_source
        if source is None:
            return output
        # rows that came with the rollouts (a rollout_func's), taken out of the fields the reward functions receive
        turns = source.rollout_turns(prompt_ids, completion_ids, extra_fields)
        if turns is not None:
            batch.take_turns(turns)
        if self._route_intake is not None:  # the batch's routes enter here, once (route_flow step 2)
            assert self._route_replay is not None  # generation routes are carried routes: __init__ built it
            # GRPOConfig.__post_init__ resolves "auto": an int or None
            pad_to_multiple_of = cast(int | None, self.pad_to_multiple_of)
            batch.align(self._route_intake, self._route_replay, prompt_ids, completion_ids, pad_to_multiple_of)
        mode = self._metrics_mode()
        for name, value in source.take_metrics().items():  # e.g. vllm/route_bytes: summed over ranks
            received = torch.tensor([value], device=self.accelerator.device)
            self._metrics[mode][name].append(self.accelerator.reduce(received, "sum").item())
        return output

    def _sync_vllm_weights(self) -> None:
        """Sync the weights into vLLM before TRL would (seam entry ``vllm_sync_trigger``), by vLLM's reload or TRL's own
        sync, inside the engine sync check (``vllm_sync_check``, ``weight_sync/sync_check.py``)."""

        def sync():
            with profiling_context(self, "sync_weights"):
                if self._weight_sync is not None:
                    self._weight_sync.sync()
                else:
                    self.vllm_generation.sync_weights()
            mark_vllm_weights_synced(self)

        self._checked_weight_sync(sync, self._metrics_mode())

    def _generate_and_score_completions(self, inputs):
        if self._routes is None:  # plain TRL: its keys only (routing_metrics=True adds ours)
            return super()._generate_and_score_completions(inputs)
        mode = self._metrics_mode()
        with self._routes.generation_batch() as batch:
            with self._engine_correction():
                output = super()._generate_and_score_completions(inputs)
            if (
                self.routing_replay.records_old_pass
                and "old_per_token_logps" not in output
                and not self._warned_on_policy
            ):
                self._warned_on_policy = True
                logger.warning(
                    f"routing_replay={self.routing_replay!r} has nothing to replay here: TRL ran no old-logprob pass "
                    "for this batch, so the configuration is on-policy and every update already routes like the old "
                    "policy"
                    + (" (PR2's predictors get no training data and stay at zero)." if self._pr2 is not None else ".")
                )
            # route_flow step 4: the batch dict carries rows, not routes nor RSPO's old router nor PR2's cache (taken
            # before the metrics pass, whose recorded routes are for routing/* only)
            self._pr2_on_generation_batch(batch)
            route_rows = self._routes.store(batch, mode)
            if route_rows is not None:
                output[ROUTE_ROWS] = route_rows
            trainer_logps = None
            if self.replay_settings.routing_metrics and "old_per_token_logps" not in output:
                trainer_logps = self._metrics_pass(output, batch)
            self._log_mismatch_metrics(output, batch, trainer_logps)
        return output

    def replayed_routes(self, inputs: dict) -> torch.Tensor | None:
        """A copy of the routes the forwards of ``inputs`` (a generation batch or a micro-batch of it, while its
        generation batch is the current one) replay, ``[B, S, num_layers, top_k]``; None when they replay none."""
        route_rows = inputs.get(ROUTE_ROWS)
        routes = None if route_rows is None or self._routes is None else self._routes.buffer.gather(route_rows)
        return None if routes is None else routes.tensor()

    def _metrics_pass(self, output: dict, batch: GenerationBatch) -> torch.Tensor | None:
        """The trainer's side of the comparison for a batch TRL ran no old-logprob pass on, or None.

        An on-policy batch (no engine IS correction, ``num_iterations=1``, aligned steps) gets no old-logprob pass
        from TRL: its loss uses the training forward's own detached log-probs. ``routing_metrics`` then needs one
        no-grad forward of its own, routed like the old pass would be (the rollout's routes under R3) while it
        records the natural top-k. It is TRL's forward (``GRPOTrainer._get_per_token_logps_and_entropies``), the random
        numbers it may draw (router jitter, dropout) come from a forked RNG and nothing of it reaches TRL's output, so
        loss and parameters stay TRL's.
        """
        has_sampler = batch.sampling_logprobs is not None or output.get("sampling_per_token_logps") is not None
        if not has_sampler and batch.generation is None:
            return None  # nothing to compare against
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        args = self.args
        batch_size = args.per_device_train_batch_size if self.model.training else args.per_device_eval_batch_size
        device = self.accelerator.device
        parent = GRPOTrainer._get_per_token_logps_and_entropies.__get__(self)
        # router jitter and dropout draw from the global RNG in a training-mode forward: fork it, so that the sampling
        # and training after this extra forward draw what they would without it (under "none": TRL's numbers)
        assert self._routes is not None  # routing metrics are computed only where the trainer handles routes
        # a dict or None: transformers' _VALID_DICT_FIELDS parse JSON text in __post_init__
        checkpointing_kwargs = cast(dict | None, args.gradient_checkpointing_kwargs)
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, checkpointing_kwargs),
        ):
            logps, _, _ = self._planned_forward(
                self._routes.metrics_plan(),
                parent,
                self.model,
                input_ids,
                attention_mask,
                output["completion_ids"].size(1),
                batch_size,
            )
        return logps

    # ------------------------------------------------------------------ forwards
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        parent = super()._get_per_token_logps_and_entropies
        if self._micro_batch is not None:  # the training forward of _compute_loss: it also measures the router shift
            assert self._objectives is not None  # set in __init__
            parent = self._objectives.with_router_shift(self, self._micro_batch, parent)
        plan = None
        if self._routes is not None:
            plan = self._routes.plan(
                is_reference=self._routes.batch is not None and is_reference_forward(self, model),
                is_ref_model=model is self.ref_model,
                micro=self._micro_batch,
            )
        if plan is None or plan.is_plain:
            return parent(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        if any(value is not None for value in multimodal.values()):
            raise NotImplementedError("routing replay supports text-only models")
        return self._planned_forward(
            plan,
            parent,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
        )

    def _planned_forward(
        self,
        plan: ForwardPlan,
        parent,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
    ):
        """TRL's forward ``parent`` as ``plan`` says: replaying its routes, chunk by chunk like TRL's own batching,
        recording the natural routes, steering (PR2) or capturing the old router (RSPO)."""
        plan.check_width(input_ids.size(1))
        rr, routes = plan.route_replay, self._routes
        assert rr is not None and routes is not None  # a plan that is not plain names its RouterReplay
        if plan.forward is Forward.TRAINING:  # in force through the backward: training_step ends it
            assert self._micro_replay is not None and plan.replay is not None  # it replays the micro-batch's routes
            with self._micro_replay.replay(rr, plan.replay):
                return parent(
                    model, input_ids, attention_mask, logits_to_keep, None, compute_entropy, compute_aux_loss
                )
        batch_size = batch_size or input_ids.size(0)
        objectives = self._objectives
        assert objectives is not None  # set in __init__
        logps, entropies, aux_losses, natural = [], [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            with contextlib.ExitStack() as stack:
                if plan.replay is not None:
                    stack.enter_context(rr.replay(plan.replay.rows(slice(start, end))))
                if plan.pr2:  # predicted routes (unless replayed) + predictor cache
                    stack.enter_context(
                        self._pr2_old_pass_chunk(attention_mask[start:end], logits_to_keep, steer=plan.replay is None)
                    )
                recording = stack.enter_context(rr.record()) if plan.record else None
                capture = stack.enter_context(
                    objectives.old_router_capture(end - start, input_ids.size(1), plan.old_router)
                )
                chunk_logps, chunk_entropies, chunk_aux = parent(
                    model,
                    input_ids[start:end],
                    attention_mask[start:end],
                    logits_to_keep,
                    None,
                    compute_entropy,
                    compute_aux_loss,
                )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
            aux_losses.append(chunk_aux)
            if recording is not None:
                assert recording.checked is not None  # set when record() exits
                natural.append(recording.checked)
            if capture is not None:
                assert routes.batch is not None  # the old pass runs inside the generation batch
                routes.batch.add_old_router(capture.ids, capture.probs)
        if plan.record:  # recorded, so checked by construction (R2/PR2 replay them in every micro-batch)
            assert routes.batch is not None  # recording passes run inside the generation batch
            routes.batch.record_natural(natural)
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    def _compute_loss(self, model, inputs):
        with self._micro_batch_of(inputs) as micro, self._engine_correction():
            # PR2 (pr2/trainer_mixin.py) watches TRL's forward and adds the predictor loss
            return self._with_pr2_loss(micro.inputs, functools.partial(super()._compute_loss, model, micro.inputs))

    def _training_step_context(self) -> contextlib.AbstractContextManager:
        """``MoEReplayTrainerMixin.training_step``'s hook: PR2's optimizer-step window (``pr2/trainer_mixin.py``)."""
        return self._pr2_training_step()

    def _optimizer_load_context(self, checkpoint: str | None) -> contextlib.AbstractContextManager:
        """``MoEReplayTrainerMixin._load_optimizer_and_scheduler``'s hook: PR2's checkpoint checks and predictors."""
        return self._pr2_optimizer_load(checkpoint)

    # TRL's is a staticmethod it calls on self; this one needs the trainer's micro-batch
    def get_gamma_weights(  # type: ignore[override]
        self, advantages, log_ratio_per_token, mask, importance_sampling_ratio=None, **vespo
    ):
        """TRL's VESPO weight, or under ``loss_type="minirl"`` MiniRL's (``MoEObjectives.minirl_weight``)."""
        if self.moe_loss_type != "minirl":
            return super().get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=log_ratio_per_token,
                mask=mask,
                importance_sampling_ratio=importance_sampling_ratio,
                **vespo,
            )
        assert self._objectives is not None  # moe_loss_type read it
        return self._objectives.minirl_weight(self, self._micro_batch, advantages, log_ratio_per_token)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        assert self._objectives is not None  # set in __init__
        self._objectives.rename_metrics(self._metrics)  # minirl: TRL's vespo metric under MiniRL's name
        super().log(logs, start_time)

    @contextlib.contextmanager
    def _micro_batch_of(self, inputs: dict) -> Iterator[MicroBatch]:
        """``inputs`` as the micro-batch whose training forward runs within the context (route_flow step 5): its rows
        of the buffer, a copy of its loss inputs (γ). Its routes stay replayed until ``training_step`` ends it."""
        self._end_micro_batch()  # a micro-batch whose training_step did not end it (compute_loss called directly)
        held = self._routes.micro_rows(inputs) if self._routes is not None else None
        self._micro_batch = MicroBatch.of(inputs, held)
        try:
            yield self._micro_batch
        finally:
            self._micro_batch = None

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):  # type: ignore[override]  # TRL's
        """TRL's model card, with the routing mode (name and tag) and the citations of the methods used."""
        return write_model_card(self, super().create_model_card, model_name, dataset_name, tags)

    # ------------------------------------------------------------------ metrics
    def _log_mismatch_metrics(
        self, output: dict, batch: GenerationBatch | None, trainer_logps: torch.Tensor | None = None
    ) -> None:
        """``mismatch/*`` wherever the batch has both the sampler's and the trainer's old log-probs (TRL's own, or
        recorded for the metrics: ``trainer_logps`` from ``_metrics_pass``), ``routing/*`` wherever the engine's routes
        and the trainer's natural ones exist (``metrics.log_ratio_metrics``: NaN for no data, as in the async trainer).
        """
        old = output.get("old_per_token_logps", trainer_logps)
        sampling = output.get("sampling_per_token_logps")
        if sampling is None and batch is not None and batch.sampling_logprobs is not None:
            sampling = pad(
                [torch.tensor(row, dtype=torch.float32) for row in batch.sampling_logprobs],
                padding_value=0.0,  # type: ignore[arg-type]  # TRL's pad fills with any value; annotated int
                padding_side="right",
                pad_to_multiple_of=self.pad_to_multiple_of,  # type: ignore[arg-type]  # what TRL's own trainer passes
            ).to(self.accelerator.device)
        if old is not None and sampling is not None:
            mask = output["completion_mask"]
            if "tool_mask" in output:  # tool results are not sampled: TRL gives them log-prob 0 and masks them out
                mask = mask * output["tool_mask"]
            self._log_logprob_mismatch(sampling, old, mask)
        if batch is None or batch.generation is None:
            return
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        positions = routable_positions(attention_mask).cpu()
        natural = batch.natural.tensor() if batch.natural is not None else None  # None: no trainer pass, fallback only
        self._log_routing_agreement(natural, batch.generation.tensor(), positions)

    def _global_sums(self, sums: dict[str, torch.Tensor], device=None) -> dict[str, torch.Tensor]:
        return global_sums(self.accelerator, sums)
