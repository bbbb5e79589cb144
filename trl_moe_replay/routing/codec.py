"""Engine routed-expert rows: wire codec and alignment to TRL's token layout.

vLLM (``enable_return_routed_experts``) returns, per completion, an integer array of shape
``[p + c - 1 - s, L, K]``: row ``j`` holds the logical expert ids used when position ``s + j`` of
``prompt_ids + completion_ids`` was forwarded (``s`` = ``routed_experts_prompt_start``); the last
token has no row (it was never fed forward); dense layers are all-zero rows. dtype is uint8 when
the model has <= 256 experts, else uint16. Over HTTP it is base64 of a ``.npy`` file.

TRL feeds ``cat([left-padded prompt, right-padded completion])``, so position ``q`` of sample ``i``
sits at column ``prompt_width - p_i + q`` for prompt *and* completion tokens: the engine rows land
in one contiguous slice. Example, ``prompt_width=5``, ``completion_width=6``, ``p=3``, ``c=4``,
``s=1`` (so 3 + 4 - 1 - 1 = 5 engine rows r0..r4)::

    column        0    1    2    3    4 |    5    6    7    8    9   10
    input_ids   pad  pad   P0   P1   P2 |   C0   C1   C2   C3  pad  pad
    routes       -1   -1   -1   r0   r1 |   r2   r3   r4   -1   -1   -1
                            ^ skipped (s=1)                 ^ final token: never forwarded

``-1`` (shown for int16 routes; a row of 255s in one-byte routes) means "no route: let the router choose" (pads,
skipped prefix, final token, samples without rows, positions the engine never wrote, and every layer not in
``moe_layers``). The wire codec uses ``pybase64`` (vLLM's own codec,
several times faster) when it is installed, else the standard library.
"""

from __future__ import annotations

import binascii
import concurrent.futures
import functools
import io
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch

from .errors import RouteAlignmentError
from .repeated_ids import first_repeated_row
from .routes import NO_ROUTE, CheckedRoutes, RouteLayout, no_route_value, route_dtype


try:  # vLLM's own (SIMD) base64 codec; present wherever vLLM is installed
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - depends on the environment
    _pybase64 = None  # type: ignore[assignment]  # the fallback below reads None as "not installed"

__all__ = [
    "NO_ROUTE",
    "EngineTurn",
    "UnwrittenPositions",
    "checked_routes_from_engine",
    "decode_routed_experts",
    "encode_routed_experts",
    "engine_dtype",
    "routes_from_engine",
]

_INT16_LIMIT = 1 << 15  # int16 holds expert ids 0..32767
# Routes per block of the checks (the repeated-id comparisons hold K - 1 bytes per id of the block): a block is
# checked and copied while it is in the cache. 2**16 measured fastest on 2 cores (bench/route_transport.py, 32
# Qwen3-30B-A3B samples: 2**15 4.4x a copy, 2**16 3.4-3.6x, 2**17 3.6x): smaller blocks spend the time in Python
# calls that hold the GIL, so the pool's threads wait on each other; larger ones fall out of the L2 cache.
_CHECK_CHUNK_ROWS = 1 << 16
# Outputs at least this large are placed by a thread pool (below it, threads cost more than they save).
_THREADED_BYTES = 1 << 22


def _is_index(value: Any) -> bool:
    """An int (Python or NumPy), not a bool: ``1.7`` or ``True`` is no layer index."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _holds_ids(dtype: np.dtype) -> bool:
    """Signed or unsigned integers only: ``np.issubdtype(timedelta64, np.integer)`` is True, and bool is no id."""
    return dtype.kind in "iu"


@dataclass(frozen=True)
class UnwrittenPositions:
    """What ``routes_from_engine(on_unwritten=...)`` reports of one sample: ``count`` of its positions had a route
    the engine marks as never written (all zeros, or all ``-1``, at a MoE layer) and got "no route" (the router's own
    choice) while its other positions kept theirs; ``first`` is the first such position."""

    sample: int
    count: int
    first: int


@dataclass(frozen=True)
class EngineTurn:
    """One generation turn of one sample in a multi-turn rollout: the engine's rows and the tokens they cover.

    ``rows`` is what the engine returned for this turn (``[prompt_length + completion_length - 1 - prompt_start, L,
    K]``, or ``None``); ``prompt_length`` counts the tokens the turn was prompted with (the sample's prompt plus its
    completion so far, tool results included), ``completion_length`` the tokens it generated (before any later
    truncation), ``prompt_start`` the ``routed_experts_prompt_start`` it asked for. If the engine ignored that
    field and sent every row, the rows are taken from position 0.
    """

    rows: Any
    prompt_length: int
    completion_length: int
    prompt_start: int = 0


def engine_dtype(num_experts: int) -> np.dtype:
    """The dtype vLLM's capturer uses: uint8 if ``num_experts <= 256`` else uint16."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise RouteAlignmentError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts > 1 << 16:
        raise RouteAlignmentError(f"num_experts={num_experts} does not fit uint16 engine routes (max 65536)")
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def encode_routed_experts(array: np.ndarray | torch.Tensor, *, num_experts: int | None = None) -> str:
    """Encode ``[T, L, K]`` routes as vLLM's ``numpy2base64`` does: base64 of the ``.npy`` bytes.

    The dtype is kept as given, unless ``num_experts`` is passed: then ids are checked to lie in
    ``[0, num_experts)`` and cast to :func:`engine_dtype` (what a vLLM server would send).
    """
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    if not isinstance(array, np.ndarray):
        raise RouteAlignmentError(f"expected a numpy array or torch tensor of routes, got {type(array).__name__}")
    _check_array(array, "routes to encode")
    if num_experts is not None:
        dtype = engine_dtype(num_experts)
        if array.size and (array.min() < 0 or array.max() >= num_experts):
            raise RouteAlignmentError(
                f"routes to encode must hold ids in [0, {num_experts}), got range [{array.min()}, {array.max()}]"
            )
        array = array.astype(dtype, copy=False)
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        with buffer.getbuffer() as raw:
            encoded = _pybase64.b64encode(raw) if _pybase64 is not None else binascii.b2a_base64(raw, newline=False)
    return encoded.decode("ascii")


def decode_routed_experts(payload: str) -> np.ndarray:
    """Decode one ``choices[i]["routed_experts"]`` payload into its ``[T, L, K]`` integer array.

    Equivalent to ``np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)`` with strict
    base64, but without np.load's extra copy: the result is a read-only view over the decoded bytes.
    """
    if not isinstance(payload, str):
        raise RouteAlignmentError(
            f"routed_experts payload must be a base64 str (vLLM's numpy2base64), got {type(payload).__name__}"
        )
    try:
        if _pybase64 is not None:
            raw = _pybase64.b64decode(payload, validate=True)
        else:
            raw = binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError) as exc:  # non-ASCII str raises ValueError
        raise RouteAlignmentError(
            f"routed_experts payload is not valid base64 ({exc}); first chars: {payload[:32]!r}"
        ) from None
    try:
        array = _load_npy(raw)
    except RouteAlignmentError:
        raise
    except Exception as exc:  # numpy raises ValueError/EOFError/TypeError on malformed .npy data
        raise RouteAlignmentError(
            f"routed_experts payload is base64 but not a readable .npy array ({type(exc).__name__}: {exc})"
        ) from None
    _check_array(array, "decoded routed_experts")
    return array


def decoded_or_as_sent(payload: str) -> np.ndarray | str:
    """``payload`` decoded (:func:`decode_routed_experts`), or the payload itself where it does not decode: where
    routes arrive nothing is judged; the route intake reports and counts a malformed payload for its sample."""
    try:
        return decode_routed_experts(payload)
    except RouteAlignmentError:
        return payload


def _load_npy(raw: bytes) -> np.ndarray:
    fmt = np.lib.format
    stream = io.BytesIO(raw)
    version = fmt.read_magic(stream)
    if version == (1, 0):
        shape, fortran_order, dtype = fmt.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran_order, dtype = fmt.read_array_header_2_0(stream)
    else:  # rare header versions: let numpy handle them (one extra copy)
        return np.load(io.BytesIO(raw), allow_pickle=False)
    if not _holds_ids(dtype):
        raise RouteAlignmentError(f"routed_experts must hold integer expert ids, got dtype {dtype}")
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype=dtype)
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=stream.tell())
    return flat.reshape(shape[::-1]).T if fortran_order else flat.reshape(shape)


def _check_array(array: np.ndarray, what: str) -> None:
    if not _holds_ids(array.dtype):
        raise RouteAlignmentError(f"{what} must hold integer expert ids, got dtype {array.dtype}")
    if array.ndim != 3:
        raise RouteAlignmentError(f"{what} must be 3-D [tokens, layers, top_k], got shape {tuple(array.shape)}")


def _positive_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise RouteAlignmentError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _int_list(name: str, values: Any, count: int) -> list[int]:
    values = values.tolist() if isinstance(values, (torch.Tensor, np.ndarray)) else list(values)
    if len(values) != count:
        raise RouteAlignmentError(f"{name} has {len(values)} entries but rows has {count}: one per sample")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise RouteAlignmentError(f"sample {i}: {name}[{i}] must be an int >= 0, got {value!r}", sample=i)
        out.append(int(value))
    return out


def _as_numpy(row: Any, i: int) -> np.ndarray:
    if isinstance(row, np.ndarray):
        return row
    if isinstance(row, torch.Tensor):
        return row.detach().cpu().numpy()
    if isinstance(row, str):
        try:
            return decode_routed_experts(row)
        except RouteAlignmentError as exc:
            raise RouteAlignmentError(f"sample {i}: {exc}", sample=i) from None
    raise RouteAlignmentError(
        f"sample {i}: rows[{i}] must be a numpy array, torch tensor, base64 payload str or None, "
        f"got {type(row).__name__}",
        sample=i,
    )


def _sample_rows(
    row: Any,
    i: int,
    p: int,
    c: int,
    s: int,
    num_layers: int,
    top_k: int,
    moe: list[int],
    dense: list[int],
    limit: int,
    copy_to: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample i's engine rows as a checked ``[p + c - 1 - s, L, K]`` array, and the indices of the rows the engine
    never wrote (:func:`_check_values`); every error names the sample.

    With ``copy_to`` (at least as long as the rows), the rows are also copied there, block by block as they pass
    the checks, the never-written ones included (the caller overwrites them); after an error its content is
    undefined."""
    row = _as_numpy(row, i)
    expected = p + c - 1 - s
    if not _holds_ids(row.dtype):
        raise RouteAlignmentError(
            f"sample {i}: engine rows must hold integer expert ids, got dtype {row.dtype}", sample=i
        )
    if row.ndim != 3 or row.shape[1:] != (num_layers, top_k):
        raise RouteAlignmentError(
            f"sample {i}: engine rows must have shape [{max(expected, 0)}, {num_layers}, {top_k}] "
            f"(rows, num_layers, top_k), got {tuple(row.shape)}",
            sample=i,
        )
    if expected < 0 or row.shape[0] != expected:
        raise RouteAlignmentError(
            f"sample {i}: expected prompt {p} + completion {c} - 1 - prompt_start {s} = {expected} engine rows, "
            f"got {row.shape[0]}; pass the token counts vLLM returned (after stop trimming), "
            "or None to fall back to the router's own choice",
            sample=i,
        )
    return row, _check_values(row, i, s, moe, dense, top_k, limit, copy_to=copy_to)


def routes_from_engine(
    rows: Sequence[np.ndarray | torch.Tensor | str | None],
    *,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    prompt_width: int,
    completion_width: int,
    num_layers: int,
    top_k: int,
    moe_layers: Sequence[int] | None = None,
    prompt_starts: Sequence[int] | None = None,
    num_experts: int | None = None,
    out: torch.Tensor | None = None,
    on_error: Callable[[RouteAlignmentError], None] | None = None,
    on_unwritten: Callable[[UnwrittenPositions], None] | None = None,
) -> torch.Tensor:
    """Place per-sample engine rows into TRL's ``[B, prompt_width + completion_width, L, K]`` layout.

    ``rows[i]`` is sample i's ``[p_i + c_i - 1 - s_i, L, K]`` engine array (numpy, torch, or a base64
    payload str decoded here one sample at a time), or ``None`` for "no routes", or, for a multi-turn sample
    (tool calls), the list of its :class:`EngineTurn` s in generation order: each position then gets the route of
    the first turn that forwarded it (a generated token from the turn that sampled it, a tool-result token from
    the prefill of the turn that read it), and positions no turn routed get "no route". ``p_i``/``c_i`` are
    the token counts actually returned (after stop-string trimming, which trims rows alike), and
    ``s_i = prompt_starts[i]`` (default 0). ``c_i == 0`` is accepted: the formula still holds
    (``p_i - 1 - s_i`` rows, the last prompt token has none).

    Returns a CPU tensor in the compact routes dtype (``trl_moe_replay.routing.routes``): with
    ``num_experts`` given, ``uint8`` (one byte per entry, as vLLM sends them, "no route" a row of 255s)
    up to 256 experts, else ``int16`` ("no route" ``-1``); without ``num_experts``, ``int16``. Layers not
    in ``moe_layers`` (default: all layers are MoE) become "no route" and must be all-zero in the
    engine rows, as vLLM writes them. Every route of a MoE layer must name ``top_k`` distinct
    experts; a repeated id is rejected. Ids must be >= 0 and fit int16, and be ``< num_experts`` when that is given;
    the dtype must be a signed or unsigned integer. Any mismatch raises
    :class:`RouteAlignmentError` naming the sample; nothing is padded or cut silently.

    A position the engine marks as never written -- an all-zero route at a MoE layer (vLLM's capture buffer where it
    never wrote; ``top_k >= 2``: with ``top_k == 1`` expert 0 is a real route) or a route of ``-1`` s (signed
    rows) -- is no error: that position gets "no route" at every layer (the router's own choice) and the sample's
    other positions keep their routes; ``on_unwritten`` (optional) receives an :class:`UnwrittenPositions` per such
    sample. Only when every row of a sample (or turn) is so marked -- nothing left to replay; also what a dense layer
    missing from ``moe_layers`` looks like -- is it rejected like a malformed one. ``moe_layers`` must be
    distinct ints (a float such as ``1.7`` is refused, not truncated). :func:`checked_routes_from_engine` returns
    the result as :class:`~trl_moe_replay.routing.routes.CheckedRoutes`, which ``RouterReplay.replay`` takes without a
    second pass.

    ``out`` (optional) is a contiguous CPU tensor of the result's shape and dtype to write into, e.g. a
    reused or pinned buffer; every element is overwritten, so it needs no clearing.

    ``on_error`` (optional) turns a bad sample into a fallback instead of an exception: when one
    sample's rows cannot be decoded or do not fit its tokens (shape, length, dtype, ids, repeated ids, or every
    route never written), that sample gets "no route" everywhere (the router's own choice) and ``on_error`` receives the
    :class:`RouteAlignmentError` (``.sample`` is its index); so does a sample or turn whose prompt start lies outside
    its prompt (or, in an :class:`EngineTurn`, is no int). Errors in the caller's own arguments (widths, lengths,
    ``moe_layers``, the length or types of ``prompt_starts``) always raise.
    """
    prompt_width = _positive_int("prompt_width", prompt_width, 0)
    completion_width = _positive_int("completion_width", completion_width, 0)
    num_layers = _positive_int("num_layers", num_layers, 1)
    top_k = _positive_int("top_k", top_k, 1)
    if isinstance(rows, (str, bytes)):
        raise RouteAlignmentError(f"rows must be a sequence with one entry per sample, got {type(rows).__name__}")
    batch = len(rows)
    prompts = _int_list("prompt_lengths", prompt_lengths, batch)
    completions = _int_list("completion_lengths", completion_lengths, batch)
    starts = [0] * batch if prompt_starts is None else _int_list("prompt_starts", prompt_starts, batch)

    limit = _INT16_LIMIT
    if num_experts is not None:
        num_experts = _positive_int("num_experts", num_experts, 1)
        if num_experts > _INT16_LIMIT:
            raise RouteAlignmentError(f"num_experts={num_experts} does not fit int16 routes (max {_INT16_LIMIT})")
        limit = num_experts

    if moe_layers is None:
        moe = list(range(num_layers))
    else:
        given = moe_layers.tolist() if isinstance(moe_layers, (torch.Tensor, np.ndarray)) else list(moe_layers)
        moe = sorted({int(layer) for layer in given if _is_index(layer)})
        if len(moe) != len(given) or any(not 0 <= layer < num_layers for layer in moe):
            raise RouteAlignmentError(
                f"moe_layers must be distinct decoder-layer indices in [0, {num_layers}) (ints), got {given}; "
                "pass RouterReplay(model).moe_layers"
            )
    moe_set = set(moe)
    dense = [layer for layer in range(num_layers) if layer not in moe_set]

    shape = (batch, prompt_width + completion_width, num_layers, top_k)
    dtype = torch.int16 if num_experts is None else route_dtype(num_experts, top_k)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != shape
        or out.dtype != dtype
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        got = (tuple(out.shape), out.dtype, out.device.type) if isinstance(out, torch.Tensor) else type(out).__name__
        name = str(dtype).removeprefix("torch.")
        raise RouteAlignmentError(f"out must be a contiguous {name} CPU tensor of shape {shape}, got {got}")
    out_np = out.numpy()
    no_route = no_route_value(dtype)
    for i in range(batch):  # the caller's own numbers: always an exception, before any row is read
        p, c = prompts[i], completions[i]
        if p > prompt_width:
            raise RouteAlignmentError(
                f"sample {i}: prompt has {p} tokens but prompt_width is {prompt_width}", sample=i
            )
        if c > completion_width:
            raise RouteAlignmentError(
                f"sample {i}: completion has {c} tokens but completion_width is {completion_width}", sample=i
            )

    def place(i: int) -> RouteAlignmentError | UnwrittenPositions | None:
        """Decode, check and copy sample i's rows into its row of ``out`` ("no route" where it has none); returns
        the sample's error, or its never-written positions."""
        p, c, s, row = prompts[i], completions[i], starts[i], rows[i]
        lo = prompt_width - p + s
        if s > p:  # the engine's rows cannot start past the prompt: this sample falls back
            out_np[i] = no_route
            return RouteAlignmentError(f"sample {i}: prompt_start={s} is outside [0, prompt length {p}]", sample=i)
        if row is None:
            out_np[i] = no_route
            return None
        try:
            row, unwritten = _sample_rows(
                row, i, p, c, s, num_layers, top_k, moe, dense, limit, copy_to=out_np[i, lo:]
            )
        except RouteAlignmentError as exc:
            out_np[i] = no_route
            return exc
        out_np[i, :lo] = no_route
        out_np[i, lo + row.shape[0] :] = no_route
        if unwritten.size:
            out_np[i, lo + unwritten] = no_route
            return UnwrittenPositions(i, int(unwritten.size), s + int(unwritten[0]))
        return None

    # Samples are independent: a large batch is placed by a few threads (numpy releases the GIL in its loops), while
    # errors still reach the caller one sample at a time, in sample order, as without threads.
    single = [i for i in range(batch) if not _is_turn_list(rows[i])]
    pool = _pool() if len(single) > 1 and out_np.nbytes >= _THREADED_BYTES else None
    futures = [pool.submit(place, i) for i in single] if pool is not None else []
    results = (future.result() for future in futures) if pool is not None else (place(i) for i in single)
    try:
        for i in range(batch):
            report: RouteAlignmentError | UnwrittenPositions | None
            if _is_turn_list(turns := rows[i]):
                p, c = prompts[i], completions[i]
                out_np[i] = no_route
                report = _place_turns(
                    out_np[i, prompt_width - p :],
                    turns,
                    i,
                    p,
                    c,
                    num_layers,
                    top_k,
                    moe,
                    dense,
                    limit,
                    on_error,
                    no_route,
                )
            else:
                report = next(results)
            if isinstance(report, RouteAlignmentError):
                if on_error is None:
                    raise report
                on_error(report)
            elif report is not None and on_unwritten is not None:
                on_unwritten(report)
    finally:  # on an exception, no thread may still write into ``out`` once we return
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)
    if dense and batch:
        out.index_fill_(2, torch.tensor(dense), no_route)
    return out


def checked_routes_from_engine(
    rows: Sequence[Any],
    layout: RouteLayout,
    *,
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    prompt_width: int,
    completion_width: int,
    on_error: Callable[[RouteAlignmentError], None] | None = None,
    on_unwritten: Callable[[UnwrittenPositions], None] | None = None,
) -> CheckedRoutes:
    """:func:`routes_from_engine` for a model's ``layout``, as :class:`CheckedRoutes`: every row placed passed its
    checks (or is "no route"), and the fresh tensor it returns is held by no one else, so replaying it needs no
    second pass."""
    routes = routes_from_engine(
        rows,
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
        prompt_width=prompt_width,
        completion_width=completion_width,
        num_layers=layout.num_layers,
        top_k=layout.top_k,
        moe_layers=layout.moe_layers,
        num_experts=layout.num_experts,
        on_error=on_error,
        on_unwritten=on_unwritten,
    )
    return CheckedRoutes._own(routes, layout)


def _is_turn_list(entry: Any) -> TypeGuard[Sequence[EngineTurn]]:
    return isinstance(entry, (list, tuple)) and len(entry) > 0 and isinstance(entry[0], EngineTurn)


def _place_turns(
    target: np.ndarray,
    turns: Sequence[EngineTurn],
    i: int,
    p: int,
    c: int,
    num_layers: int,
    top_k: int,
    moe: list[int],
    dense: list[int],
    limit: int,
    on_error: Callable[[RouteAlignmentError], None] | None,
    no_route: int,
) -> UnwrittenPositions | None:
    """Write a multi-turn sample's routes into ``target`` (its row of the output, from its position 0, "no route"
    already); returns the never-written positions it left "no route", if any."""
    end = p + c - 1  # positions of the final sequence that were forwarded (the last token never was)
    covered = 0  # positions [0, covered) already hold the route of the first turn that forwarded them
    unwritten: list[np.ndarray] = []  # positions left "no route" because the engine never wrote their rows
    for t, turn in enumerate(turns):
        if not isinstance(turn, EngineTurn):
            raise RouteAlignmentError(
                f"sample {i}: turn {t} must be an EngineTurn, got {type(turn).__name__}", sample=i
            )
        pt = _positive_int(f"sample {i} turn {t} prompt_length", turn.prompt_length, 1)
        ct = _positive_int(f"sample {i} turn {t} completion_length", turn.completion_length, 0)
        if (t == 0 and pt != p) or not p <= pt <= p + c:
            raise RouteAlignmentError(
                f"sample {i}: turn {t} was prompted with {pt} tokens, but the sample's prompt has {p} and its whole "
                f"sequence {p + c}: the first turn's prompt must be the sample's, a later one's a prefix of its sequence",
                sample=i,
            )
        if turn.rows is None:
            continue
        try:
            # the engine's own field (a rollout_func returns it): a bad value loses this turn's rows, not the run
            st = _prompt_start(turn.prompt_start, i, t, pt)
            rows = _as_numpy(turn.rows, i)
            if st and rows.ndim == 3 and rows.shape[0] == pt + ct - 1:
                st = 0  # the engine ignored routed_experts_prompt_start and sent every row
            rows, marked = _sample_rows(rows, i, pt, ct, st, num_layers, top_k, moe, dense, limit)
        except RouteAlignmentError as exc:
            if on_error is None:
                raise RouteAlignmentError(f"{exc} (turn {t})", sample=i) from None
            on_error(RouteAlignmentError(f"{exc} (turn {t})", sample=i))
            continue
        lo, hi = max(st, covered), min(pt + ct - 1, end)
        if hi > lo:
            np.copyto(target[lo:hi], rows[lo - st : hi - st], casting="unsafe")
            marked = marked + st
            marked = marked[(marked >= lo) & (marked < hi)]
            if marked.size:
                target[marked] = no_route
                unwritten.append(marked)
        covered = max(covered, hi)
    if not unwritten:
        return None
    positions = np.concatenate(unwritten)
    return UnwrittenPositions(i, int(positions.size), int(positions.min()))


def _prompt_start(value: Any, i: int, t: int, prompt_length: int) -> int:
    """A turn's ``routed_experts_prompt_start``: an int (Python or numpy) in ``[0, prompt_length]``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= prompt_length:
        raise RouteAlignmentError(
            f"sample {i}: routed_experts_prompt_start must be an int in [0, prompt length {prompt_length}], "
            f"got {value!r}",
            sample=i,
        )
    return int(value)


@functools.cache
def _iinfo(dtype: np.dtype) -> np.iinfo:
    return np.iinfo(dtype)


def _check_values(
    row: np.ndarray,
    i: int,
    start: int,
    moe: list[int],
    dense: list[int],
    top_k: int,
    limit: int,
    copy_to: np.ndarray | None = None,
) -> np.ndarray:
    """Per-sample id checks, block by block of tokens (range checks only where the dtype could violate them); with
    ``copy_to``, each block is copied there once checked, while it is still in the cache.

    Returns the indices of the rows the engine marked as never written (:func:`_never_written`): those positions
    fall back to the router one by one, the others keep their routes. When every row is so marked, nothing is left
    to replay and the sample fails whole (most often a dense layer missing from ``moe_layers``)."""
    num_tokens = row.shape[0]
    step = max(1, _CHECK_CHUNK_ROWS // max(1, len(moe)))
    marks = []
    for lo in range(0, num_tokens, step):
        hi = min(lo + step, num_tokens)
        marked = _check_block(row, lo, hi, i, start, moe, dense, top_k, limit)
        if marked is not None:
            marks.append(marked)
        if copy_to is not None:
            np.copyto(copy_to[lo:hi], row[lo:hi], casting="unsafe")
    unwritten = np.concatenate(marks) if marks else np.empty(0, dtype=np.int64)
    if num_tokens and unwritten.size == num_tokens:
        _raise_never_written(row, i, start, moe, top_k)
    return unwritten


def _never_written(block: np.ndarray, moe: list[int], top_k: int) -> np.ndarray:
    """``[n, L, K] -> [n, len(moe)]``: the MoE-layer routes the engine marks as never written: all zeros (vLLM's
    capture buffer where it never wrote; ``top_k >= 2``, as a top-1 route of expert 0 is real) or all ``-1``."""
    ids = block[:, moe]
    marked = np.zeros(ids.shape[:2], dtype=bool)
    if top_k >= 2:
        marked |= ~ids.any(axis=-1)
    if _iinfo(block.dtype).min < 0:
        marked |= (ids == -1).all(axis=-1)
    return marked


def _raise_never_written(row: np.ndarray, i: int, start: int, moe: list[int], top_k: int) -> None:
    """The error of a sample whose every row is marked never written, naming its first such route."""
    marked = _never_written(row[:1], moe, top_k)[0]
    layer = moe[int(np.argmax(marked))]
    zeros = not row[0, layer].any()
    what = f"an all-zero top-{top_k} route (vLLM leaves rows it never wrote as zeros" if zeros else "a route of -1s ("
    dense_hint = (
        f"; every row of layer {layer} is zero: is it a dense layer? pass moe_layers"
        if zeros and not row[:, layer].any()
        else ""
    )
    raise RouteAlignmentError(
        f"sample {i}: layer {layer} is in moe_layers but position {start} has {what}{dense_hint}), and so has every "
        f"other of its {row.shape[0]} positions: no route is left to replay",
        sample=i,
    )


def _check_block(
    row: np.ndarray, lo: int, hi: int, i: int, start: int, moe: list[int], dense: list[int], top_k: int, limit: int
) -> np.ndarray | None:
    """The checks of ``row[lo:hi]``; positions in messages are ``start`` + the row index. Returns the indices (in
    ``row``) of the block's never-written positions, or None: a position with a never-written route at any MoE
    layer falls back whole (every layer), and its other rows are not judged."""
    block = row[lo:hi]
    info = _iinfo(block.dtype)
    repeated = _first_repeated_row(row, moe, lo, hi) if top_k >= 2 and moe else None
    unwritten = None
    if repeated is not None or (info.min < 0 and block.min() < 0):  # never-written marks are repeats or negative
        marked = _never_written(block, moe, top_k).any(axis=1)
        if marked.any():
            unwritten = lo + np.flatnonzero(marked)
            # the other positions are judged as usual: the marked ones, in a copy, become a valid route
            filler = np.zeros(block.shape[1:], dtype=block.dtype)
            filler[moe] = np.arange(top_k) % max(1, limit)
            block = block.copy()
            block[marked] = filler
            repeated = first_repeated_row(block, moe) if top_k >= 2 and moe else None
            repeated = None if repeated is None else (lo + repeated[0], repeated[1])
    if dense:
        dense_rows = block[:, dense]
        if dense_rows.any():
            j, d, _ = np.argwhere(dense_rows)[0]
            raise RouteAlignmentError(
                f"sample {i}: layer {dense[d]} is not in moe_layers but the engine routed position {start + lo + j} "
                f"there (vLLM leaves dense layers all-zero); check moe_layers",
                sample=i,
            )
    if repeated is not None:  # a top-k route names k distinct experts: a repeat that is no never-written mark
        j, layer = repeated
        ids = row[j, layer]
        values, counts = np.unique(ids, return_counts=True)
        raise RouteAlignmentError(
            f"sample {i}: position {start + j}, layer {layer} names expert {values[counts > 1][0]} twice "
            f"({ids.tolist()}); a top-{top_k} route names {top_k} distinct experts",
            sample=i,
        )
    if info.min < 0 and block.min() < 0:
        j, layer, _ = np.argwhere(block < 0)[0]
        raise RouteAlignmentError(
            f"sample {i}: negative expert id {block[j, layer].min()} at position {start + lo + j}, layer {layer}; "
            "expected logical ids >= 0 (a route of -1s marks a position never written)",
            sample=i,
        )
    if info.max >= limit and block.max() >= limit:
        j, layer, _ = np.argwhere(block >= limit)[0]
        raise RouteAlignmentError(
            f"sample {i}: expert id {block[j, layer].max()} at position {start + lo + j}, layer {layer} is out of "
            f"range; expected ids < {limit}" + (" (int16 routes)" if limit == _INT16_LIMIT else " (num_experts)"),
            sample=i,
        )
    return unwritten


def _first_repeated_row(
    rows: np.ndarray, layers: list[int], start: int = 0, stop: int | None = None
) -> tuple[int, int] | None:
    """:func:`~trl_moe_replay.routing.repeated_ids.first_repeated_row` in blocks of ``_CHECK_CHUNK_ROWS`` routes."""
    return first_repeated_row(rows, layers, start, stop, block_routes=_CHECK_CHUNK_ROWS)


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor | None:
    """The alignment's thread pool (one thread per usable CPU, at most 8), or None on a single CPU."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            cpus = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
            if cpus < 2:
                return None
            _POOL = concurrent.futures.ThreadPoolExecutor(cpus, thread_name_prefix="trl_moe_replay-routes")
        return _POOL


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
