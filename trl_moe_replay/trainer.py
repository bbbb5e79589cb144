"""``MoEReplayGRPOTrainer``: TRL's ``GRPOTrainer`` with expert-routing replay (R2/R3/PR2) and mismatch metrics.

The overrides are thin; the routing work lives in ``trl_moe_replay.routing``. Data flow for one generation batch:

1. ``_generate_single_turn`` (transformers path): ``generate`` runs inside a ``TransformersRolloutRecorder``,
   which records the routes and the sampling log-probs, like an inference engine would return them. With vLLM
   (server or colocate), ``generation/vllm.py`` keeps the ``routed_experts`` vLLM returns, this rank's only.
2. ``_generate``: engine rows -> routes in TRL's padded layout (``routes_from_engine``).
3. ``_generate_and_score_completions``: TRL's old-logprob and reference passes run through our
   ``_get_per_token_logps_and_entropies``, which replays (R3) or records (R2) per chunk and measures the natural
   routing at no extra forward; the routes to replay ride in the batch dict as ``replay_routes`` through TRL's
   buffer, shuffle and split.
4. ``_compute_loss``/``training_step``: the micro-batch's routes are replayed in the training forward and stay in
   force until its backward has returned (gradient checkpointing recomputes the routers in backward).

The loss options (``gspo``, ``rspo``, ``minirl``, router-shift weighting) come from ``MoEObjectivesMixin``
(``trl_moe_replay.objectives``), which sits between this class and ``GRPOTrainer``: its ``_compute_loss`` and
``_get_per_token_logps_and_entropies`` wrap TRL's, so this class's ``super()`` calls go through it.

PR2 (``routing_replay="pr2"``) is R2 whose old-logprob pass (or, with ``pr2_rollout_prediction``, ``generate``) routes
by the predicted routes; its state and predictor training live in ``trl_moe_replay.pr2``, called from 3. and 4.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import weakref
from dataclasses import dataclass

import torch
from accelerate.utils import broadcast_object_list, is_peft_model
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer

from .config import MoEReplayGRPOConfig
from .generation import TransformersRolloutRecorder
from .generation.vllm import VLLMRouteSource, routed_experts_in_colocated_llm
from .metrics import fallback_sums, logprob_mismatch_sums, routable_positions, routing_agreement_sums
from .objectives import MoEObjectivesMixin
from .output_lock import OutputDirInUseError, OutputDirLock
from .pr2 import PredictiveRoutingReplay
from .routing import RouterReplay
from .routing.engine import routes_from_engine

logger = logging.get_logger(__name__)


@dataclass
class _ScoringState:
    """What one ``_generate_and_score_completions`` call learns along the way."""

    expects_old_pass: bool
    generation_routes: torch.Tensor | None
    old_pass_done: bool = False
    old_natural_routes: torch.Tensor | None = None
    old_router_ids: torch.Tensor | None = None  # router_shift_weighting: the experts the old pass used ...
    old_router_probs: torch.Tensor | None = None  # ... and the old router's probabilities there


class MoEReplayGRPOTrainer(MoEObjectivesMixin, GRPOTrainer):
    """``GRPOTrainer`` for Mixture-of-Experts models with routing replay.

    Same constructor as ``trl.GRPOTrainer``; configure it with [`MoEReplayGRPOConfig`] (a plain ``GRPOConfig``
    gets the defaults: R3). Swapping two imports in a TRL GRPO script is the whole change::

        from trl_moe_replay import MoEReplayGRPOTrainer as GRPOTrainer, MoEReplayGRPOConfig as GRPOConfig
    """

    _tag_names = ["trl", "grpo", "moe-routing-replay"]
    _name = "MoE Replay GRPO"
    _pr2: PredictiveRoutingReplay | None = None  # set in __init__ when routing_replay="pr2"

    def __init__(self, model, reward_funcs=None, args=None, *pos_args, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = MoEReplayGRPOConfig(f"{name.split('/')[-1]}-GRPO")
        self.routing_replay = getattr(args, "routing_replay", "r3")
        self.replay_reference_model = getattr(args, "replay_reference_model", True)
        self.extreme_token_threshold = getattr(args, "extreme_token_threshold", 2.0)
        colocated_r3 = self.routing_replay == "r3" and args.use_vllm and args.vllm_mode == "colocate"
        with routed_experts_in_colocated_llm() if colocated_r3 else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, *pos_args, **kwargs)

        # R3 with vLLM: keep the routes vLLM returns (generation/vllm.py), this rank's samples only
        self._vllm_routes = None
        if self.routing_replay == "r3" and self._use_vllm_engine:
            self._vllm_routes = VLLMRouteSource(self.vllm_generation, self.accelerator)
        if self.routing_replay != "none" and (self.tools or self.rollout_func is not None):
            raise NotImplementedError(
                "routing replay supports single-turn generation only: tools and rollout_func produce multi-segment "
                "completions whose routes are not recorded. Use routing_replay='none' with them."
            )
        self._route_replay = RouterReplay(self.accelerator.unwrap_model(self.model))
        self._ref_route_replay = RouterReplay(self.ref_model) if self.ref_model is not None else None
        # transformers generate records sampling log-probs like an engine: let TRL's importance-sampling
        # correction and old-logprob pass treat it as one (see the `use_vllm` property).
        self._hf_engine = not self._use_vllm_engine
        if self.routing_replay != "none" and self.aux_loss_enabled:
            logger.warning(
                "Router load-balancing aux loss turned OFF under routing replay: transformers' loss recounts the "
                "router's natural top-k, not the replayed experts, so it would balance routes that are not used."
            )
            self.aux_loss_enabled = False
        if self.routing_replay == "r2" and not self._old_pass_expected():
            logger.warning(
                "routing_replay='r2' is a no-op here: this configuration is on-policy (no old-logprob pass), so "
                "every update already routes like the old policy."
            )
        if self.routing_replay == "pr2" and not self._old_pass_expected():
            logger.warning(
                "routing_replay='pr2' needs the old-logprob pass, which this on-policy configuration skips: its "
                "predictors get no training data and stay at zero, so the routes stay the router's own."
            )
        self._pr2 = self._build_pr2(args) if self.routing_replay == "pr2" else None
        self._scoring: _ScoringState | None = None
        self._batch_routes: torch.Tensor | None = None
        self._train_replay = contextlib.ExitStack()
        self._engine_rows: list | None = None
        self._setup_objectives(self.args)
        # one run per output_dir: claimed by the main process in train(), held until end() or garbage collection
        self._output_lock = OutputDirLock(self.args.output_dir)
        weakref.finalize(self, self._output_lock.release)

    # ------------------------------------------------------------------ engine flag
    @property
    def use_vllm(self) -> bool:
        """TRL's switch for both "sample with vLLM" and "correct for the engine's log-probs".

        On the transformers path our recorder supplies sampling log-probs just as vLLM does, so outside generation
        itself we answer True: TRL then runs its old-logprob pass and importance-sampling correction unchanged.
        """
        if self.__dict__.get("_use_vllm_engine", False):
            return True
        return self.__dict__.get("_hf_engine", False) and not self.__dict__.get("_in_generation", False)

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        self.__dict__["_use_vllm_engine"] = bool(value)

    @property
    def _use_vllm_engine(self) -> bool:
        return self.__dict__.get("_use_vllm_engine", False)

    def _old_pass_expected(self) -> bool:
        """TRL's own condition for computing old-policy log-probs (``_generate_and_score_completions``)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._use_vllm_engine:
            output = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                   has_tool_images)
            if self._vllm_routes is not None:
                self._engine_rows = self._vllm_routes.local_rows(len(prompt_ids))
            return output
        causal_lm = self.accelerator.unwrap_model(self.model)
        if is_peft_model(causal_lm):
            causal_lm = causal_lm.get_base_model()
        recorder = TransformersRolloutRecorder(self._route_replay, causal_lm, self.temperature)
        predicting = self._pr2 is not None and self._pr2.rollout_prediction
        with recorder, (self._pr2.steering() if predicting else contextlib.nullcontext()):
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        recorder.finish_with(completion_ids, pad_token_id=self._tokenizer.pad_token_id)
        prompt_lengths = [len(ids) for ids in prompt_ids]
        completion_lengths = [len(ids) for ids in completion_ids]
        self._engine_rows = recorder.engine_rows(prompt_lengths, completion_lengths)
        return completion_ids, recorder.sampling_logprobs(completion_lengths)

    def _generate(self, prompts):
        self._engine_rows = None
        self._in_generation = True
        try:
            output = super()._generate(prompts)
        finally:
            self._in_generation = False
        if self._scoring is not None:  # TRL calls _generate from _generate_and_score_completions only
            self._scoring.generation_routes = self._align_engine_rows(output[0], output[1])
        return output

    def _align_engine_rows(self, prompt_ids, completion_ids) -> torch.Tensor | None:
        if self._engine_rows is None:
            return None
        rr = self._route_replay
        layout = dict(
            prompt_lengths=[len(ids) for ids in prompt_ids],
            completion_lengths=[len(ids) for ids in completion_ids],
            prompt_width=_padded_width(prompt_ids, self.pad_to_multiple_of),
            completion_width=_padded_width(completion_ids, self.pad_to_multiple_of),
            num_layers=rr.num_layers,
            top_k=rr.top_k,
            moe_layers=rr.moe_layers,
            num_experts=rr.num_experts,
        )
        if self._vllm_routes is not None:  # engine payloads: a bad sample falls back instead of failing the run
            return self._vllm_routes.align(self._engine_rows, **layout)
        return routes_from_engine(self._engine_rows, **layout)

    def _generate_and_score_completions(self, inputs):
        self._scoring = _ScoringState(expects_old_pass=self._old_pass_expected(), generation_routes=None)
        try:
            output = super()._generate_and_score_completions(inputs)
            state = self._scoring
        finally:
            self._scoring = None
        replay_routes = self._routes_to_replay(state)
        if replay_routes is not None:
            output["replay_routes"] = replay_routes
        if state.old_router_ids is not None:  # ride through TRL's buffer, shuffle and split like the routes
            output["old_router_ids"], output["old_router_probs"] = state.old_router_ids, state.old_router_probs
        if self._pr2 is not None:
            output.update(self._pr2.take_old_pass_cache(self.state.global_step))
        self._log_mismatch_metrics(output, state)
        return output

    # ------------------------------------------------------------------ forwards
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if any(value is not None for value in multimodal.values()):
            raise NotImplementedError("routing replay supports text-only models")
        parent = super()._get_per_token_logps_and_entropies
        state = self._scoring
        if state is None:  # training (or evaluation) forward on a micro-batch
            routes = self._batch_routes
            if routes is None:
                return parent(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                              compute_aux_loss)
            if torch.is_grad_enabled():
                # stays in force through the backward; training_step closes it
                self._train_replay.enter_context(self._route_replay.replay(routes))
                return parent(model, input_ids, attention_mask, logits_to_keep, None, compute_entropy,
                              compute_aux_loss)
            with self._route_replay.replay(routes):
                return parent(model, input_ids, attention_mask, logits_to_keep, None, compute_entropy,
                              compute_aux_loss)

        is_old_pass = state.expects_old_pass and not state.old_pass_done
        state.old_pass_done = True
        if is_old_pass:
            rr, record = self._route_replay, True
            routes = state.generation_routes if self._replays_rollout_routes() else None
        else:  # reference pass
            rr = self._ref_route_replay if model is self.ref_model else self._route_replay
            record = False
            routes = self._routes_to_replay(state) if self.replay_reference_model else None

        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux_losses, natural, old_router = [], [], [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            with contextlib.ExitStack() as stack:
                if routes is not None:
                    stack.enter_context(rr.replay(routes[start:end]))
                if is_old_pass and self._pr2 is not None:  # predicted routes (unless replayed) + predictor cache
                    stack.enter_context(self._pr2.old_pass_chunk(
                        attention_mask[start:end], logits_to_keep, steer=routes is None, cache=self.model.training
                    ))
                recording = stack.enter_context(rr.record()) if record else None
                capture = stack.enter_context(self._old_router_capture(end - start, input_ids.size(1), record))
                chunk_logps, chunk_entropies, chunk_aux = parent(
                    model, input_ids[start:end], attention_mask[start:end], logits_to_keep, None, compute_entropy,
                    compute_aux_loss,
                )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
            aux_losses.append(chunk_aux)
            if recording is not None:
                natural.append(recording.routes)
            if capture is not None:
                old_router.append((capture.ids, capture.probs))
        if record:
            state.old_natural_routes = torch.cat(natural, dim=0)
        if old_router:
            state.old_router_ids = torch.cat([ids for ids, _ in old_router], dim=0)
            state.old_router_probs = torch.cat([probs for _, probs in old_router], dim=0)
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    def _compute_loss(self, model, inputs):
        self._batch_routes = inputs.get("replay_routes")
        if self._pr2 is not None and self.model.training:
            with self._pr2.watch_training_forward(inputs):
                return super()._compute_loss(model, inputs)
        return super()._compute_loss(model, inputs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            if self._pr2 is not None:
                self._pr2.begin_micro_step(self.state.global_step)
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self._pr2 is not None:
                self._train_pr2_predictors()
            return loss
        finally:
            self._train_replay.close()  # only now: the backward (and any recompute in it) has returned
            self._batch_routes = None

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        finally:
            self._train_replay.close()
            self._batch_routes = None

    def train(self, *args, **kwargs):
        """``Trainer.train``, after claiming ``output_dir`` for this run (:mod:`trl_moe_replay.output_lock`).

        Raises ``OutputDirInUseError`` on every rank when another live trainer writes there.
        """
        self._claim_output_dir()
        return super().train(*args, **kwargs)

    def _claim_output_dir(self) -> None:
        problem = None
        if self.accelerator.is_main_process:  # one lock per run
            try:
                self._output_lock.acquire()
            except OutputDirInUseError as exc:
                problem = str(exc)
        if self.accelerator.num_processes > 1:  # every rank stops, not only the main one (the others would hang)
            problem = broadcast_object_list([problem])[0]
        if problem is not None:
            raise OutputDirInUseError(problem)

    def end(self):
        """``Trainer.end`` (destroy the process group), after letting gloo's worker threads settle.

        On CPU data parallelism (gloo), destroying the group while a worker thread still drops a Python-owned tensor
        deadlocks (the main thread joins it holding the GIL), and exiting without destroying it can abort the
        interpreter at shutdown; a barrier and a short pause first avoid both.
        """
        self._output_lock.release()
        if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
            torch.distributed.barrier()
            time.sleep(0.2)
        super().end()

    # ------------------------------------------------------------------ routes and PR2
    def _replays_rollout_routes(self) -> bool:
        return self.routing_replay == "r3" or (self._pr2 is not None and self._pr2.rollout_prediction)

    def _routes_to_replay(self, state: _ScoringState) -> torch.Tensor | None:
        if self._replays_rollout_routes():
            return state.generation_routes
        return state.old_natural_routes if self.routing_replay in ("r2", "pr2") else None

    def _build_pr2(self, args) -> PredictiveRoutingReplay:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError(
                "routing_replay='pr2' keeps its predictors outside the model in their own optimizer group, which "
                "DeepSpeed and FSDP do not manage. Use DDP or a single device, or routing_replay='r2'/'r3'."
            )
        if self.optimizer is not None:
            raise NotImplementedError(
                "routing_replay='pr2' adds the predictors' param group in create_optimizer; pass no optimizer (or "
                "subclass and call PredictiveRoutingReplay.add_to_optimizer yourself)."
            )
        return PredictiveRoutingReplay(
            self._route_replay,
            cached_tokens_per_sequence=getattr(args, "pr2_cached_tokens_per_sequence", 2048),
            rollout_prediction=getattr(args, "pr2_rollout_prediction", False),
        )

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._pr2 is not None:
            lr = self.args.learning_rate * getattr(self.args, "pr2_lr_multiplier", 1e3)
            self._pr2.add_to_optimizer(optimizer, lr, self.accelerator.num_processes)
        return optimizer

    def _train_pr2_predictors(self) -> None:
        sums = self._pr2.train_step(
            self.state.global_step,
            grad_scale=1.0 / self.current_gradient_accumulation_steps,
            backward=self.accelerator.backward,
        )
        if sums is not None:
            for name, value in self._pr2.metrics(self._global_sums(sums, self.accelerator.device)).items():
                self._metrics["train"][name].append(value)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._pr2 is not None and self.args.should_save:
            checkpoint = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder super() just wrote
            self._pr2.save(os.path.join(self._get_output_dir(trial=trial), checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._pr2 is not None and checkpoint is not None and not self._pr2.load(checkpoint):
            logger.warning(f"no PR2 predictors in {checkpoint}; they start from zero (R2 routes)")

    # ------------------------------------------------------------------ metrics
    def _log_mismatch_metrics(self, output: dict, state: _ScoringState) -> None:
        """Log the mismatch and routing metrics of this generation batch, summed over ranks before dividing.

        A ratio with nothing to measure (no valid completion token, no routed pair) is logged as NaN, not 0.0 (which
        reads as a perfect score): TRL's ``log`` drops NaN before averaging a logging window, so other steps'
        values are not pulled, and a window of no-data steps logs ``None``.
        """
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        device = self.accelerator.device
        old = output.get("old_per_token_logps")
        sampling = output.get("sampling_per_token_logps")
        if old is not None and sampling is not None:
            sums = logprob_mismatch_sums(sampling, old, output["completion_mask"], self.extreme_token_threshold)
            total = self._global_sums(sums, device)
            metrics["mismatch/kl_k1"].append(_ratio(total["kl_k1"], total["tokens"]))
            metrics["mismatch/kl_k3"].append(_ratio(total["kl_k3"], total["tokens"]))
            metrics["mismatch/extreme_frac"].append(_ratio(total["extreme"], total["tokens"]))
        reference = state.generation_routes
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        if state.old_natural_routes is None and reference is not None:  # no trainer pass to compare: fallback only
            sums = fallback_sums(reference, routable_positions(attention_mask).cpu(), self._route_replay.moe_layers)
            total = self._global_sums(sums, device)
            metrics["routing/fallback_frac"].append(_ratio(total["fallback_positions"], total["positions"]))
        if state.old_natural_routes is not None and reference is not None:
            sums = routing_agreement_sums(
                state.old_natural_routes, reference, routable_positions(attention_mask).cpu(),
                self._route_replay.moe_layers,
            )
            total = self._global_sums(sums, device)
            metrics["routing/mismatch_frac"].append(_ratio(total["mismatch_pairs"], total["pairs"]))
            metrics["routing/token_any_mismatch"].append(_ratio(total["tokens_any_mismatch"], total["tokens"]))
            metrics["routing/topk_agreement"].append(_ratio(total["overlap"], total["pairs"]))
            metrics["routing/fallback_frac"].append(_ratio(total["fallback_positions"], total["positions"]))

    def _global_sums(self, sums: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
        names = list(sums)
        stacked = torch.stack([sums[name].float().to(device) for name in names])
        gathered = self.accelerator.gather(stacked[None]).sum(dim=0)
        return dict(zip(names, gathered, strict=True))


def _ratio(total: torch.Tensor, count: torch.Tensor) -> float:
    """``total / count``, or NaN when nothing was counted ("no data", which TRL's ``log`` leaves out of averages)."""
    return (total / count).item() if count.item() > 0 else math.nan


def _padded_width(sequences: list[list[int]], multiple: int | None) -> int:
    """The width ``trl.trainer.utils.pad`` gives: the longest sequence, rounded up to ``multiple``."""
    width = max((len(seq) for seq in sequences), default=0)
    if multiple:
        width = -(-width // multiple) * multiple
    return width
