"""Routing replay (none, R2, R3, R3 with threshold replay, PR2) under one distributed engine, two CPU processes
(gloo). Launched by ``tests/parallel/test_sharded.py``:

    accelerate launch --config_file recipes/accelerate/{ddp,zero2,zero3,fsdp2}.yaml --num_processes 2 \\
        tests/scripts/sharded_run.py OUT_DIR

Each rank writes ``OUT_DIR/rank<i>.json``: the engine it ran (and how its parameters are stored), per mode the
logged losses and whether every training forward and backward recompute ran exactly the replayed experts (checked
by hooks on the experts modules, independently of the replay code; under threshold replay, which of the replayed
experts they did not run, against the replace counts behind ``routing/replace_rate``), and for PR2 the predictors
after every step, a save/resume round trip, and ``save_model()`` output in ``OUT_DIR/pr2/final``.

accelerate sets up FSDP only on GPU-type devices; on a CPU the trainer refuses an FSDP launch (it would run plain
DDP). ``FORCE_FSDP_ON_CPU=1`` makes accelerate take the CPU processes for an FSDP-capable setup, so FSDP2 really
shards here (checked: the parameters are DTensors holding half of each tensor).
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.core.metrics import REPLACE_RATE
from trl_moe_replay.parallel.sharded import is_dtensor, is_zero3_partitioned, local_numel
from trl_moe_replay.routing.routes import has_route
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer


OUT = Path(sys.argv[1])
# 16 experts: each router and predictor (16 x 64) is above ZeRO-3's "auto" persistence threshold (10 x hidden),
# so ZeRO-3 partitions them instead of keeping them whole on every rank
MODEL = dict(model_type="qwen3_moe", num_experts=16)
SETTINGS = dict(
    use_cpu=True,
    bf16=False,
    report_to="none",
    logging_steps=1,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    learning_rate=1e-3,
    gradient_accumulation_steps=1,
    num_iterations=2,
    seed=0,
    max_grad_norm=1e6,  # DeepSpeed clips policy and predictors by one norm, the others separately (docs)
)
STEPS_THRESHOLD = 2  # R3 with threshold replay: a generation batch's on-policy and off-policy update


def reward_len(completions, **kwargs):
    return [-abs(8 - len(c)) for c in completions]


def force_fsdp_on_cpu() -> None:
    """Let accelerate's AcceleratorState take this CPU process group for FSDP: it switches to FSDP only from a
    GPU-type distributed type, so the already-initialised process state (gloo, CPU device) is relabelled."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (``deepspeed_shm_comm``, ~3 minutes)
    when its communication backend starts; training over gloo does not use it."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ExpertsWatch:
    """Forward pre-hooks on every experts module: the expert ids each call received (forward and recompute)."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = {}
        for name, module in model.named_modules():
            if name.endswith("mlp.experts"):
                layer = int(name.split("layers.")[1].split(".")[0])
                module.register_forward_pre_hook(self._hook(layer))

    def _hook(self, layer):
        def hook(module, args):
            self.calls.setdefault(layer, []).append(args[1].detach().clone())

        return hook


class Spy(MoEReplayGRPOTrainer):
    """Checks every training micro-batch: the experts modules ran exactly the replayed routes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.watch = ExpertsWatch(self.accelerator.unwrap_model(self.model))
        self.route_checks = {"calls": 0, "rows": 0, "mismatched_rows": 0}

    def _compute_loss(self, model, inputs):
        self.given_routes = self.replayed_routes(inputs)  # none under routing_replay="none"
        self.watch.calls.clear()  # generation and the old-logprob pass ran before, in the same training_step
        return super()._compute_loss(model, inputs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)  # forward and backward (with recompute)
        if self.given_routes is None:
            return loss
        routes = self.given_routes
        for layer, calls in self.watch.calls.items():
            layer_routes = routes[:, :, layer].reshape(-1, routes.shape[-1])
            given = has_route(layer_routes)  # uint8 routes mark "no route" rows with 255, signed ones with -1
            self.check(layer, [ids.to(given.device) for ids in calls], layer_routes.long(), given)
        return loss

    def check(self, layer: int, calls: list[torch.Tensor], expected: torch.Tensor, given: torch.Tensor) -> None:
        """One MoE layer of one micro-batch: the ids its experts received in each call against the replayed ones."""
        for ids in calls:
            differ = (ids.sort(-1).values != expected.sort(-1).values).any(-1) & given
            self.route_checks["calls"] += 1
            self.route_checks["rows"] += int(given.sum())
            self.route_checks["mismatched_rows"] += int(differ.sum())


class ThresholdSpy(Spy):
    """Threshold replay: per training micro-batch, the replayed experts the experts modules did not receive (seen by
    the hooks) against the rejected slots the replay counted for ``routing/replace_rate``; the backward recompute ran
    the forward's very ids; no token ran an expert twice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.route_checks = {
            "calls": 0,
            "rows": 0,
            "replaced_seen": 0,
            "replaced_counted": 0,
            "slots_counted": 0,
            "recompute_differs": 0,
            "duplicates": 0,
        }
        self.taken: dict[int, list[int]] = {}

    def _log_replace_rate(self):
        # the counts this log takes: at the end of a training_step, those of its training forward (not the recompute)
        self.taken = {layer: counts.tolist() for layer, counts in self._route_replay._replace_sums.items()}
        super()._log_replace_rate()

    def check(self, layer, calls, expected, given):
        forward, *recomputed = calls
        replayed_used = (forward[:, :, None] == expected[:, None, :]).any(-1).sum(-1)  # per row
        ordered = forward.sort(-1).values
        checks = self.route_checks
        checks["calls"] += len(calls)
        checks["rows"] += int(given.sum())
        checks["replaced_seen"] += int((expected.shape[-1] - replayed_used)[given].sum())
        checks["replaced_counted"] += self.taken[layer][0]
        checks["slots_counted"] += self.taken[layer][1]
        checks["recompute_differs"] += sum(int((ids != forward).any(-1).sum()) for ids in recomputed)
        checks["duplicates"] += int((ordered[:, 1:] == ordered[:, :-1]).any(-1).sum())


class PredictorSteps(TrainerCallback):
    """Full predictor weights after every optimizer step (a collective under FSDP2 / ZeRO-3: every rank runs it)."""

    def __init__(self):
        self.trainer, self.after_step = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(flat(self.trainer._pr2.full_state_dict()))


def flat(state: dict[str, torch.Tensor]) -> list[float]:
    return torch.cat([state[k].reshape(-1) for k in sorted(state)]).tolist()


WATCHED_PARAMS = ("layers.0.mlp.gate.weight", "layers.0.mlp.experts.gate_up_proj", "pr2_predictors.layers.0.weight")


def storage(trainer) -> dict:
    """How this rank stores the model: wrapper, and for the first router, expert and predictor weight its local
    element count against the full one."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    report = {"wrapper": type(trainer.model_wrapped).__name__, "params": {}}
    if trainer.is_deepspeed_enabled:
        report["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    # the predictors' own param group as the engine's optimizer holds it
    report["pr2_groups"] = [
        {"lr": group["lr"], "initial_lr": group["initial_lr"], "weight_decay": group["weight_decay"]}
        for group in trainer.optimizer.param_groups
        if group.get("pr2_predictors")
    ]
    for name, param in model.named_parameters():
        if name.endswith(WATCHED_PARAMS):
            full = int(param.ds_numel) if is_zero3_partitioned(param) else param.numel()
            report["params"][name] = {
                "dtensor": is_dtensor(param),
                "zero3": is_zero3_partitioned(param),
                "local": local_numel(param),
                "full": full,
            }
    return report


def make_trainer(mode: str, model, cls=Spy, name: str | None = None, **overrides):
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
    settings = {**SETTINGS, "output_dir": str(OUT / (name or mode)), "routing_replay": mode, **overrides}
    if os.environ.get("FORCE_FSDP_ON_CPU") == "1":  # keep the relabelled process state (see force_fsdp_on_cpu)
        settings["accelerator_config"] = {"use_configured_state": True}
    if mode == "pr2":
        settings.setdefault("pr2_lr_multiplier", 10.0)
    return cls(
        model=model,
        reward_funcs=reward_len,
        args=MoEReplayGRPOConfig(**settings),
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
    )


def logged(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def run_mode(mode: str, model, steps: int) -> dict:
    trainer = make_trainer(mode, model, max_steps=steps, save_strategy="no")
    trainer.train()
    return {
        "loss": logged(trainer, "loss"),
        "routes": trainer.route_checks,
        "storage": storage(trainer),
        "updated_frac": logged(trainer, "precision/updated_frac"),
        "distributed_type": trainer.accelerator.distributed_type.value,
        "mixed_precision": trainer.accelerator.mixed_precision,
    }


def run_threshold(model) -> dict:
    """R3 with threshold replay at 1 for a generation batch's two updates: the on-policy one replays the routes its
    own router chose; the off-policy one's router has moved, and rejects the replayed experts it no longer ranks in
    its top-k."""
    trainer = make_trainer(
        "r3",
        model,
        cls=ThresholdSpy,
        name="threshold",
        max_steps=STEPS_THRESHOLD,
        save_strategy="no",
        replay_score_threshold=1.0,
    )
    trainer.train()
    layers = sorted(
        {name for entry in trainer.state.log_history for name in entry if name.startswith(f"{REPLACE_RATE}/")}
    )
    return {
        "loss": logged(trainer, "loss"),
        "replace_rate": logged(trainer, REPLACE_RATE),
        "replace_rate_layers": {name: logged(trainer, name) for name in layers},
        "routes": trainer.route_checks,
        "updated_frac": logged(trainer, "precision/updated_frac"),
        "top_k": trainer._route_replay.top_k,
    }


def run_pr2(model, resume_model) -> dict:
    steps = PredictorSteps()
    trainer = make_trainer("pr2", model, max_steps=3, save_strategy="steps", save_steps=2)
    steps.trainer = trainer
    trainer.add_callback(steps)
    trainer.train()
    result = {
        "loss": logged(trainer, "loss"),
        "pr2_loss": logged(trainer, "pr2/loss"),
        "grad_norm": logged(trainer, "grad_norm"),
        "pr2_grad_norm": logged(trainer, "pr2/grad_norm"),
        "routes": trainer.route_checks,
        "predictors_after_step": steps.after_step,
        "storage": storage(trainer),
    }
    trainer.save_model(str(OUT / "pr2" / "final"))  # the test loads it with plain transformers

    restored = {}

    class ResumeSpy(Spy):
        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            restored["predictors"] = flat(self._pr2.full_state_dict())

    resumed = make_trainer("pr2", resume_model, cls=ResumeSpy, max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(OUT / "pr2" / "checkpoint-2"))
    from safetensors.torch import load_file

    result["resume"] = {
        "restored": restored["predictors"],
        "file": flat(load_file(OUT / "pr2" / "checkpoint-2" / "pr2_predictors.safetensors")),
        "final": flat(resumed._pr2.full_state_dict()),
        "global_step": resumed.state.global_step,
    }
    return result, resumed


def predictor_shapes_under_zero_init() -> dict:
    """PR2 predictors for a model whose weights ZeRO-3 partitioned at creation: the predictors' real shapes."""
    from transformers import AutoConfig

    from trl_moe_replay.pr2.predictor import RoutePredictors
    from trl_moe_replay.routing import RouterReplay

    config = AutoConfig.for_model(
        **MODEL,
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        moe_intermediate_size=32,
    )
    model = AutoModelForCausalLM.from_config(config)  # inside deepspeed.zero.Init: a ZeRO-3 trainer exists
    router = RouterReplay(model).routers()[0]
    predictors = RoutePredictors(RouterReplay(model).routers())
    return {
        "router_local": router.weight.numel(),
        "router_ds_shape": list(router.weight.ds_shape),
        "predictor": list(predictors.layers["0"].weight.shape),
    }


def main():
    if os.environ.get("FORCE_FSDP_ON_CPU") == "1":
        force_fsdp_on_cpu()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true":
        skip_deepspeed_shm_build()
    # built before any trainer: once a ZeRO-3 trainer exists, transformers builds models inside deepspeed.zero.Init
    # (partitioned at creation, as from_pretrained does under zero3_init_flag); the runs compare exact weights
    models = [tiny_moe_model(**MODEL) for _ in range(6)]
    # none and R2: an on-policy and an off-policy update; R3 and PR2: also the next generation batch's first update
    runs = zip(("none", "r2", "r3"), models[:3], (2, 2, 3), strict=True)
    result = {mode: run_mode(mode, model, steps) for mode, model, steps in runs}
    result["threshold"] = run_threshold(models[5])
    result["pr2"], trainer = run_pr2(models[3], models[4])
    if trainer.is_deepspeed_enabled and trainer.model_wrapped.zero_optimization_stage() == 3:
        result["zero3_init_predictor_shapes"] = predictor_shapes_under_zero_init()
    rank = int(os.environ["RANK"])
    result["rank"], result["world"] = rank, int(os.environ["WORLD_SIZE"])
    (OUT / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.end()  # destroys the process group (see MoEReplayTrainerMixin.end)


if __name__ == "__main__":
    main()
