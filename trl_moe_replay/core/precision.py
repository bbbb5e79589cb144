"""Updates that round away: what the first optimizer steps actually changed, measured, logged and warned about (one
implementation for both trainers, attached by :func:`attach_update_probe`).

A bf16 weight holds 8 significant bits, so its half-ulp is ~0.2% of its value: an AdamW step of lr 1e-6 on a weight of
~0.02 rounds back to the old value. A run that updates bf16 parameters in place (a bf16-loaded model without
DeepSpeed's or FSDP's fp32 master weights) logs a falling loss and a non-zero grad norm and learns next to nothing
(2% of the elements change per step at lr 1e-6). Plain TRL has the same trap; the probe only watches, so
``routing_replay="none"`` stays TRL's math bit for bit.

What is measured: on optimizer steps 1 to :data:`PROBE_STEPS` (by step number, so a run resumed inside that window
logs what the uninterrupted run did, and one resumed after it nothing; 20 steps, so a run whose first steps have no
gradient, e.g. every group's rewards equal, is still measured), for each parameter group: of the trainable elements
with a non-zero gradient whose step would show in float32 (an element of value ``w`` changes under a step of an
eighth of the learning rate, Adam's smaller steps, when half float32's gap at ``w`` is below it:
:func:`visible_at`), the fraction whose value changed. Only steps whose learning rate would move most of those
elements in float32 are judged: lr 0, and a warm-up's steps too small to show (an fp32 run at lr 1e-6 with 2,000
warm-up steps starts with steps of 5e-10, below the resolution of most of its weights) are neither logged nor warned
about, whatever the parameters' dtype; a warm-up longer than the window is not judged at all. With fp32 parameters
(fp32 load, bf16 autocast) Adam's first steps move each such element by about lr, so the fraction is ~1; bf16
parameters updated in place give ~2% at lr 1e-6. The measurement reads a strided sample of at most
:data:`SAMPLE_ELEMENTS` elements of each parameter (all of a small one), so it costs a few MB whatever the dtype, and
fp32 runs get a positive reading too (``precision/updated_frac`` >= 0.9) instead of a skip. Sharded parameters
(FSDP2, transformers' ``DistributedConfig``: DTensors) are read on the local shard and the counts summed over ranks.
The metric is logged where the routing metrics are (``routing_metrics``, on by default under replay):
``routing_replay="none"`` logs exactly TRL's keys, and only the warning says that its updates round away. Under
DeepSpeed (:class:`MasterUpdateProbe`) the module's bf16 parameters are copies of the fp32 masters, and ZeRO keeps no
``param.grad`` on them: the probe reads the masters instead, around the step of the torch optimizer ZeRO runs on its
fp32 partitions (the gradient is on them then), per shard, the counts summed over ranks as for FSDP2.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback
from transformers.utils import logging


logger = logging.get_logger(__name__)

METRIC = "precision/updated_frac"
PROBE_STEPS = (
    20  # optimizer steps 1-20 are measured (one with lr 0, no gradient or skipped by fp16's scaler logs nothing)
)
SAMPLE_ELEMENTS = 4096  # elements read per parameter (its local shard): every one of a smaller parameter
# of the elements with a non-zero gradient. fp32 parameters gave 0.987-1.0 (a tiny MoE on a CPU; 0.993-0.9995 over
# steps 1-3 of a 405M MoE on an H200, bench/precision_updates.py); bf16 ones 0.02 at lr 1e-6, 0.15 at 1e-5, 0.57 at
# 5e-5 (issue 42's table): below 0.8 a fifth of the updates rounded away, which fp32 never shows
WARN_BELOW = 0.8
# a step is judged when at least this share of the elements with a gradient would change at its learning rate in
# float32 (below it: lr 0, or a warm-up step too small to show on most weights, whatever their dtype)
JUDGED_SHARE = 0.5
# Adam moves an element by lr * |m / sqrt(v)|: lr at the first step, less later where gradients change sign. An
# element is judged when a step of lr / 8 still changes it in float32. With fresh random gradients at every step (the
# least favourable case), fp32 weights of std 0.02 under a 2,000-step warm-up at lr 1e-6: the judged steps among the
# first 20 changed >= 86.7% of their judged elements (79% with lr / 4, which would warn); measured on this project's
# 2-vCPU CI machine, numbers that do not depend on it (tests/core/test_precision.py runs the case)
ADAM_STEP_MARGIN = 8
_HALF_GAP = torch.finfo(torch.float32).eps / 2  # 2**-24: half the gap between float32 values, relative to them


def visible_at(values: torch.Tensor, lr: float) -> torch.Tensor:
    """Which of ``values`` a step of ``lr / ADAM_STEP_MARGIN`` changes in float32 (round to nearest: a step over half
    the gap to the next value): ``|w| * 2**-24 < lr / 8``. The bar a float32 master weight clears, whatever dtype
    ``values`` is held in."""
    return values.abs().float() * (_HALF_GAP * ADAM_STEP_MARGIN) < lr


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2, EP), the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """A strided sample of at most ``SAMPLE_ELEMENTS`` of ``tensor``'s elements, always the same ones, as a copy."""
    flat = _local(tensor).detach().reshape(-1)
    stride = max(1, -(-flat.numel() // SAMPLE_ELEMENTS))
    return flat[::stride].clone()


def rounded_away_message(fraction: float, step: int, lr: float, dtype: torch.dtype) -> str:
    """The one warning line: what was measured, the cause and the fix."""
    measured = (
        f"{fraction:.1%} of the trainable elements with a non-zero gradient (those a step of this size moves "
        f"in float32) changed in optimizer step {step} at learning rate {lr:g}"
    )
    if dtype in (torch.bfloat16, torch.float16):
        name = "bf16" if dtype == torch.bfloat16 else "fp16"
        return (
            f"updates round away: {name} parameters updated in place (no fp32 master weights): {measured}. Load "
            f"the model in float32 (model_init_kwargs={{'dtype': 'float32'}}; the recipe's dtype: float32) and "
            f"train with bf16=True (autocast computes in bf16), or use DeepSpeed or FSDP2 mixed precision, which "
            f"keep fp32 masters"
        )
    return (
        f"updates round away: {measured} ({str(dtype).removeprefix('torch.')} parameters); the steps are below "
        f"the weights' resolution: raise the learning rate"
    )


class UpdateProbe(TrainerCallback):
    """Measures, logs (``precision/updated_frac``, and ``precision/updated_frac/group{i}`` with several parameter
    groups) and warns once (:func:`rounded_away_message`) on the first optimizer steps; see the module docstring."""

    def __init__(self, accelerator, metrics: dict, log_metric: bool = True):
        self.accelerator = accelerator
        self.metrics = metrics  # the trainer's metric lists by mode, which TRL's log() averages
        self.log_metric = log_metric  # False: warn only (routing_replay="none" logs TRL's keys alone)
        self.measured = 0
        self.warned = False
        # the samples taken before the step in progress; None when it is not measured (the same on every rank, which
        # all take part in the sum over ranks, whatever their shard holds)
        self._before: list[tuple[int, torch.nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def _active(self, state) -> bool:
        # by step number, not by a count of this process's measurements: a resumed run measures the steps the
        # uninterrupted one did (global_step counts the steps finished before this one)
        return state.global_step < PROBE_STEPS

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._before = None
        if optimizer is None or not self._active(state):
            return
        before = []
        for index, group in enumerate(optimizer.param_groups):
            lr = float(group.get("lr") or 0.0)  # a tensor in some optimizers
            for param in group["params"]:
                if param.requires_grad and param.grad is not None:
                    old = _sample(param)
                    nonzero = _sample(param.grad) != 0
                    before.append((index, param, old, nonzero, nonzero & visible_at(old, lr)))
        self._before = before

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        before, self._before = self._before, None
        if before is None or getattr(optimizer, "step_was_skipped", False):  # fp16: the scaler skipped an overflow
            return
        groups = len(optimizer.param_groups)
        # per group: changed (of the visible), visible, non-zero gradient; int64, which every backend has (MPS has no
        # float64)
        counts = torch.zeros(groups, 3, dtype=torch.int64, device=self.accelerator.device)
        dtypes: dict[int, torch.dtype] = {}
        self._count(before, counts, dtypes)
        self._judge(counts, dtypes, state, [group["lr"] for group in optimizer.param_groups])

    def _count(self, before, counts: torch.Tensor, dtypes: dict[int, torch.dtype]) -> None:
        """Add to ``counts`` what the step changed of the samples ``before`` took (their parameters now stepped)."""
        device = counts.device
        for index, param, old, nonzero, visible in before:
            changed = (_sample(param) != old) & visible
            counts[index, 0] += changed.sum().to(device, torch.int64)  # on the device: no sync per parameter
            counts[index, 1] += visible.sum().to(device, torch.int64)
            counts[index, 2] += nonzero.sum().to(device, torch.int64)
            dtypes.setdefault(index, param.dtype)

    def _judge(self, counts: torch.Tensor, dtypes: dict[int, torch.dtype], state, lrs: list) -> None:
        """Sum ``counts`` over ranks (a collective: every rank calls it for the same steps), then log and warn."""
        groups = counts.shape[0]
        counts = self.accelerator.reduce(counts, reduction="sum").cpu().double()  # every rank's shard, every rank
        visible_total, nonzero_total = counts[:, 1].sum(), counts[:, 2].sum()
        # no gradient anywhere, or a learning rate (0, an early warm-up step) too small to move most weights even in
        # float32: nothing to judge, the step does not count
        if visible_total == 0 or visible_total < JUDGED_SHARE * nonzero_total:
            return
        self.measured += 1
        overall = (counts[:, 0].sum() / visible_total).item()
        if self.log_metric:
            metrics = self.metrics["train"]
            metrics[METRIC].append(overall)
            if groups > 1:  # e.g. the Trainer's decay / no-decay groups, PR2's predictors
                for index in range(groups):
                    if counts[index, 1] > 0:
                        metrics[f"{METRIC}/group{index}"].append((counts[index, 0] / counts[index, 1]).item())
        if overall < WARN_BELOW and not self.warned:
            self.warned = True
            if self.accelerator.is_main_process:
                largest = int(counts[:, 1].argmax())  # the group that holds most of the judged elements
                dtype = dtypes.get(largest, torch.float32)  # another rank's shard measured it if this one holds none
                # global_step counts the steps finished before this one
                logger.warning(rounded_away_message(overall, state.global_step + 1, lrs[largest], dtype))


def master_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that steps the fp32 masters under DeepSpeed: the innermost of accelerate's wrapper, the
    engine's ZeRO optimizer and the optimizer it wraps (each holds the next as ``.optimizer``)."""
    inner = optimizer
    for _ in range(8):  # three levels today; a bound, not a loop that could run forever on a cycle
        nested = getattr(inner, "optimizer", None)
        if nested is None or nested is inner:
            break
        inner = nested
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"the innermost optimizer under DeepSpeed is a {type(inner).__name__}, not a torch optimizer")
    return inner


class MasterUpdateProbe(UpdateProbe):
    """The probe under DeepSpeed: the same measurement on the fp32 masters DeepSpeed steps.

    ZeRO-1/2 and ZeRO-3 step a torch optimizer (the one the Trainer built, or DeepSpeedCPUAdam when offloading) on
    flat fp32 partitions of each parameter group, each partition's ``.grad`` set just before and freed just after
    (ZeRO-2 hands it one group at a time, ZeRO-3 one sub-group at a time): a step pre-hook and post-hook on that
    optimizer take the samples and count around each call, and ``on_optimizer_step`` (after accelerate's backward has
    run DeepSpeed's whole step) sums them over ranks. A step DeepSpeed skips (fp16 overflow) never calls the torch
    optimizer: nothing is counted, nothing judged."""

    def __init__(self, accelerator, metrics: dict, log_metric: bool = True):
        super().__init__(accelerator, metrics, log_metric)
        self._state = None
        self._groups: dict[
            int, int
        ] = {}  # id of a parameter group (DeepSpeed swaps the lists, not the dicts) -> index
        self._hooks: list = []
        self._counts: torch.Tensor | None = None
        self._dtypes: dict[int, torch.dtype] = {}
        self._lrs: list = []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._state = state
        inner = master_optimizer(optimizer)
        self._groups = {id(group): index for index, group in enumerate(inner.param_groups)}
        self._hooks = [inner.register_step_pre_hook(self._pre_step), inner.register_step_post_hook(self._post_step)]

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        pass  # DeepSpeed has stepped already (inside accelerate's backward); the hooks measured it

    def _pre_step(self, optimizer, args, kwargs):
        self._before = None
        if self._state is None or not self._active(self._state):
            return
        if self._counts is None:
            self._counts = torch.zeros(len(self._groups), 3, dtype=torch.int64, device=self.accelerator.device)
            self._dtypes, self._lrs = {}, [0.0] * len(self._groups)
        before = []
        for group in optimizer.param_groups:
            index = self._groups.get(id(group))
            if index is None:
                continue
            lr = float(group.get("lr") or 0.0)
            self._lrs[index] = lr
            for param in group["params"]:
                if param.grad is not None:
                    old = _sample(param)
                    nonzero = _sample(param.grad) != 0
                    before.append((index, param, old, nonzero, nonzero & visible_at(old, lr)))
        self._before = before

    def _post_step(self, optimizer, args, kwargs):
        before, self._before = self._before, None
        if before and self._counts is not None:
            self._count(before, self._counts, self._dtypes)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if not self._active(state):  # the same on every rank: all take part in the sum or none does
            return
        counts, self._counts = self._counts, None
        if counts is None:  # this rank's optimizer did not step (skipped): it still joins the sum
            counts = torch.zeros(len(self._groups), 3, dtype=torch.int64, device=self.accelerator.device)
            self._lrs = self._lrs or [0.0] * len(self._groups)
        self._judge(counts, self._dtypes, state, self._lrs)


def fp16_not_applied_message(accelerator) -> str | None:
    """The one warning line for ``fp16=True`` that accelerate does not apply: it turns on fp16 autocast and its
    GradScaler only on GPU-type devices, so on a CPU the run computes in float32 (``None`` when fp16 is applied or
    not asked for)."""
    if accelerator.mixed_precision != "fp16" or accelerator.native_amp:
        return None
    return (
        f"fp16=True, but accelerate runs fp16 autocast only on GPU-type devices: this run on "
        f"{accelerator.device.type} computes in float32 (no fp16 autocast, no GradScaler). Train on a GPU for "
        "fp16, or pass fp16=False to say float32."
    )


def attach_update_probe(trainer, metrics: dict, *, log_metric: bool) -> UpdateProbe | None:
    """Add the probe to ``trainer``'s callbacks, logging into ``metrics`` (TRL's metric lists by mode) when
    ``log_metric`` (the run's ``routing_metrics``; without it the probe only warns); both trainers call this at the end
    of ``__init__``. Under DeepSpeed, which keeps the fp32 masters inside its optimizer, :class:`MasterUpdateProbe`
    reads them. Also says, in one line, when ``fp16=True`` is not applied (:func:`fp16_not_applied_message`)."""
    if trainer.is_deepspeed_enabled:  # DeepSpeed also applies fp16 itself: no fp16 line
        probe: UpdateProbe = MasterUpdateProbe(trainer.accelerator, metrics, log_metric)
        trainer.add_callback(probe)
        return probe
    if (message := fp16_not_applied_message(trainer.accelerator)) and trainer.accelerator.is_main_process:
        logger.warning(message)
    probe = UpdateProbe(trainer.accelerator, metrics, log_metric)
    trainer.add_callback(probe)
    return probe
