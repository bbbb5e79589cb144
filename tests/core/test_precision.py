"""Updates that round away (issue 42, item 2): both trainers measure what their first optimizer steps changed
(``precision/updated_frac``) and warn once, in one line, when a bf16-loaded model is updated in place; an fp32 model
under bf16 autocast keeps its updates. ``routing_replay="none"`` with the bf16 trap: tests/cross_cutting/test_golden_trl.py."""

import logging
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate import Accelerator
from datasets import Dataset

from trl_moe_replay import (
    MoEReplayAsyncGRPOConfig,
    MoEReplayAsyncGRPOTrainer,
    MoEReplayGRPOConfig,
    MoEReplayGRPOTrainer,
)
from trl_moe_replay.core import precision
from trl_moe_replay.core.precision import METRIC, MasterUpdateProbe, UpdateProbe, attach_update_probe
from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer
from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker

from tests.async_grpo.test_async_grpo_trainer import DATASET as ASYNC_DATASET, script, settings


LOGGER = "trl_moe_replay.core.precision"


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def reward_len(completions, **kwargs):
    return [-abs(6 - len(c)) for c in completions]


def train_sync(tmp_path, dtype, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=3,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_strategy="no",
        seed=0,
        learning_rate=1e-6,
        bf16=True,
        routing_replay="r3",
    )
    values.update(overrides)
    trainer = MoEReplayGRPOTrainer(
        model=tiny_moe_model("qwen3_moe", dtype=dtype),
        reward_funcs=reward_len,
        args=MoEReplayGRPOConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    return trainer


def logged(trainer, key=METRIC):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_bf16_parameters_updated_in_place_log_a_small_fraction_and_warn_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = train_sync(tmp_path, torch.bfloat16)
    fractions = logged(trainer)
    assert (
        len(fractions) == 3 and max(fractions) < 0.1
    )  # every step (max_steps 3); 2.0% at step 1, as the issue measured
    # decay / no-decay groups; the no-decay one holds the norms' weights of 1.0, which a step of lr / 8 moves in
    # float32 only while lr > 4.8e-7: steps 1-2 of the linear decay from 1e-6 (step 3: 3.3e-7, not judged)
    assert len(logged(trainer, f"{METRIC}/group0")) == 3 and len(logged(trainer, f"{METRIC}/group1")) == 2
    assert all(entry.get("grad_norm", 1) > 0 for entry in trainer.state.log_history)  # gradients were there
    lines = warnings_of(caplog)
    assert len(lines) == 1 and "\n" not in lines[0]  # once, over three low steps; one line
    assert lines[0].startswith("updates round away: bf16 parameters updated in place (no fp32 master weights): ")
    assert "changed in optimizer step 1 at learning rate 1e-06" in lines[0] and "dtype': 'float32'" in lines[0]
    assert "bf16=True (autocast" in lines[0] and "DeepSpeed or FSDP2 mixed precision" in lines[0]


def test_fp32_parameters_under_bf16_autocast_keep_their_updates_and_do_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = train_sync(tmp_path, torch.float32)
    assert trainer.args.bf16 and next(trainer.model.parameters()).dtype == torch.float32
    fractions = logged(trainer)
    assert len(fractions) == 3 and min(fractions) >= 0.9
    assert not warnings_of(caplog)


def test_the_async_trainer_measures_through_the_same_probe(tmp_path, checkpoint, caplog):
    samples, _ = script(checkpoint, versions=[0, 0, 0, 0], routes=False)
    args = MoEReplayAsyncGRPOConfig(
        **settings(
            tmp_path,
            routing_replay="none",
            vllm_sync_check=False,
            learning_rate=1e-6,
            per_device_train_batch_size=4,
            model_init_kwargs={"dtype": "bfloat16"},
        )
    )
    trainer = MoEReplayAsyncGRPOTrainer(
        model=checkpoint,
        reward_funcs=zero_reward,
        train_dataset=ASYNC_DATASET,
        args=args,
        rollout_worker=ScriptedRolloutWorker(samples),
        weight_transfer=NoOpWeightTransfer(),
    )
    assert sum(isinstance(c, UpdateProbe) for c in trainer.callback_handler.callbacks) == 1
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    probe = next(c for c in trainer.callback_handler.callbacks if isinstance(c, UpdateProbe))
    assert probe.measured == 2 and not logged(trainer)  # both steps (max_steps 2) judged; "none" logs TRL's keys only
    assert len(warnings_of(caplog)) == 1 and "bf16 parameters updated in place" in warnings_of(caplog)[0]


# ------------------------------------------------------------------------------------ the probe's rules, one by one
def probe_over(param: torch.nn.Parameter, lr: float):
    """The probe on a bare AdamW over ``param``."""
    metrics = {"train": defaultdict(list)}
    optimizer = torch.optim.AdamW([param], lr=lr)
    return UpdateProbe(Accelerator(cpu=True), metrics), optimizer, metrics["train"]


def step(probe, optimizer, param, grad, global_step=0, skipped=False):
    state = SimpleNamespace(global_step=global_step)
    param.grad = grad
    probe.on_pre_optimizer_step(None, state, None, optimizer=optimizer)
    optimizer.step()
    optimizer.step_was_skipped = skipped  # as accelerate's AcceleratedOptimizer reports fp16 overflow steps
    probe.on_optimizer_step(None, state, None, optimizer=optimizer)


@pytest.mark.parametrize(
    ("dtype", "lr", "low", "high"),
    [(torch.bfloat16, 1e-6, 0.005, 0.05), (torch.bfloat16, 1e-5, 0.08, 0.25), (torch.float32, 1e-6, 0.99, 1.0)],
)
def test_the_measured_fraction_is_the_issues_table(dtype, lr, low, high):
    """A 512x512 weight drawn like a real layer's (std 0.02), one AdamW step: bf16 2.0% at 1e-6 and 15% at 1e-5 in
    the issue; every element in fp32. The probe reads a strided sample of 4,096 of its 262,144 elements."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(512, 512, generator=generator) * 0.02).to(dtype))
    probe, optimizer, metrics = probe_over(param, lr)
    step(probe, optimizer, param, torch.randn(512, 512, generator=generator).to(dtype))
    assert low <= metrics[METRIC][0] <= high and f"{METRIC}/group0" not in metrics  # one group: no per-group key


def test_steps_that_cannot_change_anything_do_not_count():
    param = torch.nn.Parameter((torch.randn(64, 64) * 0.02).to(torch.bfloat16))
    probe, optimizer, metrics = probe_over(param, 1e-6)
    step(probe, optimizer, param, torch.zeros(64, 64, dtype=torch.bfloat16))  # no gradient
    step(probe, optimizer, param, torch.randn(64, 64).to(torch.bfloat16), skipped=True)  # fp16 scaler skipped it
    optimizer.param_groups[0]["lr"] = 0.0  # the first step of a warm-up
    step(probe, optimizer, param, torch.randn(64, 64).to(torch.bfloat16))
    assert METRIC not in metrics and probe.measured == 0 and not probe.warned
    optimizer.param_groups[0]["lr"] = 1e-6
    for global_step in range(precision.PROBE_STEPS + 5):
        step(probe, optimizer, param, torch.randn(64, 64).to(torch.bfloat16), global_step=global_step)
    assert len(metrics[METRIC]) == precision.PROBE_STEPS and probe.warned  # then no more: the first steps only


PROBE_WINDOW = precision.PROBE_STEPS


def scheduled(dtype, scheduler: str, warmup: int, steps: int = PROBE_WINDOW, lr: float = 1e-6):
    """The probe over a weight drawn like a real layer's (std 0.02) in ``dtype``, AdamW stepped ``steps`` times under
    transformers' ``scheduler`` with ``warmup`` warm-up steps (of 4,000 in all); the probe and its metric lists."""
    from transformers import get_scheduler

    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter((torch.randn(256, 256, generator=generator) * 0.02).to(dtype))
    probe, optimizer, metrics = probe_over(param, lr)
    schedule = get_scheduler(scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=4000)
    for global_step in range(steps):
        step(probe, optimizer, param, torch.randn(256, 256, generator=generator).to(dtype), global_step=global_step)
        schedule.step()
    return probe, metrics


@pytest.mark.parametrize(("dtype", "steps"), [(torch.float32, PROBE_WINDOW), (torch.bfloat16, 10)])
@pytest.mark.parametrize("scheduler", ["linear", "cosine", "constant_with_warmup"])
def test_a_warm_up_too_small_to_show_is_not_judged(dtype, steps, scheduler, caplog):
    """The issue's run: lr 1e-6 with 2,000 warm-up steps takes steps of 0, then 5e-10, 1e-9 ...: too small to move
    most weights even in float32, so those steps are not judged, whatever the parameters' dtype (the fp32 run was told
    to raise its learning rate at 5e-10, the bf16 one that 0.0% changed). The later ones of the window, from about
    7e-9, move an fp32 weight: an fp32 run is judged there and keeps its updates (the least favourable gradients:
    fresh random ones at every step)."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        probe, metrics = scheduled(dtype, scheduler, warmup=2000, steps=steps)
    assert not warnings_of(caplog)
    if dtype == torch.bfloat16:  # steps of 0 to 4.5e-9: none judged
        assert probe.measured == 0 and METRIC not in metrics
    else:
        assert 0 < probe.measured < PROBE_WINDOW - 10 and min(metrics[METRIC]) >= precision.WARN_BELOW


@pytest.mark.parametrize(("dtype", "warns"), [(torch.float32, False), (torch.bfloat16, True)])
def test_after_a_short_warm_up_the_steps_at_full_rate_are_judged(dtype, warns, caplog):
    """constant_with_warmup over 4 steps: lr 0, 2.5e-7, 5e-7, 7.5e-7, then 1e-6. The steps whose rate moves the
    weights in float32 are judged: bf16 parameters updated in place warn (at a judged step's rate), fp32 ones do not."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        probe, metrics = scheduled(dtype, "constant_with_warmup", warmup=4)
    assert probe.measured == len(metrics[METRIC]) and PROBE_WINDOW - 1 <= probe.measured < PROBE_WINDOW  # not lr 0
    assert (max(metrics[METRIC]) < 0.5) if warns else (min(metrics[METRIC]) >= 0.9)
    lines = warnings_of(caplog)
    assert len(lines) == int(warns)
    if warns:
        assert "bf16 parameters updated in place" in lines[0] and "at learning rate 0 " not in lines[0]


def test_gradient_accumulation_and_warm_up_in_a_run(tmp_path, caplog):
    """A trainer run with gradient accumulation and a long warm-up (the issue's fp32 run at lr 1e-6): its first
    optimizer steps are too small to judge, so nothing is logged or warned; the run still trains."""
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = train_sync(tmp_path, torch.float32, gradient_accumulation_steps=2, warmup_steps=2000)
    assert not logged(trainer) and not warnings_of(caplog)
    probe = next(c for c in trainer.callback_handler.callbacks if isinstance(c, UpdateProbe))
    assert probe.measured == 0 and len(logged(trainer, "loss")) == 3 and logged(trainer, "learning_rate")[1] > 0


def test_deepspeed_gets_the_probe_of_its_masters():
    callbacks = []
    accelerator = SimpleNamespace(mixed_precision="bf16", native_amp=True, is_main_process=True)
    trainer = SimpleNamespace(is_deepspeed_enabled=True, add_callback=callbacks.append, accelerator=accelerator)
    assert isinstance(attach_update_probe(trainer, {}, log_metric=True), MasterUpdateProbe) and len(callbacks) == 1
    trainer.is_deepspeed_enabled = False
    assert type(attach_update_probe(trainer, {}, log_metric=True)) is UpdateProbe and len(callbacks) == 2


class ZeroLike:
    """What ZeRO-1/2 does around its torch optimizer (deepspeed/runtime/zero/stage_1_and_2.py, ``step``): fp32 flat
    partitions of each group are the optimizer's parameters, each gets its gradient just before its group's step, with
    ``param_groups`` swapped to that one group, and loses it just after; the module's bf16 copies get the new values
    and never hold a gradient. accelerate's wrapper holds it as ``.optimizer``, as it holds the engine's optimizer."""

    def __init__(self, module_params, lr):
        self.module_params = module_params
        self.masters = [torch.nn.Parameter(p.detach().float().reshape(-1).clone()) for p in module_params]
        self.optimizer = torch.optim.AdamW([{"params": [m]} for m in self.masters], lr=lr)

    def step(self, grads):
        groups = self.optimizer.param_groups
        for index, (master, grad) in enumerate(zip(self.masters, grads, strict=True)):
            master.grad = grad.float().reshape(-1)
            self.optimizer.param_groups = [groups[index]]
            self.optimizer.step()
            self.optimizer.param_groups = groups
            master.grad = None
        for param, master in zip(self.module_params, self.masters, strict=True):
            param.data.copy_(master.detach().reshape(param.shape))


def test_under_deepspeed_the_probe_reads_the_fp32_masters_around_zeros_own_step(caplog):
    """bf16 module parameters whose fp32 masters DeepSpeed steps at lr 1e-6: the masters move (~every element), the
    bf16 copies ~2% (the number the module-parameter probe would report, a false alarm under DeepSpeed). Two groups:
    one value per group too; a step past the window, or with no gradient, is not judged."""
    generator = torch.Generator().manual_seed(0)
    module = [torch.nn.Parameter((torch.randn(256, 256, generator=generator) * 0.02).bfloat16()) for _ in range(2)]
    zero = ZeroLike(module, lr=1e-6)
    wrapper = SimpleNamespace(optimizer=zero)  # accelerate's AcceleratedOptimizer around the engine's optimizer
    metrics = {"train": defaultdict(list)}
    probe = MasterUpdateProbe(Accelerator(cpu=True), metrics)
    state = SimpleNamespace(global_step=0)
    probe.on_train_begin(None, state, None, optimizer=wrapper)
    copies_before = [p.detach().clone() for p in module]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        zero.step([torch.randn(256, 256, generator=generator) for _ in module])  # inside accelerate's backward
        probe.on_pre_optimizer_step(None, state, None, optimizer=wrapper)
        probe.on_optimizer_step(None, state, None, optimizer=wrapper)
    train = metrics["train"]
    assert train[METRIC][0] >= 0.99 and min(train[f"{METRIC}/group0"][0], train[f"{METRIC}/group1"][0]) >= 0.99
    copies_changed = sum(int((p != b).sum()) for p, b in zip(module, copies_before, strict=True)) / (2 * 256 * 256)
    assert copies_changed < 0.05 and not warnings_of(caplog)
    zero.step([torch.zeros(256, 256) for _ in module])  # no gradient: not judged
    probe.on_optimizer_step(None, state, None, optimizer=wrapper)
    state.global_step = precision.PROBE_STEPS  # past the window: the hooks take nothing
    zero.step([torch.randn(256, 256, generator=generator) for _ in module])
    probe.on_optimizer_step(None, state, None, optimizer=wrapper)
    assert len(train[METRIC]) == 1 and probe.measured == 1
    probe.on_train_end(None, state, None)  # the hooks are gone: a later step in the window measures nothing
    state.global_step = 1
    zero.step([torch.randn(256, 256, generator=generator) for _ in module])
    probe.on_optimizer_step(None, state, None, optimizer=wrapper)
    assert len(train[METRIC]) == 1


def test_float32_steps_below_resolution_name_the_learning_rate():
    line = precision.rounded_away_message(0.01, 2, 1e-12, torch.float32)
    assert "float32 parameters" in line and "raise the learning rate" in line and "bf16" not in line
    assert "fp16 parameters updated in place" in precision.rounded_away_message(0.01, 1, 1e-6, torch.float16)


def test_lora_on_a_bf16_base_trains_fp32_adapters(tmp_path, caplog):
    """PEFT's autocast_adapter_dtype (on by default, as TRL calls get_peft_model): the frozen base stays bf16, every
    adapter -- attention, router and fused experts (target_parameters) -- is fp32, so LoRA keeps its updates."""
    from peft import LoraConfig

    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "gate"],
        task_type="CAUSAL_LM",
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_strategy="no",
        seed=0,
        learning_rate=1e-5,
        bf16=True,
        routing_replay="r3",
    )
    trainer = MoEReplayGRPOTrainer(
        model=tiny_moe_model("qwen3_moe", dtype=torch.bfloat16),
        reward_funcs=reward_len,
        peft_config=config,
        args=MoEReplayGRPOConfig(**values),
        processing_class=tiny_tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}),
    )
    params = dict(trainer.model.named_parameters())
    trainable = {name for name, param in params.items() if param.requires_grad}
    assert trainable and all("lora_" in name and params[name].dtype == torch.float32 for name in trainable)
    assert any(".gate." in name for name in trainable) and any("experts" in name for name in trainable)
    assert {params[name].dtype for name in params.keys() - trainable} == {torch.bfloat16}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer.train()
    assert min(logged(trainer)) >= 0.9 and not warnings_of(caplog)


# ------------------------------------------------------------------------------------------------ shipped configs
CONFIGS = sorted((Path(__file__).resolve().parents[2] / "recipes" / "configs").glob("*.yaml"))
MASTERS_BY_ENGINE = {"zero2": "DeepSpeed", "zero3": "DeepSpeed", "fsdp2": "FSDP2"}  # accelerate configs


def fp32_masters(values: dict, text: str) -> str | None:
    """Where a config's trainable parameters keep fp32 values, derived from its fields and its launch line; ``None``
    when they would be bf16 updated in place.

    DeepSpeed (bf16 on) keeps fp32 masters in its optimizer; accelerate's FSDP2 with bf16 upcasts trainable
    parameters to fp32 and casts them per layer for compute; PEFT makes the adapters fp32 whatever the base; a model
    loaded in float32 is its own master (bf16: true then computes in bf16 under autocast); without a model named, the
    recipe builds the tiny offline MoE in float32."""
    engines = set(re.findall(r"--config_file recipes/accelerate/(\w+)\.yaml", text))
    if engines and all(engine in MASTERS_BY_ENGINE for engine in engines) and values.get("bf16"):
        return MASTERS_BY_ENGINE[sorted(engines)[0]]
    if values.get("use_peft"):
        return "PEFT adapters"
    if "model_name_or_path" not in values:
        return "tiny model in float32"
    return "float32 load" if values.get("dtype") == "float32" else None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_keeps_fp32_masters_and_says_what_they_cost(path):
    text = path.read_text()
    values = yaml.safe_load(text)
    assert fp32_masters(values, text) is not None, f"{path.name}: bf16 parameters updated in place"
    header = "\n".join(
        line
        for line in text.splitlines()[
            : next(i for i, line in enumerate(text.splitlines()) if not line.startswith("#"))
        ]
    )  # the leading comment lines
    assert "# Precision: " in header  # the master-weight choice, in the header
    if "model_name_or_path" in values:  # a real model: computes in bf16, and the header counts the memory
        assert values["bf16"] is True and "bytes/param" in header and " GB" in header


def test_the_rule_finds_the_trap_it_is_for():
    launch = "accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/grpo_r3.py"
    assert fp32_masters({"model_name_or_path": "m", "dtype": "bfloat16", "bf16": True}, launch) is None
    assert fp32_masters({"model_name_or_path": "m", "bf16": True}, launch) is None  # TRL's default: the checkpoint's
    assert (
        fp32_masters({"model_name_or_path": "m", "dtype": "bfloat16", "bf16": True}, launch.replace("ddp", "zero3"))
        == "DeepSpeed"
    )


# ------------------------------------------------------------------------------------------------------------ fp16
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_replay_under_fp16_autocast_reproduces_the_natural_forward(family):
    """fp16=True runs the forward under fp16 autocast: the router's logits are fp16, replay gathers the fp32 softmax
    of those logits (DESIGN.md "Replay math"), so replaying the natural routes is bit for bit the natural forward."""
    from trl_moe_replay.routing import RouterReplay

    from tests.helpers import random_ids, shifted

    model = tiny_moe_model(family)
    replay = RouterReplay(model)
    ids = random_ids(2, 9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        natural = model(ids).logits
        with replay.record() as recorded:
            model(ids)
        with replay.replay(recorded.routes):
            assert torch.equal(model(ids).logits, natural)
        with replay.replay(shifted(recorded.routes, replay.num_experts)):
            assert not torch.equal(model(ids).logits, natural)
    assert natural.dtype == torch.float16


@pytest.mark.parametrize("mode", ["r3", "r2", "pr2"])
def test_fp16_on_a_cpu_trains_every_replay_mode_in_float32_and_says_so(tmp_path, mode, caplog):
    """Trainer and accelerate accept fp16=True on a CPU, but accelerate turns on fp16 autocast (and its GradScaler)
    only on GPU-type devices: on a CPU the run computes in float32. What fp16 does to replay is the test above; on a
    GPU the forward runs under fp16 autocast with a GradScaler (the Trainer unscales before clipping, PR2's
    predictors included). If accelerate starts autocasting fp16 on CPUs, this test says so."""
    computed = set()
    model = tiny_moe_model("qwen3_moe")
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, output: computed.add(output.dtype))
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_strategy="no",
        seed=0,
        learning_rate=1e-5,
        bf16=False,
        fp16=True,
        routing_replay=mode,
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainer = MoEReplayGRPOTrainer(
            model=model,
            reward_funcs=reward_len,
            args=MoEReplayGRPOConfig(**values),
            processing_class=tiny_tokenizer(),
            train_dataset=Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}),
        )
    # nothing silent: one line says fp16 is not applied here
    assert [line for line in warnings_of(caplog) if line.startswith("fp16=True")] == [
        precision.fp16_not_applied_message(trainer.accelerator)
    ]
    assert "computes in float32" in precision.fp16_not_applied_message(trainer.accelerator)
    assert trainer.accelerator.mixed_precision == "fp16" and not trainer.accelerator.native_amp
    assert trainer.accelerator.scaler is None
    trainer.train()
    assert computed == {torch.float32} and len(logged(trainer, "loss")) == 2
    assert logged(trainer, "routing/fallback_frac") == [0.0, 0.0] and min(logged(trainer)) >= 0.9
