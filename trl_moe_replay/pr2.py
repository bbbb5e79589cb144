"""PR2 (Predictive Routing Replay) inside the trainer: predicted routes, the predictor cache, loss and bookkeeping.

The predictors and their loss live in ``routing.predictor``; this module holds the per-run state and is called by
``MoEReplayGRPOTrainer`` at a few points of each generation batch:

1. Old-logprob pass, per chunk (``old_pass_chunk``): the routers are steered to the predicted routes (unless the
   rollout's routes are replayed, ``pr2_rollout_prediction``), and router inputs and logits are cached at evenly
   spaced completion positions. The recorded routes are replayed in every update, exactly like R2's.
2. ``take_old_pass_cache``: the cache as batch-dict tensors (``pr2_positions`` ``[B, T]``, ``pr2_router_inputs``
   ``[B, T, L_moe, hidden]`` in the router-input dtype, ``pr2_old_logits`` ``[B, T, L_moe, E]`` fp32), which ride
   with their samples through TRL's buffer, shuffle and split, like ``replay_routes``.
3. Training forward of each micro-batch (``watch_training_forward``): the current router's logits, natural ids and
   replayed ids at the cached positions, taken from the forward the policy loss runs anyway.
4. After the micro-batch's backward (``train_step``): metric sums, and from the first update after the
   old-logprob pass on (off-policy mini-steps; the paper's Alg. 2 skips the on-policy first one) the predictor loss
   ``KL(sg[current router distribution] || softmax(old logits + predictor(old router input)))``, back-propagated
   into the predictors only.

No cross-gradients: the predictors only steer no-grad forwards (old-logprob pass, ``generate``), so the policy
loss never sees them; their loss reads detached cached tensors and detached current logits, so it reaches no
model parameter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from .routing import RouterCall, RouterReplay, RouteValidationError
from .routing.predictor import RoutePredictors, predictor_kl

PREDICTORS_FILE = "pr2_predictors.safetensors"
CACHE_KEYS = ("pr2_positions", "pr2_router_inputs", "pr2_old_logits")


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
        self._grad_window: int | None = None

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
        """The cached chunks as batch-dict tensors (empty dict when nothing was cached), and start a new schedule."""
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
        """Drop predictor gradients left from an earlier optimizer step (the Trainer zeroes only the model's)."""
        if self._grad_window != global_step:
            for param in self.predictors.parameters():
                param.grad = None
            self._grad_window = global_step

    def train_step(
        self, global_step: int, *, grad_scale: float, backward: Callable[[torch.Tensor], None]
    ) -> dict[str, torch.Tensor] | None:
        """Metric sums for the micro-batch just trained, and the predictor loss's backward when off-policy.

        Returns ``None`` when the micro-batch carried no PR2 cache; otherwise 0-dim sums: ``tokens``, ``pairs``
        (token x layer), ``overlap`` (|replayed ∩ current natural| / k), ``coverage_gap``, and ``kl`` (sum over
        tokens of the layer-summed KL) on the off-policy mini-steps where the predictors train.
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
        sums = {
            "tokens": torch.tensor(float(tokens), device=overlap.device),
            "pairs": torch.tensor(float(tokens * len(self.moe_layers)), device=overlap.device),
            "overlap": overlap.detach(),
            "coverage_gap": coverage_gap.detach(),
        }
        if train:
            # sum over layers, mean over tokens (the paper's loss), averaged over the accumulated micro-batches
            if tokens:
                backward(kl_sum / tokens * grad_scale)
            sums["kl"] = kl_sum.detach()
        return sums

    @staticmethod
    def metrics(total: dict[str, torch.Tensor]) -> dict[str, float]:
        """``pr2/*`` metric values from (cross-rank) ``train_step`` sums."""
        pairs, tokens = total["pairs"].clamp(min=1.0), total["tokens"].clamp(min=1.0)
        values = {
            "pr2/topk_agreement": (total["overlap"] / pairs).item(),
            "pr2/coverage_gap": (total["coverage_gap"] / pairs).item(),
        }
        if "kl" in total:
            values["pr2/loss"] = (total["kl"] / tokens).item()
        return values

    # ------------------------------------------------------------------ optimizer and checkpoints
    def add_to_optimizer(self, optimizer: torch.optim.Optimizer, lr: float, num_processes: int) -> None:
        """Give the predictors their own param group (no weight decay) and, with several processes, average their
        gradients across ranks before each step (they are not inside the DDP-wrapped model)."""
        params = list(self.predictors.parameters())
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) in present for p in params):
            return
        optimizer.add_param_group({"params": params, "lr": lr, "weight_decay": 0.0})
        if num_processes > 1:
            optimizer.register_step_pre_hook(lambda *_: self._average_gradients(num_processes))

    def _average_gradients(self, num_processes: int) -> None:
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

    def save(self, folder: str) -> str:
        path = os.path.join(folder, PREDICTORS_FILE)
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.predictors.state_dict().items()}
        save_file(state, path, metadata={"format": "pt", "moe_layers": ",".join(map(str, self.moe_layers))})
        return path

    def load(self, folder: str) -> bool:
        """Load the predictors saved in ``folder`` in place (the optimizer keeps its references); False if absent."""
        path = os.path.join(folder, PREDICTORS_FILE)
        if not os.path.isfile(path):
            return False
        state = load_file(path)
        expected = self.predictors.state_dict()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            raise ValueError(
                f"{path} holds predictors {sorted((k, tuple(v.shape)) for k, v in state.items())}, but this model "
                f"needs {sorted((k, tuple(v.shape)) for k, v in expected.items())}"
            )
        self.predictors.load_state_dict(state)
        return True
