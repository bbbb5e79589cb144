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

import threading
import weakref
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
    on the host; routes that pass are marked checked (:func:`mark_checked`), so that ``RouterReplay.replay`` need not
    check them again.
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
    mark_checked(routes, num_layers=num_layers, top_k=top_k, num_experts=num_experts, layers=layers)


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
            raise RouteValidationError(f"expert ids must lie in [0, {num_experts}) or be -1 (no route); got "
                                       f"{int(moe.min())}")
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
# The full check above is a host pass over every route. Routes are checked where they enter (``routes_from_engine``,
# ``RouterReplay.record()``, ``validate_routes`` itself, which ``RouterReplay.replay`` runs on anything else), and the
# fact travels with the tensor: a mark per storage, valid for the version of the tensor's content it was made at
# (torch's version counter, which every in-place torch operation on the tensor or any view of it increments). A
# forward then asks :func:`is_checked`, O(1): same storage, same version, and a view that selects whole rows of the
# tensor that was checked (a slice along the batch and position axes). Writes that bypass torch's counter (through a
# NumPy view from ``.numpy()`` or through ``.data``) are not seen: the docs say not to change routes that way.


@dataclass(frozen=True)
class _Mark:
    checked: weakref.ref  # the tensor that was checked: while it lives, its storage (and address) is its own
    version: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    num_experts: int
    layers: frozenset[int] | None  # MoE layers checked (None: all)


_MARKS: dict[int, list[_Mark]] = {}  # by storage address
_MARKS_LOCK = threading.RLock()  # re-entrant: a dying tensor's callback may run inside a locked section


def mark_checked(
    routes: torch.Tensor, *, num_layers: int, top_k: int, num_experts: int, layers: Sequence[int] | None = None
) -> None:
    """Record that ``routes`` (as it is now) passed the checks of :func:`validate_routes` with these arguments.

    Only for routes that did pass them, by the full pass or by construction. A non-contiguous or empty tensor is not
    marked (it will simply be checked again)."""
    if not isinstance(routes, torch.Tensor) or routes.numel() == 0 or not routes.is_contiguous():
        return
    if routes.is_inference():  # made under torch.inference_mode: no version counter to see a later change
        return
    if routes.dim() != 4 or routes.shape[2] != num_layers or routes.shape[3] != top_k:
        return
    address = routes.untyped_storage().data_ptr()
    mark = _Mark(weakref.ref(routes, lambda _: _forget_dead(address)), routes._version, routes.storage_offset(),
                 tuple(routes.shape), routes.stride(), routes.dtype, int(num_experts),
                 None if layers is None else frozenset(int(layer) for layer in layers))
    with _MARKS_LOCK:
        _MARKS.setdefault(address, []).append(mark)


def forget_checked(routes: torch.Tensor) -> None:
    """Drop every mark on the storage of ``routes`` (before it is rewritten behind torch's back, e.g. through NumPy)."""
    with _MARKS_LOCK:
        _MARKS.pop(routes.untyped_storage().data_ptr(), None)


def _forget_dead(address: int) -> None:
    with _MARKS_LOCK:
        marks = [mark for mark in _MARKS.get(address, ()) if mark.checked() is not None]
        if marks:
            _MARKS[address] = marks
        else:
            _MARKS.pop(address, None)


def is_checked(
    routes: torch.Tensor, *, num_layers: int, top_k: int, num_experts: int, layers: Sequence[int] | None = None
) -> bool:
    """O(1): True when ``routes`` is, unchanged since, a batch/position slice of routes that passed the checks of
    :func:`validate_routes` for these arguments (or stricter ones: fewer experts, more MoE layers)."""
    if not isinstance(routes, torch.Tensor) or routes.dim() != 4 or routes.numel() == 0 or routes.is_inference():
        return False
    marks = _MARKS.get(routes.untyped_storage().data_ptr())
    if not marks:
        return False
    shape, stride, version = tuple(routes.shape), routes.stride(), routes._version
    for mark in list(marks):
        checked = mark.checked()
        if (
            checked is None or version != mark.version or checked._version != mark.version
            or checked.untyped_storage().data_ptr() != routes.untyped_storage().data_ptr()
            or routes.dtype != mark.dtype or stride != mark.stride or shape[2:] != mark.shape[2:]
            or shape[2:] != (num_layers, top_k) or mark.num_experts > num_experts
        ):
            continue
        if mark.layers is not None and not mark.layers.issuperset(range(num_layers) if layers is None else layers):
            continue
        # the view starts at (b, s) of the checked tensor, whole rows, and stays inside it
        b, rest = divmod(routes.storage_offset() - mark.offset, mark.stride[0])
        s, partial = divmod(rest, mark.stride[1])
        if b >= 0 and partial == 0 and b + shape[0] <= mark.shape[0] and s + shape[1] <= mark.shape[1]:
            return True
    return False


def carry_check(derived: torch.Tensor, source: torch.Tensor) -> bool:
    """Mark ``derived`` checked like ``source``, when it holds rows of ``source`` only, e.g. ``source[permutation]``.

    The caller vouches for how ``derived`` was made (TRL's shuffle of a generation batch); here only its shape and
    dtype are compared, and ``source`` must still be checked. Returns whether ``derived`` was marked."""
    if not isinstance(derived, torch.Tensor) or derived.dtype != source.dtype or derived.shape[1:] != source.shape[1:]:
        return False
    with _MARKS_LOCK:
        marks = list(_MARKS.get(source.untyped_storage().data_ptr(), ()))
    num_layers, top_k = source.shape[2], source.shape[3]
    for mark in marks:
        if is_checked(source, num_layers=num_layers, top_k=top_k, num_experts=mark.num_experts,
                      layers=None if mark.layers is None else sorted(mark.layers)):
            mark_checked(derived, num_layers=num_layers, top_k=top_k, num_experts=mark.num_experts,
                         layers=None if mark.layers is None else sorted(mark.layers))
            return True
    return False


def cat_checked(parts: Sequence[torch.Tensor], *, num_layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """``torch.cat(parts)`` along the batch axis, marked checked when every part was checked for this layout (the
    concatenation holds their rows only)."""
    routes = torch.cat(list(parts), dim=0)
    layout = dict(num_layers=num_layers, top_k=top_k, num_experts=num_experts)
    if parts and all(is_checked(part, **layout) for part in parts):
        mark_checked(routes, **layout)
    return routes
