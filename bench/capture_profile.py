"""Where R3's extra work goes with the real vLLM CPU engine: deterministic profiles, not timings.

On a shared 2-core machine the timed ratios of ``bench/vllm_overhead.py`` swing by +-10 % from round to round, more
than the cost being measured. This script answers the question those ratios cannot: *which code runs only because of
R3, and how long does it take*. It profiles (cProfile) the same work with R3 on and off and lists the functions whose
**call counts differ** between the two sides. Call counts do not depend on the machine's load, so that list is the
extra work R3 makes the process do; its summed own time, divided by the profiled total, estimates the overhead.
Functions called equally often on both sides (the kernels, the sampler) differ only by noise and are left out.
cProfile inflates Python-heavy code, so the estimate is an upper bound for Python work.

(a) ``--profile engine``: one ``vllm.LLM`` generate loop (32 prompts x 64 tokens, as ``vllm_overhead.py`` (a)) with
    capture on and off, each in a child process with the engine core in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler and the model runner are profiled too). Also timed: what
    vLLM's default multiprocess engine adds on top, encoding and decoding each step's per-request route slices
    between the engine core and the front end.
(b) ``--profile step``: the whole GRPO step of ``vllm_overhead.py`` (b), R3 vs none, both trainers in this process
    (colocated engines), steps alternating. Also listed: this package's R3-only functions, cumulative.

    python bench/capture_profile.py                    # both parts
    python bench/capture_profile.py --profile engine   # (model flags as in vllm_overhead.py: --layers 8 ...)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import warnings


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_overhead as bench  # noqa: E402  (checkpoint, prompts, trainers and the step are shared with that bench)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's flags, and the model and batch flags of ``vllm_overhead.py`` (``--hidden``, ``--layers``,
    ``--prompts``, ``--max-tokens``, ``--batch``, ``--completion``, ...)."""
    parser = bench.build_parser()
    parser.description = __doc__
    parser.add_argument("--profile", choices=["engine", "step", "both"], default="both", dest="what")
    parser.add_argument("--profiled", type=int, default=4, help="profiled generate calls (a) / steps per side (b)")
    parser.add_argument("--top", type=int, default=12, help="rows listed per part")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: [side, checkpoint, out]
    return parser.parse_args(argv)


def _name(key) -> str:
    path, line, func = key
    return f"{path.split('site-packages/')[-1].split('/work/')[-1]}:{line}({func})"


def extra_work(base: pstats.Stats, other: pstats.Stats, top: int) -> tuple[float, float, list[str]]:
    """(profiled total of ``base``, estimated extra own time of the functions called more often, report lines)."""
    a, b = base.stats, other.stats
    total = sum(v[2] for v in a.values())
    rows = []
    for key in set(a) | set(b):
        calls_a, own_a = (a[key][1], a[key][2]) if key in a else (0, 0.0)
        calls_b, own_b = (b[key][1], b[key][2]) if key in b else (0, 0.0)
        if calls_a == calls_b or "torch_compile_cache" in key[0]:  # each side's compiled graph has its own file
            continue
        if calls_a and calls_b:
            # Called on both sides (a builtin such as Tensor.copy_ serves many call sites): the own-time difference
            # would carry the noise of every shared call, so count the extra calls at the cheaper side's mean cost.
            extra = (calls_b - calls_a) * min(own_a / calls_a, own_b / calls_b)
        else:
            extra = own_b - own_a
        rows.append((extra, calls_a, calls_b, _name(key)))
    extra = sum(r[0] for r in rows)
    lines = [
        f"      {r[0] * 1e3:+8.1f} ms  calls {r[1]:>6} -> {r[2]:>6}  {r[3]}"
        for r in sorted(rows, key=lambda r: -r[0])[:top]
    ]
    return total, extra, lines


# ----------------------------------------------------------------------------- (a) engine
def engine_child(args, side: str, checkpoint: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from trl_moe_replay.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in bench.math_prompts(args.prompts)]
    llm = LLM(
        model=checkpoint,
        max_model_len=512,
        seed=0,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        enable_return_routed_experts=side == "on",
    )

    def generate(round_: int):
        params = [
            SamplingParams(
                max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, logprobs=0, seed=1000 * round_ + i
            )
            for i in range(len(prompts))
        ]
        return llm.generate(prompts, params, use_tqdm=False)

    generate(0), generate(1)  # warm-up: compile, caches
    profile = cProfile.Profile()
    profile.enable()
    for round_ in range(2, 2 + args.profiled):
        generate(round_)
    profile.disable()
    profile.dump_stats(out)
    bench.shutdown(llm)


def serialisation_cost(args) -> tuple[float, int]:
    """Seconds per engine step that vLLM's multiprocess engine spends encoding + decoding the per-request route
    slices of one decode step (``args.prompts`` requests, one token each), and the bytes they add."""
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    def step(routes: bool) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(
                    request_id=str(i),
                    new_token_ids=[5],
                    routed_experts=np.zeros((1, args.layers, args.top_k), np.uint8) if routes else None,
                )
                for i in range(args.prompts)
            ]
        )

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    seconds, sizes = {}, {}
    for routes in (False, True, False, True):  # ABAB; the second of each counts (warm)
        outputs, n = step(routes), 2000
        start = time.process_time()
        for _ in range(n):
            buffers = encoder.encode(outputs)
            decoder.decode(buffers)
        seconds[routes] = (time.process_time() - start) / n
        sizes[routes] = sum(len(b) for b in buffers)
    return seconds[True] - seconds[False], sizes[True] - sizes[False]


def bench_engine(args, checkpoint: str) -> None:
    stats = {}
    with tempfile.TemporaryDirectory(prefix="capture_profile_") as tmp:
        for side in ("off", "on"):  # one child per side: two in-process engines would share one process group
            out = os.path.join(tmp, f"{side}.pstats")
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
            subprocess.run(
                [sys.executable, __file__, "--child", json.dumps([side, checkpoint, out]), *sys.argv[1:]],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            stats[side] = pstats.Stats(out)
    total, extra, lines = extra_work(stats["off"], stats["on"], args.top)
    steps = args.profiled * args.max_tokens
    per_step, extra_bytes = serialisation_cost(args)
    print(
        f"(a) engine, in-process: {args.profiled} x generate({args.prompts} prompts x {args.max_tokens} tokens), "
        f"capture off vs on"
    )
    print(
        f"    profiled total, capture off: {total:.3f}s; extra own time of functions called more often with "
        f"capture on: {extra * 1e3:.1f} ms = {100 * extra / total:.2f} % of the engine's work"
    )
    print("\n".join(lines))
    print(
        f"    multiprocess engine only: encode+decode of each step's route slices {per_step * 1e6:.0f} us per step "
        f"({extra_bytes} bytes), {steps} steps: {per_step * steps * 1e3:.1f} ms = "
        f"{100 * per_step * steps / total:.2f} % more"
    )


# ----------------------------------------------------------------------------- (b) step
def bench_step(args, checkpoint: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        os.environ.setdefault(key, value)
    trainers = {}
    try:
        trainers["none"] = bench.build_trainer(args, checkpoint, "none")
        trainers["r3"] = bench.build_trainer(args, checkpoint, "r3")
        for trainer in trainers.values():
            trainer.parts = []
            bench.whole_step(trainer, 0)  # warm-up
        profiles = {mode: cProfile.Profile() for mode in trainers}
        for round_ in range(1, 1 + args.profiled):
            for mode in ("none", "r3") if round_ % 2 else ("r3", "none"):
                profiles[mode].enable()
                bench.whole_step(trainers[mode], round_)
                profiles[mode].disable()
        stats = {mode: pstats.Stats(profile) for mode, profile in profiles.items()}
    finally:
        for trainer in trainers.values():
            bench.shutdown(trainer.vllm_generation.llm)
        if trainers:
            next(iter(trainers.values())).end()
    total, extra, lines = extra_work(stats["none"], stats["r3"], args.top)
    print(f"(b) whole GRPO step, colocated engines, {args.profiled} steps per side, none vs r3")
    print(
        f"    profiled total, none: {total:.3f}s; extra own time of functions called more often with r3: "
        f"{extra * 1e3:.1f} ms = {100 * extra / total:.2f} % of the step"
    )
    print("\n".join(lines))
    ours = [
        (v[3], v[1], k)
        for k, v in stats["r3"].stats.items()
        if "trl_moe_replay" in k[0] and k not in stats["none"].stats and k[2] != "generate"
    ]  # RoutedExpertsLLM.generate: vLLM's whole generate, which none runs too
    print("    this package's functions that run only with r3 (cumulative, may nest):")
    for cumulative, calls, key in sorted(ours, reverse=True)[: args.top]:
        print(f"      {cumulative * 1e3:8.1f} ms  calls {calls:>6}  {_name(key)}")


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    args = parse_args()
    if args.child:
        side, checkpoint, out = json.loads(args.child)
        engine_child(args, side, checkpoint, out)
        return
    print(f"load average at start: {bench.load()} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory(prefix="capture_profile_") as tmp:
        checkpoint = bench.write_checkpoint(args, tmp)
        if args.what in ("engine", "both"):
            bench_engine(args, checkpoint)
        if args.what in ("step", "both"):
            bench_step(args, checkpoint)
    print(f"load average at end: {bench.load()}")


if __name__ == "__main__":
    main()
