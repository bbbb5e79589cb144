"""PR2's per-run state: predicted routes, the predictor cache, loss and bookkeeping.

The predictors and their loss live in ``pr2.predictor``; this module holds the per-run state, which
``PR2TrainerMixin`` (``pr2.trainer_mixin``) calls at a few points of each generation batch:

1. Old-logprob pass, per chunk (``old_pass_chunk``): the routers are steered to the predicted routes (unless the
   rollout's routes are replayed, ``pr2_rollout_prediction``), and router inputs and logits are cached at evenly
   spaced completion positions. The recorded routes are replayed in every update, exactly like R2's.
2. ``take_old_pass_cache``: the cache as per-sample tensors (``pr2_positions`` ``[B, T]``, ``pr2_router_inputs``
   ``[B, T, L_moe, hidden]`` in the router-input dtype, ``pr2_old_logits`` ``[B, T, L_moe, E]`` fp32), which the
   trainer keeps in its route buffer beside the batch's routes; each micro-batch gathers its own rows by its
   ``route_rows`` (``core/route_flow.py``), so they follow their samples through TRL's shuffle and split.
3. Training forward of each micro-batch (``watch_training_forward``): the current router's logits, natural ids and
   replayed ids at the cached positions, taken from the forward the policy loss runs anyway.
4. Right after that forward (``training_loss``): metric sums, and from the first update after the old-logprob
   pass on (off-policy mini-steps; the paper's Alg. 2 skips the on-policy first one) the predictor loss
   ``KL(sg[current router distribution] || softmax(old logits + predictor(old router input)))``, which the trainer
   adds to the policy loss's graph, so one backward and one optimizer step serve both.

The predictors are registered in the model (``model.pr2_predictors``), so DDP, FSDP and DeepSpeed hold, shard,
clip, checkpoint and optimize them like any parameter; they are left out of ``save_pretrained`` (seam entry
``keys_ignored_on_save``) and saved on their own in each checkpoint (``pr2_predictors.safetensors``), before
TRL's files and atomically (a temporary file renamed into place), so a checkpoint with TRL's ``trainer_state.json``
(written last) always has its predictors; resuming refuses a checkpoint without them (a save cut short, or a run
without PR2) rather than restarting them from zero under their restored optimizer state.

Non-finite predictor weights stop training with :class:`PR2StateError`: they would steer every later route to
garbage (top-k of NaN). They are checked when loaded, after every optimizer step on one device or under DDP, and on
every engine through the predictor loss (NaN KL) and before each checkpoint is written.

No cross-gradients: the predictors only steer no-grad forwards (old-logprob pass, ``generate``), so the policy
loss never sees them; their loss reads detached cached tensors and detached current logits, so it reaches no
other model parameter.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator

import torch
from accelerate.utils import is_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import TrlMoeReplayError
from ..parallel.sharded import full_tensors, is_dtensor
from ..routing import RouterCall, RouterReplay, RouteValidationError
from ..upstream.torch_seam import ignore_in_ddp
from ..upstream.transformers_seam import ignore_on_save
from .predictor import RoutePredictors, predictor_kl


PREDICTORS_FILE = "pr2_predictors.safetensors"
CACHE_KEYS = ("pr2_positions", "pr2_router_inputs", "pr2_old_logits")
#: attribute under which the predictors are registered in the (transformers) model
MODULE_NAME = "pr2_predictors"
#: marks the predictors' optimizer param group (engines that flatten groups keep the group dict, not its params)
PARAM_GROUP_KEY = "pr2_predictors"


class PR2CheckpointError(TrlMoeReplayError, ValueError):
    """A checkpoint that cannot resume this run's PR2 state: predictors missing, not finite, or of another mode."""


class PR2StateError(TrlMoeReplayError, RuntimeError):
    """The PR2 predictors' weights or loss are not finite; the run stops instead of replaying garbage routes."""


def cached_positions(attention_mask: torch.Tensor, logits_to_keep: int, max_tokens: int) -> torch.Tensor:
    """Per row, up to ``max_tokens`` completion positions evenly spaced along its real completion tokens.

    ``attention_mask`` is ``[B, S]`` over prompt + completion, whose last ``logits_to_keep`` columns are the
    completion. Returns ``[B, T]`` absolute positions (``T = min(max_tokens, longest completion)``), ``-1`` in
    unused slots. Completions, not prompts: each sample's own tokens (a prompt repeats across its group) and the
    ones the policy loss is taken on.
    """
    batch, width = attention_mask.shape
    if not 0 < logits_to_keep <= width:
        raise ValueError(f"logits_to_keep={logits_to_keep} must lie in [1, {width}] (the input width)")
    completion = attention_mask[:, width - logits_to_keep :].bool()
    counts = completion.sum(dim=1)  # [B]
    slots = min(max_tokens, int(counts.max()))
    device = attention_mask.device
    # position of the r-th real completion token of each row
    rank = completion.long().cumsum(dim=1) - 1
    rows, cols = completion.nonzero(as_tuple=True)
    position_of_rank = torch.full((batch, logits_to_keep), -1, dtype=torch.long, device=device)
    position_of_rank[rows, rank[rows, cols]] = cols + (width - logits_to_keep)
    j = torch.arange(slots, device=device)[None, :]
    spread = torch.div(j * (counts[:, None] - 1), max(max_tokens - 1, 1), rounding_mode="floor")
    target = torch.where(counts[:, None] > max_tokens, spread, j)  # long rows: evenly spaced; short rows: all
    positions = position_of_rank.gather(1, target.clamp(max=logits_to_keep - 1))
    return torch.where(j < counts[:, None], positions, -1)


class _SlotGather:
    """Maps the flattened tokens of a forward (``[rows * S]``) to the ``[rows, T]`` position slots."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self.valid = positions >= 0
        self._flat: torch.Tensor | None = None

    def flat_index(self, num_tokens: int, layer: int) -> torch.Tensor:
        rows, slots = self.positions.shape
        if num_tokens % max(rows, 1) != 0:
            raise RouteValidationError(
                f"the router of layer {layer} saw {num_tokens} tokens, not a multiple of the {rows} sequences whose "
                "PR2 positions were chosen; PR2 needs one forward per chunk over exactly those rows"
            )
        if self._flat is None:
            width = num_tokens // rows
            base = torch.arange(rows, device=self.positions.device)[:, None] * width
            self._flat = (base + self.positions.clamp(min=0)).reshape(-1)
        return self._flat


class _OldPassCollector:
    """Observer of one old-logprob chunk: router inputs and logits of every MoE layer at the cached positions."""

    def __init__(self, positions: torch.Tensor, moe_layers: list[int]):
        self.moe_layers = moe_layers
        self.gather = _SlotGather(positions)
        self.inputs: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def __call__(self, call: RouterCall) -> None:
        if call.layer in self.inputs:
            raise RouteValidationError(f"the router of layer {call.layer} ran twice in one PR2 old-logprob chunk")
        flat = self.gather.flat_index(call.router_input.shape[0], call.layer).to(call.router_input.device)
        rows, slots = self.gather.positions.shape
        valid = self.gather.valid.to(call.router_input.device)[..., None]
        inputs = call.router_input.detach()[flat].view(rows, slots, call.router_input.shape[-1])
        logits = call.logits.detach()[flat].float().view(rows, slots, call.logits.shape[-1])
        device = self.gather.positions.device
        self.inputs[call.layer] = torch.where(valid, inputs, 0).to(device)
        self.logits[call.layer] = torch.where(valid, logits, 0).to(device)

    def result(self) -> dict[str, torch.Tensor]:
        missing = [layer for layer in self.moe_layers if layer not in self.inputs]
        if missing:
            raise RouteValidationError(f"PR2 old-logprob chunk: the routers of layers {missing} never ran")
        return {
            "pr2_positions": self.gather.positions,
            "pr2_router_inputs": torch.stack([self.inputs[layer] for layer in self.moe_layers], dim=2),
            "pr2_old_logits": torch.stack([self.logits[layer] for layer in self.moe_layers], dim=2),
        }


class _TrainingForwardWatcher:
    """Observer of one training forward: current logits, natural and used ids at the cached (valid) positions."""

    def __init__(self, positions: torch.Tensor):
        self.gather = _SlotGather(positions)
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, call: RouterCall) -> None:
        if call.layer in self.calls:
            raise RouteValidationError(f"the router of layer {call.layer} ran twice in one PR2 training forward")
        flat = self.gather.flat_index(call.logits.shape[0], call.layer).to(call.logits.device)
        keep = flat[self.gather.valid.reshape(-1).to(call.logits.device)]
        self.calls[call.layer] = (call.logits.detach()[keep].float(), call.natural[keep], call.used[keep])


class PredictiveRoutingReplay:
    """The PR2 state of one trainer: predictors, the old-logprob cache, the training-forward watch, the schedule."""

    def __init__(self, route_replay: RouterReplay, *, cached_tokens_per_sequence: int, rollout_prediction: bool):
        self.route_replay = route_replay
        self.predictors = RoutePredictors(route_replay.routers())
        self.moe_layers = self.predictors.moe_layers
        self.cached_tokens_per_sequence = cached_tokens_per_sequence
        self.rollout_prediction = rollout_prediction
        self.old_pass_step: int | None = None  # global step at which the current cache was recorded
        self._chunks: list[dict[str, torch.Tensor]] = []
        self._watched: tuple[dict, dict] | None = None
        self._window: int | None = None  # global step of the optimizer step being accumulated
        self._trained_in_window = False
        _register_in_model(route_replay.model, self.predictors)

    # ------------------------------------------------------------------ routing
    def steering(self) -> contextlib.AbstractContextManager:
        """Route every forward inside by the predicted routes (and record those)."""
        return self.route_replay.steer(self.predictors.choose)

    @contextlib.contextmanager
    def old_pass_chunk(
        self, attention_mask: torch.Tensor, logits_to_keep: int, *, steer: bool, cache: bool
    ) -> Iterator[None]:
        """Around one chunk of the old-logprob pass: steer (predicted routes) and/or cache predictor inputs."""
        collector = None
        with contextlib.ExitStack() as stack:
            if steer:
                stack.enter_context(self.steering())
            if cache:
                positions = cached_positions(attention_mask, logits_to_keep, self.cached_tokens_per_sequence)
                collector = _OldPassCollector(positions, self.moe_layers)
                stack.enter_context(self.route_replay.observe(collector))
            yield
        if collector is not None:
            self._chunks.append(collector.result())

    def take_old_pass_cache(self, global_step: int) -> dict[str, torch.Tensor]:
        """The cached chunks as per-sample tensors (empty dict when nothing was cached), and start a new schedule."""
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return {}
        slots = max(chunk["pr2_positions"].shape[1] for chunk in chunks)
        cache = {}
        for key in CACHE_KEYS:
            fill = -1 if key == "pr2_positions" else 0
            padded = []
            for chunk in chunks:
                value = chunk[key]
                pad = slots - value.shape[1]
                if pad:
                    value = torch.cat([value, value.new_full((value.shape[0], pad, *value.shape[2:]), fill)], dim=1)
                padded.append(value)
            cache[key] = torch.cat(padded, dim=0)
        self.old_pass_step = global_step
        return cache

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def watch_training_forward(self, inputs: dict) -> Iterator[None]:
        """Around a micro-batch's training forward: keep what the predictor loss and the metrics need."""
        if any(key not in inputs for key in CACHE_KEYS):
            yield
            return
        watcher = _TrainingForwardWatcher(inputs["pr2_positions"])
        with self.route_replay.observe(watcher):
            yield
        self._watched = ({key: inputs[key] for key in CACHE_KEYS}, watcher.calls)

    def begin_micro_step(self, global_step: int) -> None:
        """Called before each micro-batch: tracks whether the predictors train in the optimizer step under way."""
        if self._window != global_step:
            self._window, self._trained_in_window = global_step, False

    def training_loss(
        self, global_step: int, *, grad_scale: float, always_in_graph: bool = False
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]] | None:
        """The predictor loss and metric sums for the micro-batch whose training forward was just watched.

        Returns ``None`` when the micro-batch carried no PR2 cache; otherwise ``(loss, sums)``: ``loss`` (already
        scaled by ``grad_scale``, the gradient-accumulation factor) on the off-policy mini-steps where the predictors
        train, else ``None`` (or, with ``always_in_graph``, a zero through the predictors: every backward then gives
        them a zero gradient, which DeepSpeed needs, see the trainer); ``sums`` are 0-dim: ``tokens``, ``pairs``
        (token x layer), ``overlap`` (|replayed ∩ current natural| / k), ``coverage_gap``, and ``kl`` (sum over
        tokens of the layer-summed KL) when training.
        """
        watched, self._watched = self._watched, None
        if watched is None:
            return None
        cache, calls = watched
        missing = [layer for layer in self.moe_layers if layer not in calls]
        if missing:
            raise RouteValidationError(f"PR2: the routers of layers {missing} did not run in the training forward")
        train = self.old_pass_step is not None and global_step > self.old_pass_step
        valid = cache["pr2_positions"] >= 0
        router_inputs, old_logits = cache["pr2_router_inputs"][valid], cache["pr2_old_logits"][valid]
        tokens = router_inputs.shape[0]
        overlap = coverage_gap = kl_sum = torch.zeros((), device=old_logits.device)
        for index, layer in enumerate(self.moe_layers):
            current, natural, used = calls[layer]
            k = used.shape[-1]
            overlap = overlap + ((natural[:, :, None] == used[:, None, :]).sum() / k).to(overlap.device)
            replayed_mass = torch.softmax(current, dim=-1).gather(1, used.long()).sum(dim=-1)
            coverage_gap = coverage_gap + (1.0 - replayed_mass).sum().to(coverage_gap.device)
            if train:
                shift = self.predictors.shift(layer, router_inputs[:, index])
                kl = predictor_kl(old_logits[:, index].to(shift.device), shift, current.to(shift.device))
                kl_sum = kl_sum + kl.sum().to(kl_sum.device)
            elif always_in_graph:
                kl_sum = kl_sum + self.predictors.shift(layer, router_inputs[:1, index]).sum().to(kl_sum.device) * 0.0
        sums = {
            "tokens": torch.tensor(float(tokens), device=overlap.device),
            "pairs": torch.tensor(float(tokens * len(self.moe_layers)), device=overlap.device),
            "overlap": overlap.detach(),
            "coverage_gap": coverage_gap.detach(),
        }
        loss = kl_sum if always_in_graph and not train else None
        if train:
            sums["kl"] = kl_sum.detach()
            # sum over layers, mean over tokens (the paper's loss), averaged over the accumulated micro-batches
            loss = kl_sum / max(tokens, 1) * grad_scale
            self._trained_in_window = True
        return loss, sums

    @staticmethod
    def metrics(total: dict[str, torch.Tensor]) -> dict[str, float]:
        """``pr2/*`` metric values from (cross-rank) ``training_loss`` sums."""
        pairs, tokens = total["pairs"].clamp(min=1.0), total["tokens"].clamp(min=1.0)
        values = {
            "pr2/topk_agreement": (total["overlap"] / pairs).item(),
            "pr2/coverage_gap": (total["coverage_gap"] / pairs).item(),
        }
        if "kl" in total:
            values["pr2/loss"] = (total["kl"] / tokens).item()
        return values

    # ------------------------------------------------------------------ optimizer
    @contextlib.contextmanager
    def hidden_from_optimizer(self) -> Iterator[None]:
        """Inside, the predictors do not require grad, so an optimizer built from the model's trainable parameters
        (``Trainer.create_optimizer``) leaves them out; :meth:`add_to_optimizer` then gives them their own group."""
        params = list(self.predictors.parameters())
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p, flag in zip(params, flags, strict=True):
                p.requires_grad_(flag)

    def add_to_optimizer(self, optimizer: torch.optim.Optimizer, lr: float, *, check_finite: bool = True) -> None:
        """Give the predictors their own param group (``lr``, no weight decay) and skip that group in optimizer
        steps where they did not train.

        Without the skip, an engine that flattens each param group (DeepSpeed ZeRO) would hand the optimizer zero
        gradients on the on-policy steps, and Adam's momentum would still move the predictors; with it, every
        engine behaves as a single device does when a parameter has no gradient (Adam leaves it and its state).
        ``check_finite``: check the predictors after every optimizer step that trained them (where each rank holds
        them whole: one device, DDP).
        """
        if any(group.get(PARAM_GROUP_KEY) for group in optimizer.param_groups):
            return  # the Trainer returns its optimizer again on a second create_optimizer() call
        params = list(self.predictors.parameters())
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) in present for p in params):
            raise ValueError(
                "the PR2 predictors are already in the optimizer; build it inside hidden_from_optimizer() so that "
                "they get their own param group"
            )
        optimizer.add_param_group({"params": params, "lr": lr, "weight_decay": 0.0, PARAM_GROUP_KEY: True})
        optimizer.register_step_pre_hook(self._skip_untrained_group)
        if check_finite:
            optimizer.register_step_post_hook(self._check_finite_after_step)

    def _check_finite_after_step(self, optimizer: torch.optim.Optimizer, *_) -> None:
        if self._trained_in_window:
            self.check_finite(dict(self.predictors.named_parameters()), "after an optimizer step")

    @staticmethod
    def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
        """Raise :class:`PR2StateError` if a predictor weight in ``state`` is NaN or infinite."""
        bad = sorted(name for name, value in state.items() if not torch.isfinite(value.detach()).all())
        if bad:
            raise PR2StateError(
                f"PR2 predictor weights {bad} are not finite ({where}). They would steer every later route to garbage "
                "(the top-k of NaN logits), so training stops. Resume from an earlier checkpoint with a lower "
                "pr2_lr_multiplier or max_grad_norm, or train with routing_replay='r2' (PR2 without predictors)."
            )

    def _skip_untrained_group(self, optimizer: torch.optim.Optimizer, *_) -> None:
        if self._trained_in_window:
            return
        for group in optimizer.param_groups:
            if group.get(PARAM_GROUP_KEY):
                for param in group["params"]:
                    param.grad = None

    def average_gradients(self, num_processes: int) -> None:
        """Average the predictors' gradients across ranks (plain data parallelism, where DDP is told to ignore them:
        they are used outside the model's forward). Call on every rank after the backward that completes an
        optimizer step's accumulation, before gradient clipping."""
        # every rank trains the predictors on the same micro-steps, so all or none of them hold gradients
        grads = [p.grad for p in self.predictors.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        torch.distributed.all_reduce(flat)
        flat /= num_processes
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def without_predictors(self, model: nn.Module) -> _ParametersView:
        """``model`` as ``Trainer._clip_grad_norm`` reads it (``.parameters()`` only), less the predictors."""
        own = {id(p) for p in self.predictors.parameters()}
        return _ParametersView([p for p in model.parameters() if id(p) not in own])

    def clip_gradients(self, max_norm: float) -> float | None:
        """Clip the predictors' gradients to ``max_norm`` by their own norm; that norm (None without gradients)."""
        with_grad = [p for p in self.predictors.parameters() if p.grad is not None]
        if not with_grad:
            return None
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
        return float(norm.full_tensor() if is_dtensor(norm) else norm)  # FSDP2: a DTensor over the shards

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The predictors' full weights on the CPU (a collective under FSDP2 and ZeRO-3: call on every rank)."""
        return full_tensors(dict(self.predictors.named_parameters()))

    def save(self, folder: str, state: dict[str, torch.Tensor] | None = None) -> str:
        """Write ``state`` (default: :meth:`full_state_dict`) to ``folder/pr2_predictors.safetensors``, atomically:
        a kill at any moment leaves the file whole or absent (never half written), and the previous file whole."""
        path = os.path.join(folder, PREDICTORS_FILE)
        state = self.full_state_dict() if state is None else state
        self.check_finite(state, f"writing {path}")
        os.makedirs(folder, exist_ok=True)
        for stale in glob.glob(glob.escape(path) + ".partial-*"):  # left by a save that was killed
            os.remove(stale)
        partial = f"{path}.partial-{os.getpid()}"
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            partial,
            metadata={"format": "pt", "moe_layers": ",".join(map(str, self.moe_layers))},
        )
        _flush_to_disk(partial)
        os.replace(partial, path)  # atomic on POSIX and Windows: the name holds the old file or the new one
        _flush_to_disk(folder)
        return path

    def load(self, folder: str, *, restored_by_engine: bool = False) -> bool:
        """Restore the predictors saved in ``folder`` (False if there are none); non-finite weights raise
        :class:`PR2CheckpointError`.

        Plain or DDP training: loaded in place (the optimizer keeps its references). DeepSpeed and FSDP restore the
        predictors themselves with the rest of the model (``restored_by_engine``; their checkpoints hold every model
        parameter, and DeepSpeed keeps fp32 master copies a write here would not reach); the file is then checked
        against what they restored (a collective: call on every rank).
        """
        path = os.path.join(folder, PREDICTORS_FILE)
        if not os.path.isfile(path):
            return False
        state = load_file(path)
        try:
            self.check_finite(state, f"loaded from {path}")
        except PR2StateError as exc:
            raise PR2CheckpointError(f"{exc} The checkpoint {folder} is unusable for PR2.") from None
        expected = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in self.predictors.named_parameters()}
        if set(state) != set(expected) or any(tuple(state[k].shape) != expected[k] for k in expected):
            raise PR2CheckpointError(
                f"{path} holds predictors {sorted((k, tuple(v.shape)) for k, v in state.items())}, but this model "
                f"needs {sorted(expected.items())}"
            )
        if not restored_by_engine:
            self.predictors.load_state_dict(state)
            return True
        current = self.full_state_dict()
        differing = [name for name in state if not torch.equal(current[name], state[name].to(current[name].dtype))]
        if differing:
            raise PR2CheckpointError(
                f"{path} and the engine checkpoint in {folder} hold different PR2 predictors ({differing}); the "
                "folder mixes files of different runs or steps"
            )
        return True


def _flush_to_disk(path: str) -> None:
    """fsync a file or folder, so a rename that follows survives a machine crash, not only a killed process."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # folders cannot be opened on some systems (Windows): the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _ParametersView:
    """Stands for a model where only ``model.parameters()`` is read."""

    def __init__(self, params: list[nn.Parameter]):
        self._params = params

    def parameters(self):
        return iter(self._params)


def _register_in_model(model: nn.Module, predictors: RoutePredictors) -> None:
    """Register ``predictors`` as ``pr2_predictors`` of the transformers model inside ``model`` (under PEFT, its
    base model), keep them out of ``save_pretrained`` and out of DDP's gradient buckets.

    DDP must ignore them because their loss is taken after the model's forward (on cached inputs), which DDP's
    reducer does not allow for its own parameters; ``average_gradients`` reduces them instead. FSDP and DeepSpeed
    reduce them like any parameter.
    """
    base = model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]  # a PeftModel's method
    if hasattr(base, MODULE_NAME):
        raise ValueError(f"the model already has a `{MODULE_NAME}` attribute; one PR2 trainer per model")
    base.add_module(MODULE_NAME, predictors)
    ignore_on_save(base, {f"{MODULE_NAME}.{k}" for k in predictors.state_dict()})
    own = {id(p) for p in predictors.parameters()}
    names = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in own]
    ignore_in_ddp(model, names)
