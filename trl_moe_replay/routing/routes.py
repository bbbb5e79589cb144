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

import numpy as np
import torch

from .errors import RouteValidationError

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
    route" (all ``-1``; all 255 in ``uint8``) or ``top_k`` distinct ids in ``[0, num_experts)``.
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
    if _every_row_valid(moe, top_k=top_k, num_experts=num_experts):
        return
    _raise_first_problem(moe, top_k=top_k, num_experts=num_experts)


def _every_row_valid(moe: torch.Tensor, *, top_k: int, num_experts: int) -> bool:
    """True only when every row of ``moe`` (``[..., top_k]``) is "no route" or ``top_k`` distinct ids in
    ``[0, num_experts)``: the check of a valid batch, without a sort.

    Sound, not complete: False means "look closer" (:func:`_raise_first_problem` decides and names the row). "No
    route" rows are overwritten, in a copy, with the distinct ids ``0 .. top_k - 1``, so that every row left is
    judged by the same three flat passes: the minimum, the maximum and the repeated-id search the engine alignment
    uses (``engine._first_repeated_row``: shifted comparisons, no sort).
    """
    from .engine import _first_repeated_row  # engine imports this module

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
    return top_k == 1 or _first_repeated_row(rows.reshape(-1, 1, top_k), [0]) is None


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
