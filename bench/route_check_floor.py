"""Where the route alignment's time goes, and why it stays above 3x a copy (docs/benchmarks.md, issue 24).

Not a target of its own: the numbers behind "Where the alignment's floor is". On Qwen3-30B-A3B-sized engine rows
(48 layers, top-8, 128 experts, uint8), side by side in this process, alternating order, medians:

  idle      ``routes_from_engine`` on a batch, with the thread pool and with one thread, each after the pool's threads
            sat idle for ``--idle`` seconds (as after ``gc.collect()`` or a wait for the engine), and back to back
  blocks    the repeated-id search (``codec._first_repeated_row``) over the batch by the pool's threads, called back
            to back, for several block sizes (``codec._CHECK_CHUNK_ROWS``)
  parts     one block of the search taken apart: the K - 1 shifted comparisons, the OR-reduction, the range check,
            against a copy of the block
  variants  other exact formulations of the search on one sample, against the present one: XOR with a min-reduction,
            and slot-major (a transposed copy, then each pair of slots compared once); ``--compile`` adds
            ``torch.compile`` of the pairwise comparisons (needs a C++ compiler; compiles for seconds)

    python bench/route_check_floor.py            # ~1 minute
    python bench/route_check_floor.py --compile
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import time

import numpy as np
import torch
from route_transport import engine_batch, pool_off

from trl_moe_replay.routing import codec
from trl_moe_replay.routing.codec import routes_from_engine


LAYERS, TOP_K, EXPERTS = 48, 8, 128


def medians(cases: dict, repeats: int, before=lambda: None) -> dict:
    """Median seconds of each case, in alternating order (ABBA...), ``before()`` untimed ahead of every call."""
    times = {name: [] for name in cases}
    for r in range(repeats):
        for name in list(cases) if r % 2 else list(cases)[::-1]:
            before()
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def show(title: str, result: dict, copy: float) -> None:
    print(f"\n{title}")
    for name, seconds in result.items():
        print(f"  {name:<40}{seconds * 1e3:>9.3f} ms{seconds / copy:>8.2f}x copy")


def xor_min_search(flat: np.ndarray, block: int, k: int) -> bool:
    """Variant: XOR of the ids k = 1..K-1 places apart, the comparisons that cross a route set to 0xFF, one minimum."""
    slot = np.arange(8) % k
    masks = np.stack([np.where(slot + s < k, 0, 255) for s in range(1, k)]).astype(np.uint8).view(np.uint64)
    x = np.empty((k - 1, block), np.uint8)
    for lo in range(0, flat.size, block):
        n = min(block, flat.size - lo)
        part = flat[lo:]
        compared = n if part.size >= n + k - 1 else n - 8  # the last route of the array: checked by the others
        for s in range(1, k):
            np.bitwise_xor(part[:compared], part[s : compared + s], out=x[s - 1, :compared])
        words = x[:, :compared].view(np.uint64)
        np.bitwise_or(words, masks, out=words)
        if x[:, :compared].min() == 0:
            return True
    return False


def slot_major_search(routes: np.ndarray, block: int, k: int) -> bool:
    """Variant: a block copied slot-major (ids[j] = j-th id of every route), each pair of slots compared once."""
    ids = np.empty((2 * k - 1, block), routes.dtype)
    distances = [(d, k if 2 * d < k else k - d) for d in range(1, k // 2 + 1)]
    x = np.empty((sum(n for _, n in distances), block), routes.dtype)
    for lo in range(0, routes.shape[0], block):
        m = min(block, routes.shape[0] - lo)
        b = ids[:, :m]
        np.copyto(b[:k], routes[lo : lo + m].T)
        np.copyto(b[k:], b[: k - 1])
        row = 0
        for d, n in distances:
            np.bitwise_xor(b[:n], b[d : d + n], out=x[row : row + n, :m])
            row += n
        if x[:, :m].min() == 0:
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--completion", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--idle", type=float, default=0.05, help="seconds the pool's threads sit idle before a call")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the pairwise comparisons")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    prompts = rng.integers(192, 257, args.batch).tolist()
    counts = [p + args.completion - 1 for p in prompts]
    flat, offsets, rows = engine_batch(rng, counts, LAYERS, TOP_K, EXPERTS)
    layout = dict(
        prompt_lengths=prompts,
        completion_lengths=[args.completion] * args.batch,
        prompt_width=256,
        completion_width=args.completion,
        num_layers=LAYERS,
        top_k=TOP_K,
        num_experts=EXPERTS,
    )
    out = torch.empty((args.batch, 256 + args.completion, LAYERS, TOP_K), dtype=torch.uint8)
    copy_dst = np.empty_like(flat)
    moe = list(range(LAYERS))
    print(
        f"load average at start: {'/'.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cpus); "
        f"{args.batch} samples x ~{counts[0]} tokens x {LAYERS} x top-{TOP_K} uint8 = {flat.nbytes / 2**20:.0f} MiB; "
        f"block {codec._CHECK_CHUNK_ROWS} routes"
    )

    def copy_batch():
        for r, o in zip(rows, offsets[:-1], strict=True):
            copy_dst[o : o + r.size] = r.reshape(-1)

    def align():
        routes_from_engine(rows, **layout, out=out)

    def align_one_thread():
        with pool_off():
            align()

    cases = {"copy": copy_batch, "align, thread pool": align, "align, one thread": align_one_thread}
    idle = medians(cases, args.repeats, before=lambda: time.sleep(args.idle))
    show(f"idle: each call after {args.idle * 1e3:.0f} ms idle", idle, idle["copy"])
    busy = medians(cases, args.repeats)
    show("idle: back to back", busy, busy["copy"])

    pool = concurrent.futures.ThreadPoolExecutor(2)
    default_block = codec._CHECK_CHUNK_ROWS
    blocks = {"copy": copy_batch}
    for block in (1 << 13, 1 << 15, 1 << 16, 1 << 17):

        def search(block=block):
            codec._CHECK_CHUNK_ROWS = block
            try:
                list(pool.map(lambda r: codec._first_repeated_row(r, moe), rows))
            finally:
                codec._CHECK_CHUNK_ROWS = default_block

        blocks[f"search, 2 threads, {block >> 10}k-route blocks"] = search
    found = medians(blocks, args.repeats)
    show("blocks: the repeated-id search alone, back to back", found, found["copy"])

    n = (1 << 16) * TOP_K  # one block of the search, all-MoE contiguous rows
    block = flat[: n + TOP_K]
    same = np.empty((TOP_K - 1, n), np.bool_)
    scratch = np.empty(n, np.uint8)
    parts = {
        "copy of the block": lambda: np.copyto(scratch, block[:n]),
        f"{TOP_K - 1} shifted comparisons": lambda: [
            np.equal(block[:n], block[s : n + s], out=same[s - 1]) for s in range(1, TOP_K)
        ],
        "OR-reduction of their results": lambda: np.bitwise_or.reduce(
            same.view(np.uint64).reshape(TOP_K - 1, -1), axis=1
        ),
        "range check (max)": lambda: block[:n].max(),
    }
    part_times = medians(parts, 4 * args.repeats)
    show(f"parts: one {n >> 10} KiB block", part_times, part_times["copy of the block"])

    sample = rows[0]
    sample_flat, sample_copy = sample.reshape(-1), np.empty_like(sample)
    variants = {
        "copy of the sample": lambda: np.copyto(sample_copy, sample),
        "present search": lambda: codec._first_repeated_row(sample, moe),
        "XOR + min": lambda: xor_min_search(sample_flat, 1 << 18, TOP_K),
        "slot-major": lambda: slot_major_search(sample_flat.reshape(-1, TOP_K), 1 << 14, TOP_K),
    }
    if args.compile:

        def pairwise(x):
            bad = torch.zeros(x.shape[0], dtype=torch.bool)
            for a in range(x.shape[1]):
                for b in range(a + 1, x.shape[1]):
                    bad = bad | (x[:, a] == x[:, b])
            return bad.any()

        compiled = torch.compile(pairwise, dynamic=True)
        routes = torch.from_numpy(sample_flat.reshape(-1, TOP_K))
        start = time.perf_counter()
        compiled(routes)
        print(f"\ntorch.compile: first call (compiling) {time.perf_counter() - start:.1f} s")
        variants["torch.compile pairwise"] = lambda: compiled(routes)
    for name, fn in variants.items():  # every variant agrees: no repeated id in these rows
        assert not fn() or name.startswith("copy"), name
    planted = sample_flat.copy()
    planted[TOP_K * 1000 + 3] = planted[TOP_K * 1000 + 5]  # and each finds one planted repeat
    assert codec._first_repeated_row(planted.reshape(sample.shape), moe) == divmod(1000, LAYERS)
    assert xor_min_search(planted, 1 << 18, TOP_K) and slot_major_search(planted.reshape(-1, TOP_K), 1 << 14, TOP_K)
    variant_times = medians(variants, 2 * args.repeats)
    show(
        f"variants: one sample ({sample.shape[0]} x {LAYERS} routes)",
        variant_times,
        variant_times["copy of the sample"],
    )
    print(f"\nload average at end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
