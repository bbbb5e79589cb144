"""Engine-route transport: decode + alignment cost as a ratio to a plain copy of the same bytes.

Default sizes are a Qwen3-30B-A3B GRPO batch: 48 layers, top-8, 128 experts (uint8 rows), 256
completions of 4096 tokens after 192-256-token prompts (~420 MB of engine rows; ``--ragged`` draws
completion lengths in [7/8, 1] of 4096 instead). Each repeat times, side by side in this process:

  copy           np.frombuffer(rows_i) copied for every sample (the floor: touching the bytes once)
  decode         decode_routed_experts on every base64 payload
  decode/np.load np.load(io.BytesIO(base64.b64decode(x))) for reference
  align          routes_from_engine on decoded arrays, as the trainer calls it (num_experts given) -> the compact
                 routes [B, S, L, K]: uint8 up to 256 experts (one byte per entry, like the payload)
  align/int16    the same without num_experts -> int16 (the pre-uint8 layout, for reference)
  align/1 thread the same as align with the thread pool off (samples placed one after another): what the checks
                 cost on one core. The pool's gain depends on the machine: on a 2-vCPU VM it shrinks to nothing
                 when the pool's threads have been idle for ~50 ms (the second vCPU is slow to come back), which
                 the gc.collect() before every case makes the usual state here
  decode+align   routes_from_engine on the payload strings (decoded one sample at a time)

"warm" writes into destinations allocated once (copy buffer / ``out=``); "cold" allocates fresh
ones per call, adding first-touch page faults. Repeats
are interleaved in random order and medians reported. Target: align within 3x of the copy.

Also printed: bytes per routed token on the wire (base64 ``.npy``, as vLLM sends it) and what one
generation batch moves to the trainer ranks: with the per-rank scatter each of ``--ranks`` ranks
receives only its share; a broadcast (TRL's path for tokens and log-probs) would send the whole
batch to every rank.

    .venv/bin/python bench/route_transport.py            # full size (~2 GB RAM peak)
    .venv/bin/python bench/route_transport.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import io
import os
import platform
import statistics
import time

import numpy as np
import torch
from _harness import report

from trl_moe_replay.routing import codec, route_dtype
from trl_moe_replay.routing.codec import (
    decode_routed_experts,
    encode_routed_experts,
    engine_dtype,
    routes_from_engine,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256, help="completions per batch")
    parser.add_argument("--completion", type=int, default=4096, help="completion length (= completion_width)")
    parser.add_argument("--ragged", action="store_true", help="draw completion lengths in [7/8, 1] of --completion")
    parser.add_argument("--prompt", type=int, default=256, help="prompt_width (lengths drawn in [3/4, 1] of it)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=8, help="trainer ranks the batch is split over (bytes report)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.completion, args.prompt, args.repeats = 16, 512, 64, 3
    return args


def distinct_routes(rng: np.random.Generator, rows: int, top_k: int, experts: int, dtype: np.dtype) -> np.ndarray:
    """``[rows, top_k]`` ids, distinct within each row: one of 1024 random top-k sets per row, shifted by a random
    offset modulo ``experts`` (which keeps the ids distinct). Built in blocks to keep the int64 temporaries small."""
    sets = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(1024)])
    out = np.empty((rows, top_k), dtype)
    for lo in range(0, rows, 1 << 20):
        n = min(1 << 20, rows - lo)
        out[lo : lo + n] = (sets[rng.integers(0, len(sets), n)] + rng.integers(0, experts, n)[:, None]) % experts
    return out


def engine_batch(rng: np.random.Generator, counts: list[int], layers: int, top_k: int, experts: int):
    """``(flat, offsets, rows)``: one flat buffer of random logical ids, distinct within each route as a real top-k;
    each sample's ``[count, layers, top_k]`` engine rows are a view of it, starting at ``offsets[i]`` ids."""
    flat = distinct_routes(rng, sum(counts) * layers, top_k, experts, engine_dtype(experts)).reshape(-1)
    offsets = np.cumsum([0, *counts]) * layers * top_k
    rows = [flat[a:b].reshape(n, layers, top_k) for a, b, n in zip(offsets[:-1], offsets[1:], counts, strict=True)]
    return flat, offsets, rows


@contextlib.contextmanager
def pool_off():
    """``routes_from_engine`` with its thread pool off: samples placed one after another, on one core."""
    threaded_bytes = codec._THREADED_BYTES
    codec._THREADED_BYTES = float("inf")
    try:
        yield
    finally:
        codec._THREADED_BYTES = threaded_bytes


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    prompt_lengths = rng.integers(args.prompt * 3 // 4, args.prompt + 1, args.batch).tolist()
    if args.ragged:
        completion_lengths = rng.integers(args.completion * 7 // 8, args.completion + 1, args.batch).tolist()
    else:
        completion_lengths = [args.completion] * args.batch
    counts = [p + c - 1 for p, c in zip(prompt_lengths, completion_lengths, strict=True)]
    flat, offsets, rows = engine_batch(rng, counts, args.layers, args.top_k, args.experts)
    payloads = [encode_routed_experts(r) for r in rows]

    layout = dict(
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
        prompt_width=args.prompt,
        completion_width=args.completion,
        num_layers=args.layers,
        top_k=args.top_k,
        num_experts=args.experts,
    )
    # Sanity: the aligned tensor holds the engine rows where they belong.
    check = routes_from_engine(
        payloads[:2], **{**layout, "prompt_lengths": prompt_lengths[:2], "completion_lengths": completion_lengths[:2]}
    )
    lo = args.prompt - prompt_lengths[1]
    assert torch.equal(check[1, lo : lo + counts[1]].long(), torch.from_numpy(rows[1].astype(np.int64)))
    del check

    # Warm: destinations allocated and touched once, then reused (what the work itself costs).
    # Cold: fresh destinations every call (adds first-touch page faults, large and noisy in VMs).
    copy_dst = np.zeros(flat.nbytes, dtype=np.uint8)
    shape = (args.batch, args.prompt + args.completion, args.layers, args.top_k)
    out_dst = torch.zeros(shape, dtype=route_dtype(args.experts, args.top_k))
    out_int16 = torch.zeros(shape, dtype=torch.int16)
    without_experts = {key: value for key, value in layout.items() if key != "num_experts"}
    starts = offsets[:-1] * flat.itemsize

    def copy_warm():
        for r, o in zip(rows, starts, strict=True):
            copy_dst[o : o + r.nbytes] = np.frombuffer(r.data, dtype=np.uint8)

    def copy_cold():
        return [np.frombuffer(r.data, dtype=np.uint8).copy() for r in rows]

    def decode():  # each array dropped before the next, as decode+align streams them
        for x in payloads:
            decode_routed_experts(x)

    def align_one_thread():
        with pool_off():
            return routes_from_engine(rows, **layout, out=out_dst)

    def decode_npload():
        for x in payloads:
            np.load(io.BytesIO(base64.b64decode(x)), allow_pickle=False)

    cases = {
        "warm": {
            "copy": copy_warm,
            "decode": decode,
            "decode/np.load": decode_npload,
            "align": lambda: routes_from_engine(rows, **layout, out=out_dst),
            "align/int16": lambda: routes_from_engine(rows, **without_experts, out=out_int16),
            "align/1 thread": align_one_thread,
            "decode+align": lambda: routes_from_engine(payloads, **layout, out=out_dst),
        },
        "cold": {
            "copy": copy_cold,
            "align": lambda: routes_from_engine(rows, **layout),
            "decode+align": lambda: routes_from_engine(payloads, **layout),
        },
    }
    times = {(mode, name): [] for mode, group in cases.items() for name in group}
    order = [(mode, name, fn) for mode, group in cases.items() for name, fn in group.items()]
    for _ in range(args.repeats):
        # interleaved, in a fresh random order each repeat (a cold case right after a large free is penalised by
        # the kernel reclaiming those pages); each result is dropped before the next case runs
        for i in rng.permutation(len(order)):
            mode, name, fn = order[i]
            gc.collect()
            start = time.perf_counter()
            result = fn()
            times[mode, name].append(time.perf_counter() - start)
            del result

    tokens = sum(counts)
    raw_bytes = flat.nbytes
    wire_bytes = sum(len(x) for x in payloads)
    out_bytes = out_dst.numel() * out_dst.element_size()
    median = {key: statistics.median(value) for key, value in times.items()}

    print(
        f"routes: B={args.batch} prompt<={args.prompt} completion<={args.completion} L={args.layers} "
        f"K={args.top_k} E={args.experts} ({flat.dtype.name}); {tokens:,} routed tokens, "
        f"{raw_bytes / 2**20:,.0f} MiB engine rows, {wire_bytes / 2**20:,.0f} MiB base64, "
        f"{out_bytes / 2**20:,.0f} MiB {str(out_dst.dtype).removeprefix('torch.')} out "
        f"({out_dst.element_size()} B per entry)"
    )
    print(
        f"host: {platform.machine()}, {os.cpu_count()} cpus, numpy {np.__version__}, torch {torch.__version__}, "
        f"base64 codec {'pybase64' if codec._pybase64 is not None else 'binascii'}; "
        f"repeats={args.repeats}, medians"
    )
    print(f"wire: {wire_bytes / tokens:.1f} B per routed token in base64 ({raw_bytes / tokens:.0f} B raw)")
    print(
        f"per generation batch: {wire_bytes / 2**20:,.0f} MiB of payloads; scattered over {args.ranks} ranks each "
        f"receives ~{wire_bytes / args.ranks / 2**20:,.0f} MiB; a broadcast would move {args.ranks} x "
        f"{wire_bytes / 2**20:,.0f} = {args.ranks * wire_bytes / 2**20:,.0f} MiB"
    )
    print()
    print(f"{'mode':<6}{'case':<16}{'x copy':>8}{'median ms':>12}")
    for mode, name in times:
        ratio = median[mode, name] / median[mode, "copy"]
        print(f"{mode:<6}{name:<16}{ratio:>8.2f}{median[mode, name] * 1e3:>12.1f}")
    print()
    for mode in cases:
        ratio = median[mode, "align"] / median[mode, "copy"]
        verdict = "OK" if ratio <= 3 else "OVER TARGET"
        print(f"{mode} align / copy = {ratio:.2f} (target <= 3): {verdict}")
    report("route align / memcpy, warm", median["warm", "align"] / median["warm", "copy"], 3)
    report("route decode+align / memcpy, warm", median["warm", "decode+align"] / median["warm", "copy"], 3)
    for mode in cases:
        seconds = median[mode, "decode+align"]
        print(
            f"{mode} decode+align / copy = {seconds / median[mode, 'copy']:.2f}: "
            f"{raw_bytes / seconds / 2**30:.2f} GiB/s of engine rows, {tokens / seconds / 1e6:.2f} M tokens/s"
        )


if __name__ == "__main__":
    main()
