"""Packed training rows that carry routes, and a pure-torch attention for TRL's packed tree rows.

TRL's async trainer packs several samples into one row as a prefix trie (``packing.TreeRow``): a token shared by
samples is forwarded once. Its trie key is (token, next token), so two samples with the same prompt share that
prompt's positions, and would share one route there even when they were sampled by different weights (a different
policy version, or a request that spanned a weight sync). :class:`RoutedTreeRow` adds each position's route to the
key: samples share a position only where their tokens *and* their routes agree, and fork where the routes differ.
Shared prefixes stay shared whenever the engine routed them alike (the common case: same weights, same prefix);
nothing is replayed with a route another sample's engine used. ``pack()`` then lays every sample's checked routes onto
its packed positions (``routing.routes.pack_routes``: built by our code from checked parts, so checked too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..routing.routes import CheckedRoutes, RouteLayout, check_routes, pack_routes
from ..upstream import keyed_tree_row_class


KeyedTreeRow: Any = keyed_tree_row_class()  # TRL's TreeRow, its trie key a method (seam entry ``async_packing``)


def route_keys(routes: CheckedRoutes | None, length: int) -> list[Any]:
    """One hashable key per position of a sample's ``[1, length]`` routes: the position's expert set per layer
    (``None`` where nothing is replayed)."""
    if routes is None:
        return [None] * length
    values = routes.tensor()[0]
    array = np.sort(values.numpy(), axis=-1)  # a route is a set of experts: the order the engine listed them in is not
    flat = np.ascontiguousarray(array.reshape(length, -1))
    routed = routes.has_route()[0].any(dim=-1).tolist()
    return [row.tobytes() if keep else None for row, keep in zip(flat, routed, strict=True)]


class RoutedTreeRow(KeyedTreeRow):
    """``TreeRow`` whose trie is keyed on (token, next token, route): see the module docstring.

    A sample dict may carry ``replay_routes`` (its :class:`CheckedRoutes` ``[1, len(input_ids), L, K]`` from the
    intake, "no route" rows where the router chooses; a plain tensor is checked in full as it enters the row); without
    it the row behaves exactly like TRL's. Only the key is ours (``trie_keys``): ``fits``/``add`` are TRL's, copied
    into the seam because TRL has no hook for the key (seam entry ``async_packing``, whose probe checks the copy
    against TRL's own). ``layout`` is the replaying ``RouterReplay``'s.
    """

    def __init__(self, layout: RouteLayout):
        super().__init__()
        self.layout = layout
        self.packed_routes: CheckedRoutes | None = None  # set by pack()

    @classmethod
    def for_layout(cls, layout: RouteLayout) -> type[RoutedTreeRow]:
        """The row class TRL's batchers build in place of ``TreeRow`` (seam entry ``async_batcher_rows``): built with
        no argument, as they build rows; a class, not a factory function, so it stands wherever TRL's code uses the
        name as a type too."""

        class RoutedTreeRowForLayout(cls):  # type: ignore[valid-type,misc]  # cls: the calling class, at run time
            def __init__(self):
                super().__init__(layout)

        return RoutedTreeRowForLayout

    def trie_keys(self, sample: dict[str, Any]) -> list[tuple]:
        """(token, next token, route) per position: TRL's key and the position's route (``None``: no route)."""
        input_ids = sample["input_ids"].tolist()
        routes = sample.get("replay_routes")
        if routes is not None and not isinstance(routes, CheckedRoutes):  # not the intake's: checked in full, here
            routes = sample["replay_routes"] = check_routes(routes, self.layout)
        routes = route_keys(routes, len(input_ids))
        return list(zip(input_ids, [*input_ids[1:], None], routes, strict=True))

    def packed_positions(self) -> list[int]:
        """Node -> packed position, in the DFS pre-order of ``TreeRow.pack``."""
        packed, position = [0] * len(self.tokens), 0
        stack = list(reversed(self.roots.values()))
        while stack:
            node = stack.pop()
            while True:
                packed[node], position = position, position + 1
                if len(self.children[node]) != 1:
                    break
                node = next(iter(self.children[node].values()))
            stack.extend(reversed(self.children[node].values()))
        return packed

    def pack(self) -> dict[str, torch.Tensor]:
        """TRL's packing plus ``route_expected`` ``[N]`` (positions an engine forwarded: every sample's tokens but its
        last, which is never fed forward); the packed routes ``[1, N, L, K]`` (each packed position's route, "no
        route" elsewhere) are ``self.packed_routes``, kept out of the dict TRL's collator and dispatch handle."""
        out = super().pack()
        packed = self.packed_positions()
        if out["input_ids"][packed].tolist() != self.tokens:  # the DFS order above is pack()'s
            raise RuntimeError(
                "TRL's TreeRow.pack no longer lays nodes out in DFS pre-order (seam entry async_packing)"
            )
        expected = torch.zeros(len(self.tokens), dtype=torch.bool)
        placements = []
        for sample, nodes in zip(self.samples, self.sample_nodes, strict=True):
            positions = torch.tensor([packed[node] for node in nodes[:-1]], dtype=torch.long)
            expected[positions] = True
            if sample.get("replay_routes") is not None:
                placements.append((sample["replay_routes"], positions))  # a shared node has one route (in the key)
        self.packed_routes = pack_routes(len(self.tokens), placements, self.layout)
        out["route_expected"] = expected
        return out


class TorchVarlenAttention:
    """``flash_attn_varlen_func`` in plain torch (SDPA per segment), for TRL's packed tree attention without a GPU.

    TRL gathers each segment's root-to-segment path as the segment's keys, so a segment's queries are the *last*
    ``len(q)`` of its keys: causal attention is aligned bottom-right, as FlashAttention's varlen kernel aligns it.
    """

    @staticmethod
    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=None,
        max_seqlen_k=None,
        softmax_scale=None,
        causal=True,
        window_size=(-1, -1),
        softcap=None,
        **_,
    ):
        if softcap:
            raise NotImplementedError("the CPU tree attention has no logit soft-capping; this model needs a GPU")
        out = torch.empty_like(q)
        heads_q, heads_k = q.shape[1], k.shape[1]
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for segment in range(len(starts_q) - 1):
            q0, q1, k0, k1 = starts_q[segment], starts_q[segment + 1], starts_k[segment], starts_k[segment + 1]
            if q1 == q0:
                continue
            query, key, value = q[q0:q1], k[k0:k1], v[k0:k1]
            if heads_q != heads_k:  # grouped-query attention
                key = key.repeat_interleave(heads_q // heads_k, dim=1)
                value = value.repeat_interleave(heads_q // heads_k, dim=1)
            mask = None
            if causal:
                i = torch.arange(q1 - q0, device=q.device)[:, None]
                j = torch.arange(k1 - k0, device=q.device)[None, :]
                offset = (k1 - k0) - (q1 - q0)
                mask = j <= i + offset
                if window_size is not None and window_size[0] >= 0:
                    mask &= j >= i + offset - window_size[0]
            result = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=softmax_scale
            )
            out[q0:q1] = result.transpose(0, 1)
        return out
