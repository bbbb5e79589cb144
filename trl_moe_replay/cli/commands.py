"""The ``trl-moe-replay`` command: ``plot`` a run's metrics, ``audit`` a model's engine/trainer mismatch, ``env`` the
installed stack against the tested versions.

    trl-moe-replay plot RUN_DIR [--out DIR]
    trl-moe-replay audit --model M [--engine_dtype bfloat16] [--trainer_dtype float32] [--num_prompts 8] ...
    trl-moe-replay audit --model M --vllm_server_url http://localhost:8000 ...   (a running `trl vllm-serve`)
    trl-moe-replay plan CONFIG [--gpus 8] [--gpu-memory 80] [--prompt-length 1024]
    trl-moe-replay env [--json]

Also runnable as ``python -m trl_moe_replay.cli``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def _plot(args: argparse.Namespace) -> int:
    from .plotting import plot_run

    paths = plot_run(args.run_dir, args.out)
    for path in paths:
        print(path)
    return 0


def _audit(args: argparse.Namespace) -> int:
    from .audit import run_audit

    report = run_audit(
        args.model,
        prompts=args.prompt or None,
        num_prompts=args.num_prompts,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        engine_dtype=args.engine_dtype,
        trainer_dtype=args.trainer_dtype,
        use_chat_template={"auto": None, "yes": True, "no": False}[args.chat_template],
        extreme_threshold=args.extreme_threshold,
        seed=args.seed,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        vllm_server_url=args.vllm_server_url,
        vllm_timeout=args.vllm_timeout,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_table())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .plan import run_plan

    text, fits = run_plan(args.config, args.gpus, args.gpu_memory, args.prompt_length)
    print(text)
    return 0 if fits else 1


def _env(args: argparse.Namespace) -> int:
    from .environment import run_env

    print(run_env(as_json=args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-moe-replay",
        description="Routing replay for MoE RL with TRL: plots, a pre-training audit, a memory plan and the installed "
        "stack.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    plot = commands.add_parser(
        "plot",
        help="write PNG charts of a run's metrics (reward, mismatch/*, routing/*, loss, ...) from trainer_state.json",
    )
    plot.add_argument("run_dir", help="a training output_dir (trainer_state.json in it or in its last checkpoint-N)")
    plot.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots)")
    plot.set_defaults(func=_plot)

    audit = commands.add_parser(
        "audit",
        help="measure, before training, the routing and log-prob mismatch between the generation engine and the "
        "trainer, with and without routing replay (R3)",
    )
    audit.add_argument("--model", required=True, help="Hub name or local path, or tiny:<model_type> (offline)")
    audit.add_argument("--prompt", action="append", help="a prompt (repeatable); default: offline math prompts")
    audit.add_argument("--num_prompts", type=int, default=8, help="number of default prompts (default 8)")
    audit.add_argument("--num_generations", type=int, default=2, help="completions per prompt (default 2)")
    audit.add_argument("--max_new_tokens", type=int, default=64)
    audit.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (default 1)")
    audit.add_argument(
        "--engine_dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the generating copy (inference engines run bf16)",
    )
    audit.add_argument(
        "--trainer_dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="dtype of the trainer's forward (auto: float32 where the model fits the device, else "
        "bfloat16; the report's note says which and why)",
    )
    audit.add_argument(
        "--chat_template",
        default="auto",
        choices=["auto", "yes", "no"],
        help="wrap prompts as a user message with the tokenizer's chat template (auto: if it has one)",
    )
    audit.add_argument(
        "--extreme_threshold",
        type=float,
        default=2.0,
        help="a token is extreme when its probability ratio exceeds this either way; > 1 (default 2)",
    )
    audit.add_argument("--seed", type=int, default=0)
    audit.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    audit.add_argument("--trust_remote_code", action="store_true")
    audit.add_argument(
        "--vllm_server_url",
        default=None,
        metavar="URL",
        help="audit this running vLLM server instead of transformers generate (start it with "
        "`trl vllm-serve --model M --enable-return-routed-experts`, same checkpoint as --model); "
        "--engine_dtype is then the server's own",
    )
    audit.add_argument(
        "--vllm_timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up on the vLLM server after this long without the completions (default 300; 0: "
        "wait as long as it takes)",
    )
    audit.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    audit.set_defaults(func=_audit)

    plan = commands.add_parser(
        "plan",
        help="estimate a recipe config's per-GPU memory (weights, gradients, masters, optimizer, activations, vLLM), "
        "its batch arithmetic and route bytes, from the model's numbers; exit 1 if it does not fit",
    )
    plan.add_argument(
        "config", help="a recipe config (recipes/configs/*.yaml); its header's launch lines give the layout"
    )
    plan.add_argument("--gpus", type=int, default=None, help="GPUs the layout may use (default: its `# plan:` line)")
    plan.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="memory of each GPU in GB (default: its `# plan:` line)",
    )
    plan.add_argument(
        "--prompt-length",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest prompt in tokens (default: its `# plan:` line, else 1024)",
    )
    plan.set_defaults(func=_plan)
    env = commands.add_parser(
        "env",
        help="print the installed torch, transformers, trl, accelerate, peft, datasets, vllm and deepspeed, each "
        "against the declared range and the versions the test suite ran on",
    )
    env.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    env.set_defaults(func=_env)
    return parser


# What a user can fix (a path, a file, a server, an argument): one line on stderr and exit status 2, no traceback.
# Anything else is a bug and keeps its traceback.
_USER_ERRORS = (OSError, ValueError, ImportError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return status
    except BrokenPipeError:  # `trl-moe-replay env | head`: the reader has gone; no traceback, no error line
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would raise again (Python's docs, signal)
        return 1
    except _USER_ERRORS as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"trl-moe-replay {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
