"""Rank 0's memory when one generation batch's routes arrive over HTTP (server mode), through the real client path.

The stand-in server (``trl_moe_replay.testing.fake_vllm.FakeVLLMServer``, in its own process so its memory does not
count) answers TRL's ``VLLMClient.generate`` with ``--batch`` completions of ``--prompt + --completion`` tokens, each
with a ``routed_experts`` payload of the 30B recipe's shape (Qwen3-30B-A3B: 48 MoE layers, top-8, 128 experts, uint8
rows, i.e. 384 B per token, 512 B as base64). Its engine is synthetic (random routes, no model): only the bytes
matter here. In a fresh process per variant, the client then does what rank 0 does with one batch:
``install_routes_hook`` on the client, ``begin``/``generate``/``take`` and ``decode_routed_experts`` of every payload
(kept, as the trainer keeps them until alignment).

Printed per variant: decoded route bytes, peak extra memory (``ru_maxrss`` growth over the RSS right before the
request; whole process, so it includes TRL's own parse of tokens and log-probs, which ``--no-routes`` shows alone),
the ratio peak / decoded, and the wall time of generate + decode.

The recipe (512 completions of up to 8.4K tokens, ~1.65 GB decoded) does not fit a shared 24 GiB machine with room
to spare, so the default is an eighth of the batch (``--batch 64``); the ratio does not depend on the batch size (every
buffer involved scales with it), so the full-size peak is the ratio times the full decoded size.

    PYTHONPATH=$PWD .venv/bin/python bench/route_memory.py               # 1/8 of the recipe
    PYTHONPATH=$PWD .venv/bin/python bench/route_memory.py --batch 128   # 1/4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import sys
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


class _PrototypeHook:
    """Not the package's hook: a sketch of the bounded one (``--prototype``). One parse of the body, each choice's
    payload decoded as the choice is built, and TRL handed a replacement response without the payloads."""

    def __init__(self, vllm_client):
        self.rows = None
        vllm_client.session.hooks["response"].insert(0, self)

    def start(self):
        self.rows = []

    def take(self):
        rows, self.rows = self.rows, None
        return rows

    def __call__(self, response, *args, **kwargs):
        import io
        import json

        import requests

        from trl_moe_replay.routing.codec import decode_routed_experts

        if self.rows is None or not response.request.path_url.endswith("/v1/completions"):
            return None

        def choice_hook(pairs):
            obj = dict(pairs)
            if "routed_experts" in obj and "index" in obj:
                payload = obj.pop("routed_experts")
                try:
                    self.rows.append(decode_routed_experts(payload) if payload is not None else None)
                except Exception:
                    self.rows.append(payload)
            return obj

        body = json.loads(response.content, object_pairs_hook=choice_hook)
        replacement = requests.Response()
        replacement.raw = io.BytesIO(json.dumps(body).encode())
        del body
        for name in ("status_code", "headers", "url", "request", "reason", "elapsed", "encoding"):
            setattr(replacement, name, getattr(response, name))
        response._content = b""  # the sketch frees the body; the package would do this through the seam
        return replacement


def client(args: argparse.Namespace, url: str, result_queue) -> None:
    from trl_moe_replay.rollouts.vllm_routes import install_routes_hook
    from trl_moe_replay.routing.codec import decode_routed_experts
    from trl_moe_replay.upstream.trl_seam import http_vllm_client

    vllm_client = http_vllm_client(url, connection_timeout=60)
    hook = install_routes_hook(vllm_client) if not args.prototype else _PrototypeHook(vllm_client)
    prompts = [[1 + (i % 500)] * args.prompt for i in range(args.batch)]
    vllm_client.generate(prompts=prompts[:1], n=1, max_tokens=args.completion)  # warm: imports, pools
    hook.start()
    hook.take()
    before = rss()
    start = time.perf_counter()
    hook.start()
    out = vllm_client.generate(prompts=prompts, n=1, max_tokens=args.completion)
    rows = hook.take()
    decoded = [row if row is None or isinstance(row, np.ndarray) else decode_routed_experts(row) for row in rows]
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    decoded_bytes = sum(0 if a is None else a.nbytes for a in decoded)
    payload_chars = sum(0 if r is None else len(r) for r in rows)
    assert len(out["completion_ids"]) == args.batch
    result_queue.put((decoded_bytes, payload_chars, peak - before, elapsed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="completions in the batch (recipe: 512)")
    parser.add_argument("--completion", type=int, default=8192, help="completion tokens each")
    parser.add_argument("--prompt", type=int, default=208, help="prompt tokens each (8.4K forwarded in all)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--prototype", action="store_true", help="a sketch of the bounded hook, not the package's")
    parser.add_argument("--no-routes", action="store_true", help="server without routes: TRL's own cost alone")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    url_queue, stop_event, result_queue = ctx.Queue(), ctx.Event(), ctx.Queue()
    server = ctx.Process(target=serve, args=(args, url_queue, stop_event), daemon=True)
    server.start()
    url = url_queue.get(timeout=300)
    try:
        worker = ctx.Process(target=client, args=(args, url, result_queue))
        worker.start()
        worker.join()
        if worker.exitcode != 0:
            sys.exit(f"client failed with exit code {worker.exitcode}")
        decoded, chars, extra, elapsed = result_queue.get(timeout=10)
    finally:
        stop_event.set()
        server.join(timeout=30)

    import requests
    import trl

    mib = 2**20
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs; python {platform.python_version()}, "
          f"trl {trl.__version__}, requests {requests.__version__}, numpy {np.__version__}")
    print(f"batch {args.batch} x ({args.prompt} + {args.completion}) tokens, {args.layers} layers, top-{args.top_k}, "
          f"{args.experts} experts{' (no routes)' if args.no_routes else ''}{' (prototype hook)' if args.prototype else ''}")
    print(f"decoded route bytes : {decoded / mib:9.1f} MiB  (base64 payloads {chars / mib:.1f} MiB)")
    print(f"peak extra memory   : {extra / mib:9.1f} MiB")
    if decoded:
        print(f"peak / decoded      : {extra / decoded:9.2f}")
    print(f"time                : {elapsed:9.2f} s  (generate + decode)")


if __name__ == "__main__":
    main()
