"""The routes tensor: layout and validation.

``routes[b, s, l, k]`` is the k-th expert id used by token ``s`` of sample ``b`` in decoder layer ``l``:
``S`` is the position axis exactly as fed to the model (TRL: left-padded prompt, then right-padded completion),
``l`` the absolute decoder-layer index (``config.num_hidden_layers`` entries; dense layers hold ``-1``), and
``-1`` means "no route here: use the router's own choice" (pads, the final sampled token, dense layers).
Keep it compact on the host (``int16``); it is expanded per layer on the device during replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import RouteValidationError

NO_ROUTE = -1


def validate_routes(
    routes: torch.Tensor,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int,
    layers: Sequence[int] | None = None,
) -> None:
    """Raise ``RouteValidationError`` unless ``routes`` is a well-formed ``[B, S, num_layers, top_k]`` tensor.

    Checked at the MoE ``layers`` (all when ``None``): integer dtype, ids in ``[0, num_experts)`` or ``-1``,
    a row is either all ``-1`` or a set of ``top_k`` distinct ids.
    """
    if not isinstance(routes, torch.Tensor):
        raise RouteValidationError(f"routes must be a torch.Tensor, got {type(routes).__name__}")
    if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
        raise RouteValidationError(f"routes must have an integer dtype, got {routes.dtype}")
    if routes.dim() != 4 or routes.shape[2] != num_layers or routes.shape[3] != top_k:
        raise RouteValidationError(
            f"routes must be [batch, seq, num_layers={num_layers}, top_k={top_k}], got {tuple(routes.shape)}"
        )
    if routes.numel() == 0:
        return
    moe = routes if layers is None else routes[:, :, list(layers)]
    low, high = int(moe.min()), int(moe.max())
    if low < NO_ROUTE or high >= num_experts:
        raise RouteValidationError(
            f"expert ids must lie in [0, {num_experts}) or be {NO_ROUTE} (no route); got values in [{low}, {high}]"
        )
    missing = moe < 0
    partial = missing.any(dim=-1) & ~missing.all(dim=-1)
    if bool(partial.any()):
        b, s, layer = (int(i) for i in partial.nonzero()[0])
        raise RouteValidationError(
            f"routes[{b}, {s}, layer {layer}] mixes expert ids and -1; a row is either all -1 or {top_k} expert ids"
        )
    if top_k > 1:
        ordered = moe.sort(dim=-1).values
        repeated = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(dim=-1)
        if bool(repeated.any()):
            b, s, layer = (int(i) for i in repeated.nonzero()[0])
            raise RouteValidationError(f"routes[{b}, {s}, layer {layer}] names the same expert twice")
