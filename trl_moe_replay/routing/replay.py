"""Record and replay expert routes in Hugging Face MoE models through module hooks.

``RouterReplay(model)`` registers one forward hook per MoE router (plus two light hooks on each MoE block
and one on the decoder stack). Nothing is patched and nothing runs while no context is active:

* ``with rr.record() as rec:`` stores the router's natural top-k ids of every forward inside, including
  the prefill and decode steps of ``model.generate``; ``rec.routes`` is ``[B, S, num_layers, top_k]``.
* ``with rr.replay(routes):`` makes every forward inside (and the recompute of gradient checkpointing in
  backward, as long as the backward runs inside the context) route by ``routes``; each forward's input must be
  ``[B, S]`` (``generate``'s KV-cached steps take the next columns). The router's logits
  are kept; the replay rule (``routing/replay_rule.py``) gives the expert ids (the replayed ids, or under threshold
  replay those the trainer's router scores well enough) and the gate weights, the family's own normalisation of the
  logits at those ids, so gradients still reach the router.
  Routes already checked (:class:`~trl_moe_replay.routing.routes.CheckedRoutes`: ``record()``'s, the engine
  intake's, ``check_routes``') cost an O(1) layout comparison; a plain tensor is checked in full, on a private
  snapshot, every time it enters.
* ``with rr.steer(choose):`` lets ``choose(layer, router, router_input, logits, natural_ids) -> ids`` pick each
  router's experts (PR2's predicted routes); gate weights are recomputed exactly as under replay, and
  ``record()`` records the steered ids. Replay, when also active, still wins where it has a route.
* ``with rr.observe(fn):`` calls ``fn(RouterCall)`` after every router call of a forward (not of a backward
  recompute) with the router's input, logits, natural ids and the ids actually used; it changes nothing.

Routes layout: ``S`` is the position axis exactly as fed to the model, the layer axis is the absolute
decoder-layer index (dense layers hold ``-1``), and ``-1`` means "no route: use the router's own choice".
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..upstream import transformers_seam
from ..upstream.torch_seam import assert_without_sync, in_backward
from .errors import RouteValidationError, UnsupportedModelError
from .replay_rule import CombineWeights, ReplayChoice, canonical_ids, check_score_threshold, replay_rule
from .routers import RouterFamily, family_of, refuse_if_transformers_too_old, supported_family_names
from .routes import CheckedRoutes, RouteLayout, check_routes, no_route_value, route_dtype


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# PEFT's ModulesToSaveWrapper keeps the router twice: the frozen original and the trainable copy.
_PEFT_COPIES = (".original_module", ".modules_to_save.")


class _SharedHook:
    """A hook that ``copy.deepcopy`` shares instead of copying.

    PEFT's ``modules_to_save`` deep-copies the router; a plain hook would be copied together with a private
    copy of this RouterReplay and the trainable copy would silently stop replaying. Sharing keeps it ours.
    """

    def __init__(self, owner: RouterReplay, fn):
        self.owner, self.fn = owner, fn

    def __call__(self, *args, **kwargs):
        if self.owner._removed:
            return None
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return self


@dataclass
class _RouterSite:
    layer: int  # absolute decoder-layer index
    name: str  # logical router path, e.g. "model.layers.3.mlp.gate"
    modules: list[nn.Module]  # the router (and PEFT's second copy, if any)
    family: RouterFamily


@dataclass
class _Segment:
    """Routes of one fresh forward, extended along the sequence axis by KV-cached continuations."""

    batch: int
    length: int
    uses_cache: bool
    ids: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [rows, K] chunks


class RouteRecording:
    """What ``RouterReplay.record()`` yields. ``checked`` (:class:`CheckedRoutes`) is filled when the context exits;
    ``routes`` is a tensor copy of it.

    Fresh forwards inside one recording are stacked along the batch axis (they must share a length, as the
    chunks of a chunked forward do); KV-cached continuations (``generate``'s decode steps) extend the sequence
    axis. When the forwards used a KV cache, one trailing ``-1`` column stands for the last sampled token,
    which was never fed forward, so ``routes`` lines up column for column with ``generate``'s output.
    """

    def __init__(self, replay: RouterReplay):
        self._replay = replay
        self._segments: list[_Segment] = []
        self.checked: CheckedRoutes | None = None
        self._routes: torch.Tensor | None = None

    @property
    def routes(self) -> torch.Tensor | None:
        """The recorded ``[B, S, num_layers, top_k]`` routes (a copy, made once: writing to it changes nothing
        that ``checked`` replays)."""
        if self._routes is None and self.checked is not None:
            self._routes = self.checked.tensor()
        return self._routes

    def _finish(self) -> None:
        if not self._segments:
            return
        rr = self._replay
        blocks = []
        for seg in self._segments:
            extra = 1 if seg.uses_cache else 0
            dtype = route_dtype(rr.num_experts, rr.top_k)
            # assembled where the routers ran (the first MoE layer's device), then copied to the host once below: a
            # copy per layer made the host wait for the device once per MoE layer (8 more syncs per generate call
            # at 8 layers in the GPU check)
            first = next(iter(seg.ids.values()), None)
            block = torch.full(
                (seg.batch, seg.length + extra, rr.num_layers, rr.top_k),
                no_route_value(dtype),
                dtype=dtype,
                device=first[0].device if first else None,
            )
            for layer in list(seg.ids):
                chunks = seg.ids.pop(layer)  # each layer's chunks go as soon as the block holds them
                ids = torch.cat([c.view(seg.batch, -1, rr.top_k) for c in chunks], dim=1)
                if ids.shape[1] != seg.length:
                    raise RouteValidationError(
                        f"recorded {ids.shape[1]} positions for layer {layer} but the forwards fed {seg.length}"
                    )
                if ids.device != block.device:  # a model split over devices: device to device, no host wait
                    ids = ids.to(block.device)
                block[:, : seg.length, layer] = ids
            blocks.append(block)
        widths = {b.shape[1] for b in blocks}
        if len(widths) != 1:
            raise RouteValidationError(
                f"one recording saw fresh forwards of different lengths {sorted(widths)}; record each in its own "
                "context (generation without a KV cache re-feeds the whole sequence and is not supported)"
            )
        # valid by construction: the ids the routers chose (or a steer function chose, checked on the device in
        # ``_steered_ids``) and "no route" elsewhere, so replaying them needs no host pass. Kept compact on the host
        # (``routing/routes.py``'s dtypes): this one copy is the recording's one host sync, needed because the host
        # reads them next (the trainer's intake, metrics, checkpoints)
        device = blocks[0].device
        routes = torch.cat([b if b.device == device else b.to(device) for b in blocks], dim=0)
        self.checked = CheckedRoutes._own(routes.cpu(), rr.layout)


@dataclass(frozen=True)
class RouterCall:
    """One router call as ``RouterReplay.observe`` reports it (all tensors flattened to ``N`` tokens)."""

    layer: int  # absolute decoder-layer index
    router: nn.Module
    router_input: torch.Tensor  # [N, hidden], exactly what the router was fed
    logits: torch.Tensor  # [N, E], the router's own logits (in the autograd graph during training)
    natural: torch.Tensor  # [N, K], the router's own choice
    used: torch.Tensor  # [N, K], the experts the block ran (replayed / steered / natural)


SteerFn = Callable[[int, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Window:
    """The positions of the routes that the current forward covers: ``routes[:, start : start + length]``."""

    batch: int
    start: int
    length: int


class _ActiveReplay:
    """Checked routes being replayed, moved to each device once.

    The decoder-stack pre-hook announces each forward (:meth:`begin_forward`): a fresh forward covers positions
    ``0 .. length - 1`` and must be fed exactly ``routes.shape[:2]`` (unless it opens a KV cache, as ``generate``'s
    prefill does); a KV-cached continuation covers the next positions. Routes whose batch or sequence axis cannot be
    the forward's are refused there, before any router runs, even when their row count would match.
    """

    def __init__(self, routes: CheckedRoutes, score_threshold: float, replace_sums: dict[int, torch.Tensor]):
        self.checked = routes
        self.window: _Window | None = None
        self.score_threshold = score_threshold
        self.replace_sums = replace_sums  # the RouterReplay's: layer -> [replaced slots, routed slots] (on the device)

    def begin_forward(self, batch: int, length: int, opens_cache: bool, continues: bool) -> None:
        previous = self.window
        if continues and previous is not None and previous.batch == batch:
            start = previous.start + previous.length
        else:
            start = 0
        shape = list(self.checked.shape)
        expected = [batch, start + length, *shape[2:]]
        if start > 0:
            if shape[0] != batch or shape[1] < start + length:
                raise RouteValidationError(
                    f"routes {shape} cover {shape[1]} positions of {shape[0]} sequences, but this KV-cached forward "
                    f"feeds positions {start}..{start + length - 1} of {batch} sequences: expected routes "
                    f"[{batch}, >= {start + length}, {shape[2]}, {shape[3]}] (record() lays out generate this way)"
                )
        elif shape[0] != batch or (shape[1] < length if opens_cache else shape[1] != length):
            raise RouteValidationError(
                f"routes {shape} do not fit this forward's input [batch={batch}, seq={length}]: expected routes "
                f"{expected} ([batch, seq, num_layers, top_k], positions as fed to the model). Replay one routes "
                "tensor per forward and slice it exactly as the inputs are sliced (chunked forwards, micro-batches)."
            )
        self.window = _Window(batch, start, length)

    def choose(self, layer: int, natural: torch.Tensor, logits: torch.Tensor, combine: CombineWeights) -> ReplayChoice:
        """The ids and combine weights this router call uses: :func:`~trl_moe_replay.routing.replay_rule.replay_rule`
        on this forward's rows of the routes, the router's own choice, its logits and its family's ``combine``."""
        routes = self.checked._on(natural.device)
        window = self.window
        if window is not None and not in_backward():
            routes = routes[:, window.start : window.start + window.length]
        # in a backward recompute (gradient checkpointing) the whole routes tensor, as the forward it recomputes used
        batch, seq, _, k = routes.shape
        rows = routes[:, :, layer].reshape(-1, k)
        if rows.shape[0] != natural.shape[0]:
            raise RouteValidationError(
                f"routes {tuple(routes.shape)} give {batch}x{seq}={rows.shape[0]} rows, but the router of layer "
                f"{layer} saw {natural.shape[0]} tokens in this forward. Replay one routes tensor per forward and "
                "slice it exactly as the inputs are sliced (chunked forwards, micro-batches)."
            )
        choice = replay_rule(rows, natural, logits, combine, self.score_threshold)
        if choice.replaced is not None and not in_backward():  # counted once per forward, on the device
            counts = torch.stack([choice.replaced.sum(), choice.routed.sum() * k]).detach()
            previous = self.replace_sums.get(layer)
            self.replace_sums[layer] = counts if previous is None else previous + counts.to(previous.device)
        return choice


class RouterReplay:
    """Record or replay the expert routes of every MoE router in ``model``.

    Attributes: ``num_layers`` (``config.num_hidden_layers``), ``top_k``, ``num_experts``, ``moe_layers``
    (absolute decoder-layer indices that have a router), ``layout`` (those four as one
    :class:`~trl_moe_replay.routing.routes.RouteLayout`), ``families`` (names of the router families found).

    Register it after any wrapping that replaces modules (PEFT, FSDP, ``torch.compile`` all work either way).
    ``score_threshold`` (0 to 1, default 0: plain replay) makes every ``replay()`` threshold replay
    (``routing/replay_rule.py``); :meth:`take_replace_sums` then counts the slots it replaced.
    """

    def __init__(self, model: nn.Module, score_threshold: float = 0.0):
        self.model = model
        self.score_threshold = check_score_threshold(score_threshold)
        sites = _discover_routers(model)
        config = _text_config(model)
        self.num_layers: int = int(config.num_hidden_layers)
        self.moe_layers: list[int] = [site.layer for site in sites]
        self.families: list[str] = sorted({site.family.name for site in sites})
        first: Any = sites[0].modules[0]  # a router: top_k and num_experts are ints, unknown to nn.Module's stubs
        self.top_k: int = int(first.top_k)
        self.num_experts: int = int(first.num_experts)
        self.layout = RouteLayout(self.num_layers, self.top_k, self.num_experts, tuple(self.moe_layers))
        for site in sites:
            router = site.modules[0]
            if (router.top_k, router.num_experts) != (self.top_k, self.num_experts):
                raise UnsupportedModelError(
                    f"router {site.name} has top_k={router.top_k}, num_experts={router.num_experts}; expected "
                    f"{self.top_k}, {self.num_experts} like the other layers (heterogeneous MoE is not supported)"
                )
            if site.layer >= self.num_layers:
                raise UnsupportedModelError(f"router {site.name} sits in layer {site.layer} >= num_hidden_layers")
        _refuse_hub_kernels(model, sites)
        self._sites = sites
        self._removed = False
        self._replay: _ActiveReplay | None = None
        self._replace_sums: dict[int, torch.Tensor] = {}
        self._steer: SteerFn | None = None
        self._observers: list[Callable[[RouterCall], None]] = []
        self._recordings: list[RouteRecording] = []
        self._router_fired: dict[int, bool] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        transformers_seam.check_stack_cache_keyword(model.get_submodule(_stack_path(sites[0].name)))
        self._register_hooks()

    def _register_hooks(self) -> None:
        """One forward hook per router (both PEFT copies), a pre-hook and a hook per MoE block, a pre-hook on the
        decoder stack; their handles are kept for :meth:`remove`."""
        model = self.model
        for site in self._sites:
            router_hook = _SharedHook(self, self._make_router_hook(site))
            for module in site.modules:
                self._handles.append(module.register_forward_hook(router_hook))
            block = model.get_submodule(_block_path(site.name))
            self._handles.append(block.register_forward_pre_hook(_SharedHook(self, self._make_block_pre_hook(site))))
            self._handles.append(block.register_forward_hook(_SharedHook(self, self._make_block_hook(site))))
        stack = model.get_submodule(_stack_path(self._sites[0].name))
        self._handles.append(
            stack.register_forward_pre_hook(_SharedHook(self, self._stack_pre_hook), with_kwargs=True)
        )

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def record(self) -> Iterator[RouteRecording]:
        """Record the natural top-k of every forward inside; ``rec.routes`` is set on exit."""
        self._check_attached()
        recording = RouteRecording(self)
        self._recordings.append(recording)
        try:
            yield recording
        finally:
            self._recordings.remove(recording)
        recording._finish()

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor | CheckedRoutes) -> Iterator[None]:
        """Route every forward inside by ``routes`` (``[B, S, num_layers, top_k]``, "no route" = own choice).

        Each forward must be fed exactly ``[B, S]`` (``input_ids`` or ``inputs_embeds``): routes of another layout
        raise ``RouteValidationError`` even when ``B x S`` matches. Under ``generate`` (a KV cache), the prefill
        takes the first columns and each decode step the next ones, the layout ``record()`` gives a generate.
        Keep the backward inside the context when gradient checkpointing is on: the recompute in backward
        runs the routers again and must see the same routes.

        What is replayed is always what was checked:

        * :class:`~trl_moe_replay.routing.routes.CheckedRoutes` (``record()``'s ``rec.checked``, the trainer's
          engine and old-pass routes, ``check_routes(tensor, rr.layout)``) own a tensor no caller can reach: entering
          costs an O(1) comparison of the layout they were checked for with this model's.
        * A plain tensor is copied, on every entry, into a private snapshot, and the snapshot is checked in full
          (``validate_routes``' host pass) and replayed. A write to the tensor after ``replay()`` was entered, by any
          means (in place, through ``.numpy()`` or a ``torch.from_numpy`` buffer, ``.data``, ``set_()``, its
          storage), never reaches a forward; the next ``replay()`` of it checks the new values in full. Check a
          tensor once with ``check_routes`` to replay it many times without that cost.
        """
        self._check_attached()
        checked = check_routes(routes, self.layout)
        previous, self._replay = self._replay, _ActiveReplay(checked, self.score_threshold, self._replace_sums)
        try:
            yield
        finally:
            self._replay = previous

    def take_replace_sums(self) -> dict[int, torch.Tensor]:
        """Threshold replay: per MoE layer, ``[replaced slots, routed slots]`` summed over the replayed forwards since
        the last call (not their backward recomputes), on the device; empty without a threshold. Resets them."""
        sums = dict(self._replace_sums)
        self._replace_sums.clear()  # in place: an active replay adds to this same dict
        return sums

    def routers(self) -> dict[int, nn.Module]:
        """The router module of each MoE layer, by absolute layer index (under PEFT, its first copy)."""
        return {site.layer: site.modules[0] for site in self._sites}

    @contextlib.contextmanager
    def steer(self, choose: SteerFn) -> Iterator[None]:
        """Let ``choose(layer, router, router_input, logits, natural_ids) -> ids [N, K]`` pick the experts.

        ``router_input`` is ``[N, hidden]`` (flattened like the router flattens it), ``logits`` ``[N, E]`` and
        ``natural_ids`` ``[N, K]`` are the router's own outputs. The gate weights become the family's own
        normalisation of the router's logits at the chosen ids, as under replay, so a choice equal to the
        router's reproduces its outputs bit for bit. ``record()`` inside records the chosen ids. Under an
        active ``replay`` the replayed routes win; rows without a route (``-1``) take the steered choice.
        """
        self._check_attached()
        if self._steer is not None:
            raise RuntimeError("steer() is already active on this RouterReplay; contexts do not nest")
        self._steer = choose
        try:
            yield
        finally:
            self._steer = None

    @contextlib.contextmanager
    def observe(self, fn: Callable[[RouterCall], None]) -> Iterator[None]:
        """Call ``fn(RouterCall)`` after every router call of every forward inside (not in backward recomputes)."""
        self._check_attached()
        self._observers.append(fn)
        try:
            yield
        finally:
            self._observers.remove(fn)

    def remove(self) -> None:
        """Detach every hook; the model behaves exactly as before. :meth:`attach` puts them back."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._removed = True  # also silences hooks that PEFT copied onto router copies

    @property
    def attached(self) -> bool:
        """Whether the hooks are on the model (False after :meth:`remove`, until :meth:`attach`)."""
        return not self._removed

    def attach(self) -> None:
        """Put the hooks back on the same routers after :meth:`remove` (a no-op while attached): the trainers remove
        theirs when a run ends and attach them again if ``train()`` is called once more."""
        if self._removed:
            self._register_hooks()
            self._removed = False

    def __repr__(self) -> str:
        return (
            f"RouterReplay(families={self.families}, num_layers={self.num_layers}, moe_layers={self.moe_layers}, "
            f"num_experts={self.num_experts}, top_k={self.top_k})"
        )

    # ------------------------------------------------------------------ hooks
    def _active(self) -> bool:
        return self._replay is not None or self._steer is not None or bool(self._recordings or self._observers)

    def _check_attached(self) -> None:
        if self._removed:
            raise RuntimeError("this RouterReplay was removed; attach() it again or create a new one")

    def _stack_pre_hook(self, module, args, kwargs):
        if (not self._recordings and self._replay is None) or in_backward():
            return None
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        batch, length = int(inputs.shape[0]), int(inputs.shape[1])
        cache = transformers_seam.stack_cache(kwargs)  # `cache=` from transformers 5.24, `past_key_values=` before
        cache_position = kwargs.get("cache_position")
        # A decode step continues the sequence. Some caches report length 0 while decoding (linear attention in
        # layer 0), so the cache position is asked too.
        continues = cache is not None and (
            (hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0)
            or (cache_position is not None and cache_position.numel() > 0 and int(cache_position[0]) > 0)
        )
        if self._replay is not None:
            self._replay.begin_forward(batch, length, opens_cache=cache is not None, continues=continues)
        for recording in self._recordings:
            segments = recording._segments
            if continues and segments and segments[-1].batch == batch:
                segments[-1].length += length
                segments[-1].uses_cache = True  # some models build their cache lazily inside the prefill
            else:
                segments.append(_Segment(batch=batch, length=length, uses_cache=cache is not None))
        return None

    def _make_block_pre_hook(self, site: _RouterSite):
        def hook(module, args):
            if self._active() and not torch.compiler.is_compiling():
                self._router_fired[site.layer] = False

        return hook

    def _make_block_hook(self, site: _RouterSite):
        def hook(module, args, output):
            if self._active() and not torch.compiler.is_compiling() and not self._router_fired.get(site.layer, True):
                raise UnsupportedModelError(
                    f"the MoE block of layer {site.layer} ran without calling its router {site.name}: a kernel or a "
                    "custom forward bypasses the router, so routes can be neither recorded nor replayed"
                )

        return hook

    def _make_router_hook(self, site: _RouterSite):
        layer, gate_weights = site.layer, site.family.gate_weights
        ids_first = transformers_seam.router_ids_first(site.modules[0])  # GraniteMoe and Aria before transformers 5.21

        def hook(module, args, output):
            if not self._active():
                return None
            if not torch.compiler.is_compiling():
                self._router_fired[layer] = True
            logits, _, natural = transformers_seam.split_router_output(output, ids_first, site.name)
            wants_input = self._steer is not None or bool(self._observers)
            router_input = args[0].reshape(-1, args[0].shape[-1]) if wants_input else None
            choice = natural
            if self._steer is not None:
                choice = self._steered_ids(layer, module, router_input, logits, natural)
            if self._recordings and not in_backward():
                ids = choice.detach().to(route_dtype(self.num_experts, self.top_k))
                for recording in self._recordings:
                    if not recording._segments:
                        raise RouteValidationError(
                            "a router ran during record() without a decoder-stack forward; call the model itself"
                        )
                    recording._segments[-1].ids.setdefault(layer, []).append(ids)
            weights: torch.Tensor | None = None
            if self._replay is not None:  # the replay rule decides the ids and their combine weights
                replayed = self._replay.choose(layer, choice, logits, functools.partial(gate_weights, module))
                used, weights = replayed.ids, replayed.weights
            else:
                used = choice
            if self._observers and not in_backward():
                assert router_input is not None  # observers want the router's input (wants_input)
                call = RouterCall(layer, module, router_input, logits, natural, used)
                for observer in list(self._observers):
                    observer(call)
            if used is natural:
                return None
            if weights is None:  # steered, not replayed: the family's normalisation at the steered ids, as the rule's
                weights = gate_weights(module, logits, used)
            return transformers_seam.join_router_output(output, ids_first, logits, weights, used)

        return hook

    def _steered_ids(self, layer, module, router_input, logits, natural) -> torch.Tensor:
        steer = self._steer
        assert steer is not None  # the hook calls this only while a steer() function is set
        ids = steer(layer, module, router_input, logits, natural)
        if not isinstance(ids, torch.Tensor) or ids.shape != natural.shape or ids.dtype.is_floating_point:
            raise RouteValidationError(
                f"steer() function returned {getattr(ids, 'dtype', type(ids).__name__)} "
                f"{tuple(getattr(ids, 'shape', ()))} for layer {layer}; expected integer ids of shape "
                f"{tuple(natural.shape)} like the router's own choice"
            )
        ids = ids.to(device=natural.device, dtype=natural.dtype)
        # checked without a host sync (this runs at every decode step of generate): raises on CPU at once, on CUDA
        # at the next synchronisation; record() relies on these checks for the steered routes it records
        assert_without_sync(
            ((ids >= 0) & (ids < self.num_experts)).all(),
            f"steer() function chose expert ids outside [0, {self.num_experts}) for layer {layer}",
        )
        ordered = ids.sort(dim=-1).values
        assert_without_sync(
            (ordered[:, 1:] != ordered[:, :-1]).all(),
            f"steer() function chose the same expert twice for a token of layer {layer}",
        )
        return canonical_ids(ids, natural, ordered)


# ---------------------------------------------------------------------- discovery
def _refuse_hub_kernels(model: nn.Module, sites: list[_RouterSite]) -> None:
    """Raise :class:`UnsupportedModelError` if a Hub kernel replaced a router or an MoE block of ``model`` (seam entry
    ``hub_kernels``: from transformers 5.25 ``from_pretrained`` kernelizes by default, and ``use_kernels`` is then
    True although on a CPU nothing is replaced). Where the installed ``kernels`` cannot say which layers it replaced,
    a model that runs with ``use_kernels=True`` is refused if its family has a Hub kernel for its router or block
    (``RouterFamily.hub_kernel``)."""
    swapped = transformers_seam.hub_kernel_layers(model)
    fix = (
        "Load the model with use_kernels=False (or set USE_HUB_KERNELS=NO before loading), or call "
        "model.set_use_kernels(False), before RouterReplay attaches."
    )
    if swapped is None:
        if not getattr(model, "use_kernels", False):
            return
        kernels = sorted({kernel for site in sites if (kernel := site.family.hub_kernel) is not None})
        if kernels:
            raise UnsupportedModelError(
                f"this model runs with use_kernels=True, and the hub kernel(s) {kernels} can replace its router or "
                "whole MoE block, so routes could not be recorded or replayed faithfully (the installed `kernels` "
                f"cannot say which layers it replaced). {fix}"
            )
        return
    replaced = {id(module): name for name, module in swapped.items()}
    hit = sorted(
        replaced[id(module)]
        for site in sites
        for module in (*site.modules, model.get_submodule(_block_path(site.name)))
        if id(module) in replaced
    )
    if hit:
        raise UnsupportedModelError(
            f"a hub kernel (use_kernels=True, kernels.kernelize) replaced the forward of {hit[:3]}"
            f"{' and more' if len(hit) > 3 else ''} (a router or MoE block), so routes could not be recorded or "
            f"replayed faithfully. {fix}"
        )


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no `config`; pass a transformers model")
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _logical_router_path(name: str) -> str:
    for marker in _PEFT_COPIES:
        if marker in name:
            return name[: name.index(marker)]
    return name


def _block_path(router_path: str) -> str:
    return router_path.rsplit(".", 1)[0]


def _stack_path(router_path: str) -> str:
    match = _LAYER_INDEX.search(router_path)
    assert match is not None  # _discover_routers keeps only routers inside a `layers.N` decoder layer
    return router_path[: match.start()]


def _discover_routers(model: nn.Module) -> list[_RouterSite]:
    sites: dict[str, _RouterSite] = {}
    for name, module in model.named_modules():
        family = family_of(module)
        if family is None:
            continue
        path = _logical_router_path(name)
        match = _LAYER_INDEX.search(path)
        if match is None:
            raise UnsupportedModelError(f"router {name} is not inside a `layers.N` decoder layer")
        if path in sites:
            sites[path].modules.append(module)  # PEFT's second copy of the same router
        else:
            sites[path] = _RouterSite(int(match.group(1)), path, [module], family)
    refuse_if_transformers_too_old(_text_config(model), {site.family for site in sites.values()})
    if not sites:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no MoE router of a supported family, so there are no routes to record or "
            'replay. A dense model (no experts): train it with routing_replay="none" (plain TRL GRPO). A MoE '
            f"model: supported families are {', '.join(supported_family_names())}."
        )
    ordered = sorted(sites.values(), key=lambda site: site.layer)
    layers = [site.layer for site in ordered]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"more than one router per decoder layer: {[s.name for s in ordered]}")
    stacks = {_stack_path(site.name) for site in ordered}
    if len(stacks) != 1:
        raise UnsupportedModelError(f"routers live in more than one decoder stack: {sorted(stacks)}")
    return ordered
