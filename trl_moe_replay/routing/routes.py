"""The routes tensor: layout, compact dtype and validation.

``routes[b, s, l, k]`` is the k-th expert id used by token ``s`` of sample ``b`` in decoder layer ``l``:
``S`` is the position axis exactly as fed to the model (TRL: left-padded prompt, then right-padded completion),
``l`` the absolute decoder-layer index (``config.num_hidden_layers`` entries; dense layers hold "no route"), and a
row ``routes[b, s, l]`` of "no route" means "use the router's own choice" (pads, the final sampled token, dense
layers).

On the host routes stay one byte per entry wherever that can hold every id and "no route" (:func:`route_dtype`):
``uint8`` up to 255 experts, or 256 experts with ``top_k >= 2``, where "no route" is a row of 255s (a real route of
``k >= 2`` distinct ids never is); otherwise ``int16`` with ``-1``. Engine payloads are one byte per entry up to 256
experts too (vLLM's uint8), so a batch's routes stay that size from the wire to the replay, which expands them per
layer on the device. Signed routes of any integer dtype are accepted as input (``-1`` = no route).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .errors import RouteValidationError
from .repeated_ids import first_repeated_row


NO_ROUTE = -1
""""No route" in signed routes: every id of the row is -1."""
NO_ROUTE_UINT8 = 255
""""No route" in one-byte (uint8) routes: every id of the row is 255."""


def route_dtype(num_experts: int, top_k: int) -> torch.dtype:
    """The compact host dtype for a model's routes: ``uint8`` when one byte holds every id and "no route"
    (<= 255 experts, or 256 with ``top_k >= 2``), else ``int16`` (up to 32767 experts)."""
    if num_experts <= 255 or (num_experts == 256 and top_k >= 2):
        return torch.uint8
    return torch.int16


def no_route_value(dtype: torch.dtype) -> int:
    """The id that fills a "no route" row in routes of ``dtype``."""
    return NO_ROUTE_UINT8 if dtype == torch.uint8 else NO_ROUTE


def has_route(routes: torch.Tensor) -> torch.Tensor:
    """``[..., K] -> [...]``: which rows hold a route (validated rows are all ids or all "no route")."""
    if routes.dtype == torch.uint8:
        return (routes != NO_ROUTE_UINT8).any(dim=-1)
    return (routes >= 0).all(dim=-1)


def validate_routes(
    routes: torch.Tensor,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int,
    layers: Sequence[int] | None = None,
) -> None:
    """Raise ``RouteValidationError`` unless ``routes`` is a well-formed ``[B, S, num_layers, top_k]`` tensor.

    Checked at the MoE ``layers`` (all when ``None``): an integer dtype (``uint8`` or signed), every row either "no
    route" (all ``-1``; all 255 in ``uint8``) or ``top_k`` distinct ids in ``[0, num_experts)``. Always the full pass
    on the host. :func:`check_routes` runs it on a private snapshot and returns :class:`CheckedRoutes`, which
    ``RouterReplay.replay`` takes without a second pass.
    """
    if not isinstance(routes, torch.Tensor):
        raise RouteValidationError(f"routes must be a torch.Tensor, got {type(routes).__name__}")
    if routes.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise RouteValidationError(f"routes must have dtype uint8 or a signed integer dtype, got {routes.dtype}")
    if routes.dim() != 4 or routes.shape[2] != num_layers or routes.shape[3] != top_k:
        raise RouteValidationError(
            f"routes must be [batch, seq, num_layers={num_layers}, top_k={top_k}], got {tuple(routes.shape)}"
        )
    if routes.numel() == 0:
        return
    moe = routes if layers is None else routes[:, :, list(layers)]
    if not _every_row_valid(moe, top_k=top_k, num_experts=num_experts):
        _raise_first_problem(moe, top_k=top_k, num_experts=num_experts)


def _every_row_valid(moe: torch.Tensor, *, top_k: int, num_experts: int) -> bool:
    """True only when every row of ``moe`` (``[..., top_k]``) is "no route" or ``top_k`` distinct ids in
    ``[0, num_experts)``: the check of a valid batch, without a sort.

    Sound, not complete: False means "look closer" (:func:`_raise_first_problem` decides and names the row). "No
    route" rows are overwritten, in a copy, with the distinct ids ``0 .. top_k - 1``, so that every row left is
    judged by the same three flat passes: the minimum, the maximum and the repeated-id search the engine alignment
    uses (:func:`~trl_moe_replay.routing.repeated_ids.first_repeated_row`: shifted comparisons, no sort).
    """
    if num_experts < top_k:  # no row can hold top_k distinct ids: only the exact check can tell
        return False
    rows = moe.detach().cpu().contiguous().numpy().reshape(-1, top_k)  # [N, K], shares memory with ``moe``
    if rows.size == 0:
        return True
    none = _rows_all(rows, no_route_value(moe.dtype))
    if none.any():
        rows = rows.copy()
        rows[none] = np.arange(top_k, dtype=rows.dtype)
    if rows.dtype.kind == "i" and rows.min() < 0:
        return False
    if rows.max() >= num_experts:
        return False
    return top_k == 1 or first_repeated_row(rows.reshape(-1, 1, top_k), [0]) is None


def _rows_all(rows: np.ndarray, value: int) -> np.ndarray:
    """``[N, K] -> [N]``: rows whose every entry is ``value``; one word comparison per row where a row fits a
    machine word (one byte ids up to top-8, two byte ids up to top-4)."""
    width = rows.shape[1] * rows.itemsize
    if width in (1, 2, 4, 8) and rows.flags.c_contiguous:
        word = np.dtype(f"u{width}")
        return rows.view(word)[:, 0] == np.full(rows.shape[1], value, rows.dtype).view(word)[0]
    return (rows == value).all(axis=1)


def _raise_first_problem(moe: torch.Tensor, *, top_k: int, num_experts: int) -> None:
    """The exact check, row by row (a sort per route): raise ``RouteValidationError`` naming the first bad row."""
    routed = has_route(moe)  # [B, S, L]
    sentinel = no_route_value(moe.dtype)
    if moe.dtype != torch.uint8:
        partial = (moe < 0).any(dim=-1) & (moe >= 0).any(dim=-1)
        if bool(partial.any()):
            b, s, layer = (int(i) for i in partial.nonzero()[0])
            raise RouteValidationError(
                f"routes[{b}, {s}, layer {layer}] mixes expert ids and -1; a row is either all -1 or {top_k} expert ids"
            )
        if int(moe.min()) < NO_ROUTE:
            raise RouteValidationError(
                f"expert ids must lie in [0, {num_experts}) or be -1 (no route); got {int(moe.min())}"
            )
    ids = moe[routed]  # [N, K]: the rows that hold a route
    if ids.numel() == 0:
        return
    if int(ids.max()) >= num_experts:
        b, s, layer = (int(i) for i in (routed & (moe >= num_experts).any(dim=-1)).nonzero()[0])
        raise RouteValidationError(
            f"routes[{b}, {s}, layer {layer}] = {moe[b, s, layer].tolist()}: expert ids must lie in "
            f"[0, {num_experts}), a no-route row is all {sentinel}"
        )
    if top_k > 1:
        ordered = moe.sort(dim=-1).values
        repeated = routed & (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
        if bool(repeated.any()):
            b, s, layer = (int(i) for i in repeated.nonzero()[0])
            raise RouteValidationError(f"routes[{b}, {s}, layer {layer}] names the same expert twice")


# ---------------------------------------------------------------------- routes checked once, where they enter
# The full check above is a host pass over every route. It runs where routes enter (the engine intake, ``record()``,
# a user's ``replay(tensor)``), and what passed is kept as :class:`CheckedRoutes`: a value that owns its tensor and
# never hands it out, so what was checked is what is replayed. Every other way to make one builds it from checked
# parts (rows of checked routes, "no route" rows), so no forward needs a host pass.


@dataclass(frozen=True)
class RouteLayout:
    """What a model's routes look like: ``[B, S, num_layers, top_k]``, ids in ``[0, num_experts)`` at the decoder
    layers ``moe_layers`` (the others hold "no route"). ``RouterReplay(model).layout`` is the model's."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "moe_layers", tuple(int(layer) for layer in self.moe_layers))

    @property
    def dtype(self) -> torch.dtype:
        """The compact host dtype of this layout's routes (:func:`route_dtype`)."""
        return route_dtype(self.num_experts, self.top_k)

    def holds(self, other: RouteLayout) -> bool:
        """Whether routes checked for this layout are valid routes of ``other``: same shape, ids below ``other``'s
        expert count, and every MoE layer of ``other`` checked here."""
        return (
            (self.num_layers, self.top_k) == (other.num_layers, other.top_k)
            and self.num_experts <= other.num_experts
            and set(other.moe_layers) <= set(self.moe_layers)
        )

    def validate(self, routes: torch.Tensor) -> None:
        """:func:`validate_routes` for this layout."""
        validate_routes(
            routes, num_layers=self.num_layers, top_k=self.top_k, num_experts=self.num_experts, layers=self.moe_layers
        )


class CheckedRoutes:
    """Routes that passed :func:`validate_routes` for ``layout``, holding their ``[B, S, L, K]`` tensor privately.

    Made only by checking (:func:`check_routes`), or by this package from checked parts: the engine intake
    (``routes_from_engine``'s checks), ``RouterReplay.record()``, and :meth:`rows`, :meth:`cat`, :func:`pack_routes`
    of checked routes. The tensor is never handed out (:meth:`tensor` returns a copy), so nothing can change it after
    the check; ``RouterReplay.replay`` takes one with an O(1) layout comparison.
    """

    __slots__ = ("_routes", "layout", "_on_device")
    _routes: torch.Tensor
    layout: RouteLayout
    _on_device: dict[torch.device, torch.Tensor]  # the routes' copies on devices, made once each

    def __init__(self, *args, **kwargs):
        raise TypeError("CheckedRoutes are made by check_routes(routes, layout), not by their constructor")

    @classmethod
    def _own(cls, routes: torch.Tensor, layout: RouteLayout) -> CheckedRoutes:
        """Wrap ``routes`` that are valid for ``layout`` and that no one else holds (this package only)."""
        self = object.__new__(cls)
        self._routes, self.layout, self._on_device = routes, layout, {}
        return self

    @property
    def shape(self) -> torch.Size:
        return self._routes.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._routes.dtype

    def __len__(self) -> int:
        return self._routes.shape[0]

    def __repr__(self) -> str:
        return f"CheckedRoutes(shape={tuple(self.shape)}, dtype={self.dtype}, layout={self.layout})"

    def tensor(self) -> torch.Tensor:
        """A copy of the routes (changing it changes nothing that is replayed)."""
        return self._routes.clone()

    def has_route(self) -> torch.Tensor:
        """``[B, S, L]``: which rows hold a route (:func:`has_route`)."""
        return has_route(self._routes)

    def rows(self, index: slice | torch.Tensor) -> CheckedRoutes:
        """The routes of the samples ``index`` selects (a slice, or a ``[b]`` tensor of row indices)."""
        if isinstance(index, slice):
            return CheckedRoutes._own(self._routes[index], self.layout)  # a view: neither side is ever written
        return CheckedRoutes._own(
            self._routes.index_select(0, index.to(device=self._routes.device, dtype=torch.long)), self.layout
        )

    @staticmethod
    def cat(parts: Sequence[CheckedRoutes]) -> CheckedRoutes:
        """The parts' samples one after the other (same layout and length)."""
        layouts = {part.layout for part in parts}
        if len(layouts) != 1:
            raise RouteValidationError(f"cannot concatenate routes checked for different layouts: {layouts}")
        return CheckedRoutes._own(torch.cat([part._routes for part in parts]), layouts.pop())

    def _on(self, device: torch.device) -> torch.Tensor:
        """The routes on ``device``, copied there once (for ``RouterReplay``; never handed on)."""
        routes = self._on_device.get(device)
        if routes is None:
            routes = self._on_device[device] = self._routes.to(device, non_blocking=True)
        return routes


def check_routes(routes: torch.Tensor | CheckedRoutes, layout: RouteLayout) -> CheckedRoutes:
    """``routes`` checked in full for ``layout``: a private snapshot of them (contiguous, on the same device) passes
    :func:`validate_routes` and is what the result holds, so later writes to ``routes`` (in place, through NumPy,
    ``.data``, ``set_()`` or the storage) change nothing. :class:`CheckedRoutes` already checked for a layout that
    holds ``layout`` pass as they are."""
    if isinstance(routes, CheckedRoutes):
        if not routes.layout.holds(layout):
            raise RouteValidationError(
                f"routes were checked for {routes.layout}, which does not cover this model's {layout}: check them "
                "for this model's layout (check_routes(routes.tensor(), RouterReplay(model).layout))"
            )
        return routes
    if not isinstance(routes, torch.Tensor):
        raise RouteValidationError(f"routes must be a torch.Tensor, got {type(routes).__name__}")
    with torch.inference_mode(False):  # an inference tensor's snapshot is a normal one
        snapshot = routes.detach().clone(memory_format=torch.contiguous_format)
    layout.validate(snapshot)
    return CheckedRoutes._own(snapshot, layout)


def no_routes(batch: int, length: int, layout: RouteLayout) -> CheckedRoutes:
    """``[batch, length]`` positions of "no route" (the router's own choice everywhere)."""
    dtype = layout.dtype
    routes = torch.full((batch, length, layout.num_layers, layout.top_k), no_route_value(dtype), dtype=dtype)
    return CheckedRoutes._own(routes, layout)


def pack_routes(
    length: int, placements: Sequence[tuple[CheckedRoutes, torch.Tensor]], layout: RouteLayout
) -> CheckedRoutes:
    """``[1, length]`` routes, "no route" except where ``placements`` put a sample's routes: each
    ``(routes, positions)`` copies ``routes[0, :len(positions)]`` (one sample's) to those positions."""
    packed = no_routes(1, length, layout)
    for routes, positions in placements:
        if not routes.layout.holds(layout) or routes.dtype != packed.dtype:
            raise RouteValidationError(
                f"routes checked for {routes.layout} ({routes.dtype}) cannot be packed for {layout} ({packed.dtype})"
            )
        packed._routes[0, positions] = routes._routes[0, : len(positions)]
    return packed
