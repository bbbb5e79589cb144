"""Router probabilities at given experts, for RSPO's router-shift weight.

``RouterProbes(router_replay)`` watches every router call through ``RouterReplay.observe``, which reports the
router's logits and the ids the block actually used (the replayed ids under R2/R3, the predicted ones under PR2, the
router's natural ones otherwise). Two contexts, one active at a time:

* ``with probes.capture(batch, seq) as cap:`` around one forward (the old-logprob pass, chunk by chunk) stores the
  ids actually used and the router probabilities there: ``cap.ids`` in the routes' compact dtype (``route_dtype``:
  ``uint8`` up to 255 experts, or 256 with ``top_k >= 2``, else ``int16``) and ``cap.probs`` float16, both
  ``[B, S, num_layers, top_k]`` on the CPU (dense layers: no route, probability 0).
* ``with probes.at(ids) as reading:`` around one forward (a training forward) reads the current router's
  probabilities at the given ids: ``reading.probs`` float32 ``[B, S, num_layers, top_k]`` (0 where ``ids < 0``).

*Router probability* means the softmax over all experts of the router's logits (in float32), for every family.
For softmax routers (Mixtral, Qwen-MoE, OLMoE, ...) that is the routing score itself; for routers that score by
sigmoid (DeepSeek-V3 style, whose gate weights are sigmoids of the logits) or softmax over the selected logits only
(GPT-OSS) it is a per-token normalisation of the same logits, so ``|log r - log r_old|`` still measures how far the
router's preference for those experts moved. Calls made during backward (activation-checkpoint recompute) are
ignored. Nothing runs outside the two contexts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .errors import RouteValidationError
from .replay import RouterCall, RouterReplay
from .routes import NO_ROUTE, has_route, no_route_value, route_dtype


class _Collector:
    """Per-layer rows gathered during one forward of ``batch x seq`` tokens."""

    def __init__(self, probes: RouterProbes, batch: int, seq: int):
        self.probes, self.batch, self.seq = probes, batch, seq
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _check_rows(self, layer: int, rows: int) -> None:
        if rows != self.batch * self.seq:
            raise RouteValidationError(
                f"the router of layer {layer} saw {rows} tokens, but this forward was declared as "
                f"{self.batch}x{self.seq}={self.batch * self.seq}; wrap exactly one forward of that shape"
            )
        if layer in self.layers:
            raise RouteValidationError(
                f"the router of layer {layer} ran twice inside one forward; wrap each forward in its own context"
            )

    def add(self, call: RouterCall) -> None:
        """Take one router call's rows (each collector keeps its own part of them)."""
        raise NotImplementedError

    def _assemble(self, fill_ids: bool, probs_dtype: torch.dtype, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        probes = self.probes
        missing = sorted(set(probes.moe_layers) - set(self.layers))
        if missing:
            raise RouteValidationError(f"no router call seen for MoE layer(s) {missing}: was a forward run inside?")
        shape = (self.batch, self.seq, probes.num_layers, probes.top_k)
        dtype = route_dtype(probes.num_experts, probes.top_k)
        ids = torch.full(shape, no_route_value(dtype), dtype=dtype, device=device) if fill_ids else None
        probs = torch.zeros(shape, dtype=probs_dtype, device=device)
        for layer, (layer_ids, layer_probs) in self.layers.items():
            if ids is not None:
                ids[:, :, layer] = layer_ids.view(self.batch, self.seq, -1).to(device)
            probs[:, :, layer] = layer_probs.view(self.batch, self.seq, -1).to(device)
        return ids, probs


class RouterCapture(_Collector):
    """What :meth:`RouterProbes.capture` yields; ``ids`` and ``probs`` are set when the context exits."""

    ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None

    def add(self, call: RouterCall) -> None:
        self._check_rows(call.layer, call.used.shape[0])
        ids = call.used.detach()
        probs = torch.softmax(call.logits.detach().float(), dim=-1).gather(1, ids.long())
        self.layers[call.layer] = (
            ids.to(route_dtype(self.probes.num_experts, self.probes.top_k)),
            probs.to(torch.float16),
        )

    def finish(self) -> None:
        self.ids, self.probs = self._assemble(fill_ids=True, probs_dtype=torch.float16, device="cpu")


class RouterReading(_Collector):
    """What :meth:`RouterProbes.at` yields; ``probs`` is set when the context exits."""

    probs: torch.Tensor | None = None

    def __init__(self, probes: RouterProbes, ids: torch.Tensor):
        super().__init__(probes, ids.shape[0], ids.shape[1])
        self.ids = ids
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self.device: torch.device | None = None

    def add(self, call: RouterCall) -> None:
        layer, logits = call.layer, call.logits
        self._check_rows(layer, logits.shape[0])
        ids = self._on_device.get(logits.device)
        if ids is None:
            ids = self._on_device[logits.device] = self.ids.to(logits.device, non_blocking=True)
        wanted = ids[:, :, layer].reshape(-1, ids.shape[-1])
        routed = has_route(wanted)[:, None]
        wanted = torch.where(routed, wanted.long(), 0)
        probs = torch.softmax(logits.detach().float(), dim=-1).gather(1, wanted)
        self.layers[layer] = (wanted, torch.where(routed, probs, 0.0))
        self.device = logits.device

    def finish(self) -> None:
        _, self.probs = self._assemble(fill_ids=False, probs_dtype=torch.float32, device=self.device or "cpu")


class RouterProbes:
    """Read router probabilities at the experts actually used (``capture``) or at given experts (``at``)."""

    def __init__(self, router_replay: RouterReplay):
        self.router_replay = router_replay
        self.num_layers = router_replay.num_layers
        self.top_k = router_replay.top_k
        self.num_experts = router_replay.num_experts
        self.moe_layers = list(router_replay.moe_layers)
        self._removed = False
        self._active: _Collector | None = None

    @contextlib.contextmanager
    def capture(self, batch: int, seq: int) -> Iterator[RouterCapture]:
        """Around one forward of ``batch x seq`` tokens: the ids actually used and the probabilities there."""
        collector = RouterCapture(self, batch, seq)
        with self._activate(collector):
            yield collector
        collector.finish()

    @contextlib.contextmanager
    def at(self, ids: torch.Tensor) -> Iterator[RouterReading]:
        """Around one forward: the router probabilities at ``ids`` (``[B, S, num_layers, top_k]``, ``-1``: none)."""
        if ids.dim() != 4 or ids.shape[2:] != (self.num_layers, self.top_k):
            raise RouteValidationError(
                f"expert ids must be [B, S, {self.num_layers}, {self.top_k}] (num_layers, top_k); "
                f"got {tuple(ids.shape)}"
            )
        if ids.numel():
            routed = ids[has_route(ids)]
            low = int(ids.min()) if ids.dtype != torch.uint8 else 0
            if low < NO_ROUTE or (routed.numel() and int(routed.max()) >= self.num_experts):
                raise RouteValidationError(
                    f"expert ids must be in [0, {self.num_experts}) or no route; got [{low}, {int(ids.max())}]"
                )
        collector = RouterReading(self, ids)
        with self._activate(collector):
            yield collector
        collector.finish()

    def remove(self) -> None:
        """Retire these probes: their contexts refuse to run afterwards."""
        self._removed = True

    @contextlib.contextmanager
    def _activate(self, collector: _Collector) -> Iterator[None]:
        if self._removed:
            raise RuntimeError("these RouterProbes were removed; create new ones")
        if self._active is not None:
            raise RuntimeError("RouterProbes contexts do not nest: one forward at a time")
        self._active = collector
        try:
            with self.router_replay.observe(collector.add):  # not called in backward recomputes
                yield
        finally:
            self._active = None
