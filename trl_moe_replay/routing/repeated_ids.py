"""The search for a route that names an expert twice, shared by the engine alignment (``routing.codec``) and the
routes check (``routing.routes``); it imports neither, so that neither imports the other."""

from __future__ import annotations

import functools
import math
import threading

import numpy as np


BLOCK_ROUTES = 1 << 16
"""Routes per block of the search by default (``routing.codec._CHECK_CHUNK_ROWS`` explains the size)."""


def first_repeated_row(
    rows: np.ndarray, layers: list[int], start: int = 0, stop: int | None = None, *, block_routes: int = BLOCK_ROUTES
) -> tuple[int, int] | None:
    """``(row, layer)`` of the first route ``rows[row, layer]`` (``row`` in ``[start, stop)``, ``layer`` in
    ``layers``) naming an expert twice.

    None if there is none. An all-zero route (vLLM's never-written rows) names expert 0 ``K`` times, so it is found
    too. Vectorised without a sort: over a block of routes laid flat, every id is compared with the ids 1 .. K-1
    places later (K - 1 contiguous, SIMD comparisons), then an OR over the block keeps only the comparisons that stay
    inside a route. The block's first offending route is located (by a sort) only when there is one.
    """
    num_tokens, num_layers, k = rows.shape
    stop = num_tokens if stop is None else stop
    width = len(layers)
    period = math.lcm(k, 8)  # comparison bytes per OR-reduction word group: whole routes and whole uint64 words
    masks = _same_route_masks(k)
    in_place = width == num_layers and rows.flags.c_contiguous
    if in_place:
        flat_rows = rows.reshape(-1)
    else:  # copy each block's MoE routes into a contiguous buffer (dense layers, non-contiguous arrays)
        select = layers if width != num_layers else slice(None)
        if width != num_layers and layers == list(range(layers[0], layers[-1] + 1)):
            select = slice(layers[0], layers[-1] + 1)
    tokens_per_block = max(1, block_routes // width)
    block_size = min(tokens_per_block, stop - start) * width * k
    buffer = None if in_place else _scratch("ids", block_size + k - 1, rows.dtype)
    equal = _scratch("equal", (k - 1) * (-(-block_size // period) * period), np.bool_).reshape(k - 1, -1)
    for lo in range(start, stop, tokens_per_block):
        hi = min(lo + tokens_per_block, stop)
        n = (hi - lo) * width * k
        if in_place:
            flat = flat_rows[lo * width * k :]
            # the comparisons read up to k - 1 ids past the block: past the array's end for its last route, which is
            # then checked on its own
            compared = n if flat.size >= n + k - 1 else n - k
        else:
            assert buffer is not None  # allocated above when not in place
            flat = buffer
            np.copyto(buffer[:n].reshape(hi - lo, width, k), rows[lo:hi, select])
            compared = n
        same = equal[:, : -(-n // period) * period]
        for shift in range(1, k):  # one contiguous (SIMD) comparison per distance between slots
            np.equal(flat[:compared], flat[shift : compared + shift], out=same[shift - 1, :compared])
        same[:, compared:] = False
        words = np.bitwise_or.reduce(same.view(np.uint64).reshape(k - 1, -1, period // 8), axis=1)
        last_route = flat[n - k : n]
        if (words & masks).any() or (compared < n and np.unique(last_route).size < k):
            ordered = np.sort(flat[:n].reshape(-1, k), axis=1)
            first = int(np.argmax((ordered[:, 1:] == ordered[:, :-1]).any(axis=1)))
            return lo + first // width, layers[first % width]
    return None


_SCRATCH = threading.local()  # per thread: reusable work buffers of the checks, by name


def _scratch(name: str, size: int, dtype) -> np.ndarray:
    """A work buffer of ``size`` elements of ``dtype`` for this thread, reused across calls (uninitialised)."""
    dtype = np.dtype(dtype)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < size * dtype.itemsize:
        buffer = buffers[name] = np.empty(size * dtype.itemsize, np.uint8)
    return buffer[: size * dtype.itemsize].view(dtype)


@functools.cache
def _same_route_masks(k: int) -> np.ndarray:
    """``[k - 1, lcm(k, 8) / 8]`` uint64: byte ``b`` of row ``s - 1`` is 1 where comparing flat id ``b`` with the id
    ``s`` places later stays inside one route (``b % k + s < k``)."""
    period = math.lcm(k, 8)
    slot = np.arange(period) % k
    inside = np.stack([(slot + s < k) for s in range(1, k)]).astype(np.uint8)
    return inside.view(np.uint64)
