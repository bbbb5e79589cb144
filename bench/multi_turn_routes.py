"""Multi-turn engine routes: the full prefix at every tool turn against only the positions not held yet.

A tool-calling conversation of ``--turns`` turns (each adds ``--completion`` generated tokens and, before the next
turn, ``--tool`` tool-result tokens) after a ``--prompt``-token prompt, at Qwen3-30B-A3B's route widths (48 MoE
layers, top-8, 128 experts: uint8 rows). Every turn is one ``/v1/completions`` request to the package's
vLLM-contract server (``trl_moe_replay.testing.FakeVLLMServer``, its engine swapped for canned routes so that only
the route transport is measured), asking for routes from

  full           position 0 (``routed_experts_prompt_start = 0``: the whole prefix again, every turn)
  incremental    the positions the sample does not hold yet (``routed_experts_prompt_start`` = what its earlier
                 turns brought: what the synchronous trainer sends, ``VLLMRouteSource.request_prompt_start``)

Measured per conversation, incremental / full:

  bytes          the ``routed_experts`` characters received (base64 ``.npy``, as vLLM sends them; what
                 ``vllm/route_bytes`` counts) and the whole response bodies
  decode+align   ``routes_from_engine`` on the sample's ``EngineTurn`` list of payload strings (decode each turn,
                 place every position from the first turn that forwarded it): the trainer's ``RouteIntake`` work
  round trips    the 50 HTTP requests (server-side encoding, JSON, transfer, client-side parse)

Both sides must place identical routes (checked). Timings are ABBA-interleaved pairs (``_harness.abba_pairs``).

    .venv/bin/python bench/multi_turn_routes.py               # 50 turns of 100 tokens, Qwen3-30B-A3B widths
    .venv/bin/python bench/multi_turn_routes.py --quick       # 20 turns, under a minute
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import requests
import torch
from _harness import abba_pairs, pair_spread, report

from trl_moe_replay.routing import EngineTurn, routes_from_engine
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model
from trl_moe_replay.testing.fake_vllm import EngineCompletion


class CannedRoutesEngine:
    """Stands in for the fake server's transformers engine: a completion of ``completion`` tokens whose rows are
    a fixed function of the position (distinct experts per route, as a router picks them), so that the server's
    encoding and the client's work are all that runs."""

    def __init__(self, layers: int, top_k: int, experts: int, completion: int, max_length: int):
        position = np.arange(max_length)[:, None, None]
        layer, slot = np.arange(layers)[None, :, None], np.arange(top_k)[None, None, :]
        self.table = ((position * 7 + layer * 3 + slot * (experts // top_k)) % experts).astype(np.uint8)
        self.completion = completion

    def generate(self, prompts, *, n=1, **ignored):
        out = []
        for prompt in prompts:
            tokens = [(len(prompt) + j) % 50 + 5 for j in range(self.completion)]
            rows = self.table[: len(prompt) + self.completion - 1]
            out.append([EngineCompletion(list(prompt), tokens, [0.0] * self.completion, rows, "length")] * n)
        return out


def conversation(url: str, turns: int, prompt: int, completion: int, tool: int, incremental: bool):
    """One sample's turns as the trainer records them (``EngineTurn`` of payload strings), and the bytes received."""
    sequence = list(range(prompt))
    recorded, held, payload_chars, body_bytes = [], 0, 0, 0
    for turn in range(turns):
        if turn:
            sequence += [3] * tool  # the tool result, read by this turn's prefill
        start = held if incremental else 0
        response = requests.post(
            f"{url}/v1/completions",
            json={
                "model": "tiny-moe",
                "prompt": [sequence],
                "max_tokens": completion,
                "routed_experts_prompt_start": start,
                "return_token_ids": True,
            },
            timeout=600,
        )
        response.raise_for_status()
        choice = response.json()["choices"][0]
        payload_chars += len(choice["routed_experts"])
        body_bytes += len(response.content)
        recorded.append(EngineTurn(choice["routed_experts"], len(sequence), len(choice["token_ids"]), start))
        sequence += choice["token_ids"]
        held = len(sequence) - 1  # every position but the last generated token was forwarded
    return recorded, len(sequence), payload_chars, body_bytes


def align(recorded, total: int, prompt: int, layers: int, top_k: int, experts: int) -> torch.Tensor:
    return routes_from_engine(
        [recorded],
        prompt_lengths=[prompt],
        completion_lengths=[total - prompt],
        prompt_width=prompt,
        completion_width=total - prompt,
        num_layers=layers,
        top_k=top_k,
        num_experts=experts,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--completion", type=int, default=60)
    parser.add_argument("--tool", type=int, default=40, help="tool-result tokens before each later turn")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="20 turns, 3 pairs")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.pairs = 20, 3
    L, K, E = args.layers, args.top_k, args.experts
    max_length = args.prompt + args.turns * (args.completion + args.tool)
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, numpy "
        f"{np.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        f"{args.turns} turns: prompt {args.prompt}, +{args.completion} generated, +{args.tool} tool tokens per "
        f"turn; {L} layers x top-{K}, {E} experts (uint8)"
    )

    with FakeVLLMServer(tiny_moe_model("qwen3_moe")) as server:
        server.engine = CannedRoutesEngine(L, K, E, args.completion, max_length)
        sides = {
            name: conversation(server.url, args.turns, args.prompt, args.completion, args.tool, name == "incr")
            for name in ("full", "incr")
        }
        (full, total, full_chars, full_body), (incr, total_incr, incr_chars, incr_body) = sides["full"], sides["incr"]
        assert total == total_incr
        placed = align(full, total, args.prompt, L, K, E)
        assert torch.equal(placed, align(incr, total, args.prompt, L, K, E)), "the two sides place other routes"

        positions = total - 1
        last = full[-1]  # the longest payload: the .npy header's share is smallest there
        per_token = len(last.rows) / (last.prompt_length + last.completion_length - 1)
        print(
            f"wire: {per_token:.1f} base64 characters per routed token ({L * K} raw bytes: {L * K * 4 / 3:.0f} "
            f"characters + the .npy header per payload); {positions} positions in the final sequence"
        )
        print(
            f"routed_experts characters received: full {full_chars / 1e6:.2f} MB "
            f"({full_chars / positions / (L * K * 4 / 3):.2f} rows per position), incremental "
            f"{incr_chars / 1e6:.2f} MB ({incr_chars / positions / (L * K * 4 / 3):.2f}); response bodies "
            f"{full_body / 1e6:.2f} MB vs {incr_body / 1e6:.2f} MB"
        )
        # the full prefix costs ~(turns + 1) / 2 rows per position, incremental ~1: the target leaves 1.5x of that
        target = round(3 / (args.turns + 1), 3)
        report("multi_turn_routes/route_bytes incremental/full", incr_chars / full_chars, target)
        report("multi_turn_routes/response_bytes incremental/full", incr_body / full_body, target)

        def timed(fn):
            def run(_round):
                start = time.perf_counter()
                fn()
                return time.perf_counter() - start

            return run

        times = abba_pairs(
            {
                "full": timed(lambda: align(full, total, args.prompt, L, K, E)),
                "incr": timed(lambda: align(incr, total, args.prompt, L, K, E)),
            },
            pairs=args.pairs,
        )
        spread = pair_spread(times, "full", "incr")
        print(
            f"decode+align: full {spread.baseline * 1e3:.1f} ms, incremental {spread.candidate * 1e3:.1f} ms per "
            f"conversation; ratio median {spread.median:.3f} [{spread.low:.3f}, {spread.high:.3f}] over "
            f"{spread.pairs} pairs"
        )
        report("multi_turn_routes/decode+align incremental/full", spread.median, 0.5)

        trips = abba_pairs(
            {
                name: timed(
                    lambda name=name: conversation(
                        server.url, args.turns, args.prompt, args.completion, args.tool, name == "incr"
                    )
                )
                for name in ("full", "incr")
            },
            pairs=max(1, args.pairs // 2),
        )
        spread = pair_spread(trips, "full", "incr")
        print(
            f"round trips ({args.turns} requests): full {spread.baseline:.2f} s, incremental {spread.candidate:.2f} s;"
            f" ratio median {spread.median:.3f} [{spread.low:.3f}, {spread.high:.3f}] over {spread.pairs} pairs"
        )
        report("multi_turn_routes/round_trips incremental/full", spread.median, 0.5)


if __name__ == "__main__":
    main()
