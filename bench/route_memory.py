"""Rank 0's memory when one generation batch's routes arrive over HTTP (server mode), through the real client path.

The stand-in server (``trl_moe_replay.testing.fake_vllm.FakeVLLMServer``, in its own process so its memory does not
count) answers TRL's ``VLLMClient.generate`` with ``--batch`` completions of ``--prompt + --completion`` tokens, each
with a ``routed_experts`` payload of the 30B recipe's shape (Qwen3-30B-A3B: 48 MoE layers, top-8, 128 experts, uint8
rows, i.e. 384 B per token, 512 B as base64). Its engine is synthetic (random routes, no model): only the bytes
matter here. ``--world`` fresh processes (a gloo group when more than one) then do what the trainer's ranks do with
one batch: rank 0 runs TRL's ``generate`` with the trainer's hook installed by a ``VLLMRouteSource``, and every rank
takes its share with ``VLLMRouteSource.local_rows`` (the scatter, with several ranks).

Printed: decoded route bytes, rank 0's peak extra memory (``ru_maxrss`` growth over the RSS right before the request;
whole process, so it includes TRL's own parse of tokens and log-probs, which ``--no-routes`` shows alone: the routes'
share is the difference), the ratio peak / decoded, and the wall time of generate + taking the routes.

The recipe (512 completions of up to 8.4K tokens, ~1.54 GiB decoded) does not fit a shared 24 GiB machine with room
to spare, so the default is an eighth of the batch (``--batch 64``); every buffer involved scales with the batch, so
the full-size peak is the ratio times the full decoded size (``--batch 128`` checks that the ratio is flat).

    PYTHONPATH=$PWD .venv/bin/python bench/route_memory.py                # 1/8 of the recipe, one rank
    PYTHONPATH=$PWD .venv/bin/python bench/route_memory.py --world 8      # rank 0 scattering to 7 others
    PYTHONPATH=$PWD .venv/bin/python bench/route_memory.py --no-routes    # TRL's own cost alone
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time

import numpy as np


def _synthetic_engine(layers: int, top_k: int, experts: int, completion: int, seed: int):
    from trl_moe_replay.routing.codec import engine_dtype
    from trl_moe_replay.testing.fake_vllm import EngineCompletion

    class SyntheticEngine:
        """Answers like ``TransformersEngine.generate`` without a model: random routes, ``completion`` tokens."""

        dtype = engine_dtype(experts)

        def __init__(self, model):
            self.rng = np.random.default_rng(seed)

        def generate(self, prompts, *, n=1, max_tokens=16, **ignored):
            groups = []
            for prompt in prompts:
                group = []
                for _ in range(n):
                    tokens = [int(t) for t in self.rng.integers(0, 1000, completion)]
                    rows = self.rng.integers(0, experts, (len(prompt) + completion - 1, layers, top_k), self.dtype)
                    group.append(EngineCompletion(list(prompt), tokens, [-1.0] * completion, rows, "length"))
                groups.append(group)
            return groups

    return SyntheticEngine


def serve(args: argparse.Namespace, url_queue, stop_event) -> None:
    from trl_moe_replay.testing import fake_vllm

    fake_vllm.TransformersEngine = _synthetic_engine(args.layers, args.top_k, args.experts, args.completion, 0)
    with fake_vllm.FakeVLLMServer(None, return_routes=not args.no_routes) as server:
        url_queue.put(server.url)
        stop_event.wait()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def client(args: argparse.Namespace, url: str, rank: int, init_file: str, result_queue) -> None:
    """Rank ``rank`` of ``--world``: rank 0 talks to the server, as the trainer's main process does; every rank then
    takes its share through ``VLLMRouteSource.local_rows`` (with several ranks, the scatter)."""
    from types import SimpleNamespace

    import torch

    from trl_moe_replay.rollouts.vllm_routes import VLLMRouteSource
    from trl_moe_replay.upstream.trl_seam import http_vllm_client

    if args.world > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world
        )
    main_process = rank == 0
    vllm_client = http_vllm_client(url, connection_timeout=60) if main_process else None
    generation = SimpleNamespace(mode="server", generation_kwargs={}, vllm_client=vllm_client)
    accelerator = SimpleNamespace(num_processes=args.world, is_main_process=main_process, device=torch.device("cpu"))
    source = VLLMRouteSource(generation, accelerator, required=not args.no_routes)
    per_rank = args.batch // args.world
    prompts = [[1 + (i % 500)] * args.prompt for i in range(per_rank * args.world)]
    if main_process:
        vllm_client.generate(prompts=prompts[:1], n=1, max_tokens=args.completion)  # warm: imports, pools
    if args.world > 1:
        torch.distributed.barrier()
    before = rss()
    start = time.perf_counter()
    source.begin_batch()
    if main_process:
        out = vllm_client.generate(prompts=prompts, n=1, max_tokens=args.completion)
        assert len(out["completion_ids"]) == len(prompts)
        del out
    rows = source.local_rows(per_rank)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert all(row is None or isinstance(row, np.ndarray) for row in rows) and len(rows) == per_rank
    if args.world > 1:
        torch.distributed.destroy_process_group()
    if main_process:
        result_queue.put((source.take_received_bytes(), peak - before, elapsed))
    del rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="completions in the batch (recipe: 512)")
    parser.add_argument("--completion", type=int, default=8192, help="completion tokens each")
    parser.add_argument("--prompt", type=int, default=208, help="prompt tokens each (8.4K forwarded in all)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--world", type=int, default=1, help="training processes (rank 0 scatters the shares)")
    parser.add_argument("--no-routes", action="store_true", help="server without routes: TRL's own cost alone")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    url_queue, stop_event, result_queue = ctx.Queue(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=serve, args=(args, url_queue, stop_event), daemon=True)
    server.start()
    url = url_queue.get(timeout=300)
    init_file = tempfile.mktemp(prefix="route_memory_pg_")
    try:
        ranks = [
            ctx.Process(target=client, args=(args, url, rank, init_file, result_queue)) for rank in range(args.world)
        ]
        for rank in ranks:
            rank.start()
        for rank in ranks:
            rank.join()
        if any(rank.exitcode != 0 for rank in ranks):
            sys.exit(f"a rank failed: exit codes {[rank.exitcode for rank in ranks]}")
        chars, extra, elapsed = result_queue.get(timeout=10)
    finally:
        stop_event.set()
        server.join(timeout=30)

    import requests
    import trl

    from trl_moe_replay.routing.codec import engine_dtype

    mib = 2**20
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs; python {platform.python_version()}, "
        f"trl {trl.__version__}, requests {requests.__version__}, numpy {np.__version__}"
    )
    decoded = (args.prompt + args.completion - 1) * args.layers * args.top_k * args.batch // args.world * args.world
    decoded = 0 if args.no_routes else decoded * np.dtype(engine_dtype(args.experts)).itemsize
    print(
        f"batch {args.batch} x ({args.prompt} + {args.completion}) tokens, {args.layers} layers, top-{args.top_k}, "
        f"{args.experts} experts, {args.world} rank(s){' (no routes)' if args.no_routes else ''}"
    )
    print(f"decoded route bytes : {decoded / mib:9.1f} MiB  (base64 received {chars / mib:.1f} MiB)")
    print(f"rank 0 peak extra   : {extra / mib:9.1f} MiB")
    if decoded:
        print(f"peak / decoded      : {extra / decoded:9.2f}")
    print(f"time                : {elapsed:9.2f} s  (generate + take{' + scatter' if args.world > 1 else ''})")


if __name__ == "__main__":
    main()
