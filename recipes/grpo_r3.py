# Copyright 2026 The trl_moe_replay authors. Licensed under the Apache License, Version 2.0.
"""GRPO with routing replay (R3 by default) for Mixture-of-Experts models: TRL's `grpo.py` with the trainer swapped.

Offline default (no arguments): a tiny MoE from `trl_moe_replay.testing` gets a short cached cold-start SFT on a
synthetic arithmetic set, then GRPO with R3 and the math-verify reward raises its accuracy; plots land in
`OUTPUT_DIR/plots/`. Runs in a few minutes on 2 CPU cores (docs/demo.md has the timings) and never touches the network:

    accelerate launch recipes/grpo_r3.py
    accelerate launch recipes/grpo_r3.py --max_steps 30 --routing_replay none --output_dir runs/none

Tool use (`--tools`, TRL's `GRPOTrainer(tools=...)`): the tiny MoE is cold-started on calculator demonstrations for
two-digit additions, then GRPO with R3 (every turn's routes replayed) teaches it to call the calculator:

    accelerate launch recipes/grpo_r3.py --config recipes/configs/tiny_tools_r3.yaml

Real models: name one (and a dataset), on the command line or in a config file; every flag overrides the file:

    accelerate launch --config_file recipes/accelerate/zero3.yaml recipes/grpo_r3.py \
        --config recipes/configs/qwen3_30b_a3b_vllm_server_zero3.yaml
    python recipes/grpo_r3.py --model_name_or_path allenai/OLMoE-1B-7B-0924-Instruct --dataset_name openai/gsm8k

The tiny-model defaults (learning rate, batch, lengths, ...) apply only when no model is named; on a machine without
a GPU every run defaults to float32 on the CPU (`--use_cpu true --bf16 false`).

Expert parallelism (transformers shards the model at load time; docs/sharded_training.md), e.g. two CPU processes:

    torchrun --nproc_per_node 2 recipes/grpo_r3.py --ep_size 2 --fsdp_size 2 --ep_implementation all_to_all

Stopping and resuming: checkpoints are saved every `--save_steps` (50 for the tiny model); Ctrl-C or SIGTERM (SLURM,
Kubernetes, a launcher stopped) saves one at the end of the step in progress and prints the command that resumes,
which is the same command with `--resume_from_checkpoint` (no value: the newest checkpoint in `--output_dir`). Under
`accelerate launch` the run saves and prints the same, but the launcher prints a traceback of its own (one process: it
also returns before the run has saved, and the run's lines follow the prompt); `python recipes/grpo_r3.py` runs one
process without a launcher. The launcher and scheduler must wait long enough (docs/demo.md, "Preemption"). A run
started into an output_dir that holds an earlier run says in one line whether it resumes it or overwrites it; one that
a live run holds is refused before anything else.
"""

import contextlib
import dataclasses
import difflib
import importlib
import os
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass, field


def _given(argv: list[str], name: str) -> bool:
    """Whether the command line or its --config file sets the argument ``name`` (e.g. model_name_or_path)."""
    if any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv):
        return True
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml

        with open(argv[argv.index("--config") + 1]) as f:
            return bool((yaml.safe_load(f) or {}).get(name))
    return False


# OpenMP threads that sleep instead of spinning while they wait: on a CPU shared with other work, spinning threads
# steal the cores the working ones need (measured here: a tiny-MoE forward+backward 17 s -> 0.2 s on 2 busy cores).
# Read by OpenMP when torch loads, so it is set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if __name__ == "__main__" and not any(_given(sys.argv[1:], n) for n in ("model_name_or_path", "dataset_name")):
    # The offline default must not touch the network; set before transformers/huggingface_hub are imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from trl import ModelConfig, ScriptArguments, TrlParser  # noqa: E402

from trl_moe_replay import MoEReplayGRPOConfig  # noqa: E402
from trl_moe_replay.checkpointing.checkpoints import (  # noqa: E402
    NoCheckpointError,
    SaveOnInterrupt,
    StartOver,
    describe_run,
    resolve_resume,
)
from trl_moe_replay.core.config_checks import ConfigTypeError, ConfigValueError, check_config_file  # noqa: E402
from trl_moe_replay.weight_sync.server_requests import server_gone_errors  # noqa: E402


class RecipeArgumentError(ValueError):
    """An argument of this recipe names something that does not exist (a reward function, a tool, a tiny config)."""


@dataclass
class GRPOR3ScriptArguments(ScriptArguments):
    """Script arguments: TRL's `ScriptArguments` (dataset_name, dataset_config, splits, ...) plus the ones below.

    Without `dataset_name`, the offline synthetic math set of `trl_moe_replay.extras.math.data` is used. Without
    `--model_name_or_path`, the tiny offline MoE described by the `tiny_*` arguments is built and cold-started.
    """

    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy_reward"],
        metadata={
            "help": "Reward functions: accuracy_reward, format_reward (trl_moe_replay.extras.math.rewards), TRL's "
            "think_format_reward, reasoning_accuracy_reward, or any dotted import path (my_lib.rewards.func)."
        },
    )
    conversational: bool | None = field(
        default=None,
        metadata={"help": "Prompts as chat messages. Default: yes for Hub datasets, no for the synthetic set."},
    )
    instruction: str | None = field(
        default=None,
        metadata={
            "help": "Text appended to each problem, e.g. 'Please reason step by step, and put your final "
            "answer within \\boxed{}.' (Hub datasets; the synthetic set's cold start teaches the format)."
        },
    )
    system_prompt: str | None = field(default=None, metadata={"help": "System message (conversational prompts)."})
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Tools the policy may call (TRL's GRPOTrainer(tools=...)): calculator "
            "(trl_moe_replay.extras.math.tools) or any dotted import path (my_lib.tools.func; Google-style docstring, "
            "type hints). Prompts are then conversational and rendered with the tools."
        },
    )
    # ---- evaluation set of its own (TRL's eval_strategy/eval_steps decide when it runs)
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Evaluate on this set instead of dataset_test_split of dataset_name: a supported Hub math "
            "dataset (e.g. HuggingFaceH4/MATH-500) or 'synthetic' (the offline set, other rows). Needs "
            "--eval_strategy steps and --eval_steps N."
        },
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Config of eval_dataset_name."})
    eval_dataset_split: str | None = field(
        default=None, metadata={"help": "Split of eval_dataset_name (default: its own, 'test' for MATH-500)."}
    )
    eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on the first N rows only (default: all; synthetic: 256)."}
    )
    # ---- offline synthetic set
    synthetic_samples: int = field(default=4000, metadata={"help": "Rows of the synthetic set."})
    synthetic_difficulty: int = field(
        default=0, metadata={"help": "trl_moe_replay.extras.math.data.LEVELS key (0: a+b, 0-9)."}
    )
    synthetic_max_operand: int | None = field(default=None, metadata={"help": "Largest operand (level's default)."})
    synthetic_kinds: list[str] = field(
        default_factory=lambda: ["arithmetic"], metadata={"help": "Problem kinds: arithmetic and/or word."}
    )
    # ---- tiny offline model
    tiny_model_type: str = field(default="qwen3_moe", metadata={"help": "transformers model_type of the tiny MoE."})
    tiny_hidden_size: int = field(default=64, metadata={"help": "Hidden size of the tiny MoE."})
    tiny_num_layers: int = field(default=2, metadata={"help": "Decoder layers of the tiny MoE."})
    tiny_num_experts: int = field(default=8, metadata={"help": "Routed experts per MoE layer."})
    tiny_top_k: int = field(default=2, metadata={"help": "Experts per token."})
    tiny_num_threads: int = field(
        default=1,
        metadata={
            "help": "torch threads for the tiny model (0: torch's default). Float sums, and so every number "
            "the run prints, depend on the thread count; with one, they are the same on every machine and "
            "launcher (accelerate launch sets one, torch's default is one per core), and a model this small "
            "gains nothing from more."
        },
    )
    # ---- cold-start SFT of the tiny model (cached)
    sft_steps: int = field(default=400, metadata={"help": "Cold-start SFT steps before GRPO (0: none)."})
    sft_learning_rate: float = field(default=3e-3, metadata={"help": "Cold-start SFT learning rate."})
    sft_batch_size: int = field(default=64, metadata={"help": "Cold-start SFT batch size."})
    sft_label_noise: float = field(
        default=0.67,
        metadata={
            "help": "Fraction of SFT answers replaced by a near miss (+-1): the SFT policy is then right only "
            "about 1 - noise of the time, and RL has something to fix."
        },
    )
    sft_tool_call_fraction: float = field(
        default=0.5,
        metadata={
            "help": "With --tools: fraction of cold-start demonstrations that call the tool before answering "
            "(the others answer at once). 0: no tool demonstrations."
        },
    )
    sft_cache_dir: str | None = field(
        default=None, metadata={"help": "Cold-start cache (default $TRL_MOE_REPLAY_CACHE or ~/.cache/trl_moe_replay)."}
    )
    plot: bool = field(default=True, metadata={"help": "Write PNG charts into OUTPUT_DIR/plots at the end."})
    # ---- parallel sizes: transformers shards the model at load time (expert parallelism; docs/sharded_training.md)
    ep_size: int | None = field(
        default=None,
        metadata={
            "help": "Expert parallelism: ranks each MoE layer's experts are split across (transformers' "
            "DistributedConfig, model_init_kwargs.distributed_config). Launch with torchrun or accelerate "
            "launch (ddp.yaml); pp x dp_replicate x fsdp x tp sizes must equal the number of processes."
        },
    )
    fsdp_size: int | None = field(default=None, metadata={"help": "With ep_size: ranks FSDP2 shards the model over."})
    tp_size: int | None = field(default=None, metadata={"help": "With ep_size: tensor parallelism (GPUs only)."})
    dp_replicate_size: int | None = field(
        default=None, metadata={"help": "With ep_size: FSDP replicas (HSDP, e.g. one per node)."}
    )
    ep_implementation: str | None = field(
        default=None,
        metadata={
            "help": "How tokens reach the experts: all_to_all, all_reduce (needs ep_size == tp_size), "
            "deepgemm_megamoe or auto (transformers' choice).",
            "choices": ["all_to_all", "all_reduce", "deepgemm_megamoe", "auto"],
        },
    )


#: GRPOConfig values for the tiny offline model (used only when no model is named): CPU-sized batches and
#: completions, a learning rate for a 0.2M-parameter model, every step logged for the plots.
OFFLINE_DEFAULTS = dict(
    output_dir="runs/grpo_r3_tiny",
    routing_replay="r3",
    max_steps=300,
    learning_rate=5e-4,
    lr_scheduler_type="constant_with_warmup",
    warmup_steps=10,
    per_device_train_batch_size=128,
    num_generations=8,
    max_completion_length=8,
    # The stop after the answer is rewarded (reward_funcs below: DAPO's overlong reward shaping), not filtered:
    # `mask_truncated_completions` left a cut completion out of the loss, so a wrong answer's end-of-turn token was
    # pushed down and writing on never was; on some seeds (and CPUs) every completion ended up cut, the loss 0, and
    # the run collapsed (docs/demo.md, "Why these settings").
    temperature=1.0,
    beta=0.0,
    bf16=False,
    logging_steps=1,
    save_strategy="steps",
    save_steps=50,
    save_total_limit=2,
    report_to="none",
    seed=0,
    # script argument: accuracy, plus -1 for a completion cut at max_completion_length (TRL's soft overlong punishment)
    reward_funcs=["accuracy_reward", "soft_overlong_punishment"],
)

# TRL turns gradient checkpointing on by default; transformers calls the field activation_checkpointing in newer
# releases (gradient_checkpointing in older ones, 5.16 among them). A default for a field the installed version
# lacks would reach no dataclass.
_CHECKPOINTING = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in {f.name for f in dataclasses.fields(MoEReplayGRPOConfig)}
)
OFFLINE_DEFAULTS[_CHECKPOINTING] = False

#: GRPOConfig values on a machine without a GPU, whether or not a model is named (config files and flags still
#: override them): float32 on the CPU. TRL's default bf16 needs a GPU unless use_cpu is set, and accelerate treats a
#: torchrun launch on such a machine as distributed only with use_cpu.
CPU_DEFAULTS = dict(use_cpu=True, bf16=False) if not torch.cuda.is_available() else {}


class RecipeParser(TrlParser):
    """TRL's parser, with one-line errors: argparse's own errors print the whole usage (200+ lines) before the one
    line that matters; here that line alone, naming the config file when the value came from it."""

    config_path: str | None = None
    config_keys: frozenset = frozenset()

    def error(self, message: str):
        if self.config_path:
            for key in self.config_keys:
                if f"argument --{key}/" in message or f"argument --{key}:" in message:
                    message += f" (the value of {key} in {self.config_path})"
                    break
        self.exit(2, f"{self.prog}: error: {message} (--help lists the arguments)\n")


DATACLASSES = (GRPOR3ScriptArguments, MoEReplayGRPOConfig, ModelConfig)


def make_parser() -> RecipeParser:
    parser = RecipeParser(
        DATACLASSES,
        usage="%(prog)s [--config FILE.yaml] [--ARGUMENT VALUE ...]",
        description="GRPO with routing replay for MoE models. Every argument below can also be set in a --config "
        "YAML file (the command line wins). Without --model_name_or_path: the tiny offline demo.",
    )
    group_help(parser)
    return parser


def group_help(parser: RecipeParser) -> None:
    """--help in groups, ours first: this recipe's arguments, then the routing-replay ones (MoEReplayGRPOConfig's
    own), then TRL's and transformers' (over a thousand lines of them otherwise come first), each cut to its first
    sentence. Only the help changes: the arguments and their parsing stay TrlParser's."""
    from trl import GRPOConfig

    own = lambda cls, base: {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(base)}  # noqa: E731
    groups = [
        (
            "this recipe",
            "recipes/grpo_r3.py: data, reward functions, tools, the tiny offline model and its cold start",
            own(GRPOR3ScriptArguments, ScriptArguments),
        ),
        (
            "routing replay and MoE objectives",
            "MoEReplayGRPOConfig's own arguments (docs/usage.md)",
            own(MoEReplayGRPOConfig, GRPOConfig),
        ),
        ("dataset (TRL's ScriptArguments)", None, {f.name for f in dataclasses.fields(ScriptArguments)}),
        ("model (TRL's ModelConfig)", None, {f.name for f in dataclasses.fields(ModelConfig)}),
        (
            "training (TRL's GRPOConfig, transformers' TrainingArguments)",
            "first sentences only; the full descriptions are in TRL's and transformers' documentation",
            None,
        ),
    ]
    upstream_first = len(groups) - 3
    everything = [action for action in parser._actions if action.dest != "help"]
    for index, (title, description, names) in enumerate(groups):
        group = parser.add_argument_group(title, description)
        for action in everything:
            if names is None or action.dest in names:
                for holder in parser._action_groups:  # argparse keeps each action in one group's list
                    if action in holder._group_actions and holder is not group:
                        holder._group_actions.remove(action)
                group._group_actions.append(action)
                if index >= upstream_first and action.help:
                    action.help = action.help.split(". ")[0].split("\n\n")[0].rstrip(".") + "."
        everything = [action for action in everything if action not in group._group_actions]
    # argparse's own "options" group (-h) last, after ours and TRL's
    parser._action_groups.append(parser._action_groups.pop(1))


def parse_args(argv: list[str] | None = None):
    """(script_args, training_args, model_args). Order of precedence: command line > --config file > offline
    defaults (only when no model is named) > the dataclasses' defaults.

    Mistakes end in one line on stderr and exit status 2: an unknown argument (with the closest known name), a value
    of the wrong type or not among the choices, a value the config objects refuse."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # a bare --resume_from_checkpoint (no value, or another flag next): resume from the newest checkpoint
    for i, arg in enumerate(argv):
        if arg == "--resume_from_checkpoint" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            argv.insert(i + 1, "true")
    parser = make_parser()
    parser.set_defaults(**CPU_DEFAULTS)
    if not _given(argv, "model_name_or_path"):
        parser.set_defaults(**OFFLINE_DEFAULTS)
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml

        parser.config_path = argv[argv.index("--config") + 1]
        try:
            with open(parser.config_path) as f:
                file_values = yaml.safe_load(f) or {}
            parser.config_keys = frozenset(file_values.keys())
        except (OSError, yaml.YAMLError, AttributeError) as exc:
            parser.error(f"--config {parser.config_path}: {' '.join(str(exc).split())}")
    try:
        if parser.config_path:  # the file's values as YAML typed them, before TrlParser reads text like the CLI's
            check_config_file(DATACLASSES, file_values, parser.config_path)
        *parsed, from_file, from_command_line = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
        check_model_args(parsed[2])
    except (ValueError, TypeError) as exc:  # what the config objects refuse (their __post_init__ checks)
        parser.error(" ".join(str(exc).split()))
    apply_parallel_sizes(parsed[0], parsed[1])  # checked against the launch when training starts (train())
    unknown = [a for a in from_command_line if a.startswith("-")]
    unknown_in_file = [a[2:] for a in from_file[::2]]  # TRL gives the file's unknown keys as ["--key", "value", ...]
    if unknown or from_command_line:
        parser.error(_unknown_message(unknown or from_command_line, "argument"))
    if unknown_in_file:
        parser.error(_unknown_message(unknown_in_file, f"key in {parser.config_path}"))
    return tuple(parsed)


# The dtype names TRL's model loading takes (trl.trainer.utils.create_model_from_path raises on any other).
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_model_args(model_args: ModelConfig) -> None:
    """Refuse, in one line, the ``ModelConfig`` values TRL's model loading or PEFT would fail on later: a YAML file's
    values reach ``ModelConfig`` as YAML typed them, unchecked (``lora_r: 4.5``, ``dtype: float8``). A value that is
    not used (``dtype`` for the tiny offline model, the LoRA fields without ``use_peft``) is left alone, as TRL leaves
    it; every value TRL takes is taken."""

    def refuse(name: str, expected: str, why: str) -> None:
        value = getattr(model_args, name)
        raise ConfigValueError(f"{name} must be {expected}, got {type(value).__name__} {value!r}: {why}")

    def is_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if (
        model_args.model_name_or_path is not None
        and model_args.dtype is not None
        and model_args.dtype not in MODEL_DTYPES
    ):
        refuse("dtype", f"one of {list(MODEL_DTYPES)}", "TRL's model loading accepts no other")
    if model_args.load_in_4bit and model_args.bnb_4bit_quant_type not in ("fp4", "nf4"):
        refuse("bnb_4bit_quant_type", "'fp4' or 'nf4'", "bitsandbytes' 4-bit quantization knows no other")
    if model_args.use_peft:
        if isinstance(model_args.lora_r, bool) or not isinstance(model_args.lora_r, int) or model_args.lora_r < 1:
            refuse("lora_r", "an int >= 1 (the LoRA rank)", "PEFT builds rank-sized layers from it")
        if not is_number(model_args.lora_alpha):
            refuse("lora_alpha", "a number", "PEFT scales the adapter by lora_alpha / lora_r")
        if not is_number(model_args.lora_dropout) or not 0 <= model_args.lora_dropout <= 1:
            refuse("lora_dropout", "a number in [0, 1]", "torch's Dropout raises on any other")


PARALLEL_SIZES = ("ep_size", "fsdp_size", "tp_size", "dp_replicate_size", "ep_implementation")


def apply_parallel_sizes(script_args, training_args) -> None:
    """``--ep_size`` and the other sizes into ``model_init_kwargs.distributed_config`` (flags over the config's
    mapping); ``train()`` checks them against the launched processes before any work."""
    from trl_moe_replay.parallel.expert_parallel import DISTRIBUTED_CONFIG

    sizes = {name: getattr(script_args, name) for name in PARALLEL_SIZES if getattr(script_args, name) is not None}
    if sizes:
        kwargs = dict(training_args.model_init_kwargs or {})
        kwargs[DISTRIBUTED_CONFIG] = {**(kwargs.get(DISTRIBUTED_CONFIG) or {}), **sizes}
        training_args.model_init_kwargs = kwargs


def _unknown_message(names: list[str], what: str) -> str:
    """'unknown argument --routing_replai (did you mean --routing_replay?)'."""
    known = [f.name for cls in DATACLASSES for f in dataclasses.fields(cls) if f.init]
    parts = []
    for name in names:
        bare = name.lstrip("-").split("=", 1)[0].replace("-", "_")
        close = difflib.get_close_matches(bare, known, n=1, cutoff=0.7)
        prefix = "--" if name.startswith("-") else ""
        parts.append(f"{name}" + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
    return f"unknown {what}{'s' if len(parts) > 1 else ''}: {', '.join(parts)}"


def _by_name(name: str, registry: dict, kind: str):
    """``registry[name]``, or the callable a dotted import path names (modules under the working directory too)."""
    if name in registry:
        return registry[name]
    if "." in name:
        module_path, func_name = name.rsplit(".", 1)
        sys.path.insert(0, os.getcwd())
        try:
            return getattr(importlib.import_module(module_path), func_name)
        except (ImportError, AttributeError) as exc:
            raise RecipeArgumentError(f"{kind} {name!r} does not import: {exc}") from exc
    raise RecipeArgumentError(f"Unknown {kind} {name!r}: one of {sorted(registry)} or a dotted import path.")


def reward_functions(names: list[str], max_completion_length: int | None = None) -> list:
    """The callables for ``--reward_funcs``. ``soft_overlong_punishment`` is TRL's (DAPO's overlong reward shaping,
    eq. 13): 0 up to ``max_completion_length - cache``, then down to -1 at the limit, with DAPO's cache of a fifth of
    the limit (4,096 of 20,480 there; at least one token)."""
    from trl.rewards import get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward

    from trl_moe_replay.extras.math.rewards import accuracy_reward, format_reward

    registry = {
        "accuracy_reward": accuracy_reward,
        "format_reward": format_reward,
        "think_format_reward": think_format_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
    }
    if max_completion_length is not None:
        registry["soft_overlong_punishment"] = get_soft_overlong_punishment(
            max_completion_length, soft_punish_cache=max(1, max_completion_length // 5)
        )
    funcs = [_by_name(name, registry, "reward function") for name in names]
    if not funcs:
        raise RecipeArgumentError("at least one reward function is needed (--reward_funcs)")
    return funcs


def tool_functions(names: list[str]) -> list:
    """The callables for ``--tools``: names in :data:`trl_moe_replay.extras.math.tools.BUILTIN_TOOLS`, or dotted
    import paths."""
    from trl_moe_replay.extras.math.tools import BUILTIN_TOOLS

    return [_by_name(name, BUILTIN_TOOLS, "tool") for name in names]


def is_conversational(script_args) -> bool:
    """Chat-message prompts: as asked, else for Hub datasets and whenever tools are on (TRL renders them with the
    chat template)."""
    if script_args.tools and script_args.conversational is False:
        raise RecipeArgumentError(
            "--tools needs conversational prompts (TRL renders the tools with the chat template); "
            "drop --conversational false"
        )
    if script_args.conversational is not None:
        return script_args.conversational
    return bool(script_args.dataset_name or script_args.tools)


def load_datasets(script_args, training_args):
    """(train, eval or None) with `prompt` and `solution` columns."""
    from trl_moe_replay.extras.math.data import load_math_dataset, synthetic_math_dataset

    conversational = is_conversational(script_args)
    evaluates = training_args.eval_strategy != "no"
    if script_args.eval_dataset_name and not evaluates:
        raise RecipeArgumentError(
            f"--eval_dataset_name {script_args.eval_dataset_name} is evaluated only when TRL evaluates: pass "
            "--eval_strategy steps --eval_steps N (every N steps), or leave out --eval_dataset_name"
        )
    kwargs = dict(
        conversational=conversational, instruction=script_args.instruction, system_prompt=script_args.system_prompt
    )
    settings = dict(
        difficulty=script_args.synthetic_difficulty,
        max_operand=script_args.synthetic_max_operand,
        kinds=tuple(script_args.synthetic_kinds),
        expressions=bool(script_args.tools),  # what the cold start's
        **kwargs,  # calculator demonstrations compute
    )
    if script_args.dataset_name:
        train = load_math_dataset(
            script_args.dataset_name, script_args.dataset_train_split, config=script_args.dataset_config, **kwargs
        )
    else:
        train = synthetic_math_dataset(script_args.synthetic_samples, seed=training_args.seed, **settings)
    if not evaluates:
        return train, None
    if script_args.eval_dataset_name == "synthetic" or not (script_args.eval_dataset_name or script_args.dataset_name):
        evaluation = synthetic_math_dataset(script_args.eval_samples or 256, seed=training_args.seed + 1, **settings)
    elif script_args.eval_dataset_name:
        evaluation = load_math_dataset(
            script_args.eval_dataset_name,
            script_args.eval_dataset_split,
            config=script_args.eval_dataset_config,
            **kwargs,
        )
    else:
        evaluation = load_math_dataset(
            script_args.dataset_name, script_args.dataset_test_split, config=script_args.dataset_config, **kwargs
        )
    if script_args.eval_samples and len(evaluation) > script_args.eval_samples:
        evaluation = evaluation.select(range(script_args.eval_samples))
    return train, evaluation


def tiny_overrides(family: str, hidden: int, layers: int, experts: int, top_k: int) -> dict:
    """Config overrides for `tiny_moe_model(family, ...)`: width, depth and experts, under the family's own names
    for the fields its tiny config sets (num_experts / num_local_experts / n_routed_experts / moe_num_experts, ...).
    Families whose tiny config lists per-layer types keep their 2 layers unless those lists are overridden too."""
    from trl_moe_replay.testing import TINY_CONFIGS

    if family not in TINY_CONFIGS:
        raise RecipeArgumentError(f"no tiny config for {family!r}; one of {sorted(TINY_CONFIGS)}")
    base = TINY_CONFIGS[family]
    overrides = {"hidden_size": hidden, "num_hidden_layers": layers}
    sizes = {"intermediate_size": 2 * hidden, "moe_intermediate_size": hidden, "head_dim": max(8, hidden // 4)}
    overrides.update({k: v for k, v in sizes.items() if k in base})
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if key in base:
            overrides[key] = experts
    for key in ("num_experts_per_tok", "num_experts_per_token", "moe_topk"):
        if key in base:
            overrides[key] = top_k
    return overrides


def cold_started_tiny_model(script_args, training_args, train_dataset) -> str:
    """Path of the tiny MoE after its cold-start SFT (built once per settings, then read from the cache)."""
    from accelerate import PartialState

    from trl_moe_replay.extras.math.cold_start import (
        ColdStartConfig,
        cached_cold_start,
        cold_start_sft,
        default_cache_dir,
        settings_key,
    )
    from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer

    family = script_args.tiny_model_type
    overrides = tiny_overrides(
        family,
        script_args.tiny_hidden_size,
        script_args.tiny_num_layers,
        script_args.tiny_num_experts,
        script_args.tiny_top_k,
    )
    tools = tool_functions(script_args.tools)
    sft = ColdStartConfig(
        steps=script_args.sft_steps,
        learning_rate=script_args.sft_learning_rate,
        batch_size=script_args.sft_batch_size,
        label_noise=script_args.sft_label_noise,
        seed=training_args.seed,
        tool_call_fraction=script_args.sft_tool_call_fraction if tools else 0.0,
    )
    tool_call = demonstration_call(script_args.tools) if sft.tool_call_fraction else None
    data_key = settings_key({column: train_dataset[column] for column in train_dataset.column_names})
    settings = dict(model_type=family, overrides=overrides, sft=asdict(sft), data=data_key, version=1)
    if tools:
        settings["tools"] = script_args.tools

    def build():
        model = tiny_moe_model(family, seed=training_args.seed, **overrides)
        tokenizer = tiny_tokenizer(tools=bool(tools))
        report = (
            cold_start_sft(model, tokenizer, train_dataset, sft, tools=tools, tool_call=tool_call) if sft.steps else {}
        )
        return model, tokenizer, report

    cache_dir = script_args.sft_cache_dir or default_cache_dir()
    state = PartialState()
    with state.main_process_first():  # the main process trains and saves; the others then read the cache
        folder, record = cached_cold_start(
            cache_dir, settings, build, log=state.print if state.is_main_process else (lambda *_: None)
        )
    report = record["report"]
    if report.get("sampled_accuracy") is not None:
        tool_calls = f", tool calls in {report['tool_call_rate']:.0%} of samples" if "tool_call_rate" in report else ""
        state.print(
            f"cold start: {sft.steps} SFT steps, sampled accuracy {report['sampled_accuracy']:.2f} before "
            f"GRPO{tool_calls}"
        )
    return str(folder)


def demonstration_call(tool_names: list[str]):
    """``row -> tool call`` for the cold start's tool demonstrations: the first built-in tool that has one."""
    from trl_moe_replay.extras.math.tools import DEMONSTRATIONS

    for name in tool_names:
        if name in DEMONSTRATIONS:
            return DEMONSTRATIONS[name]
    raise RecipeArgumentError(
        f"the cold start demonstrates only built-in tools ({sorted(DEMONSTRATIONS)}); with --tools "
        f"{' '.join(tool_names)} pass --sft_tool_call_fraction 0 (or add a built-in tool)"
    )


def main(script_args, training_args, model_args):
    """Train and report; returns the trainer. The tiny offline model trains on ``--tiny_num_threads`` torch threads
    (the setting is restored afterwards)."""
    if model_args.model_name_or_path is not None or not script_args.tiny_num_threads:
        return train(script_args, training_args, model_args)
    previous = torch.get_num_threads()
    torch.set_num_threads(script_args.tiny_num_threads)
    try:
        return train(script_args, training_args, model_args)
    finally:
        torch.set_num_threads(previous)


def train(script_args, training_args, model_args):
    from trl_moe_replay.parallel.expert_parallel import distributed_config_from_args

    distributed_config_from_args(training_args)  # expert parallelism: sizes against this launch, before any work
    launched_ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if launched_ranks > 1 and training_args.world_size != launched_ranks:
        raise RuntimeError(
            f"launched as {launched_ranks} processes, but the trainer sees world size {training_args.world_size}: "
            "each process would train alone and overwrite the same output_dir. On a machine without a GPU pass "
            "--use_cpu true (accelerate needs it to set up CPU data parallelism)."
        )
    from accelerate import PartialState

    from trl_moe_replay.core.output_lock import OutputDirLock, claim_output_dir

    state = PartialState()
    # First, before anything is printed or run: a live run's output_dir is refused. The trainer takes this lock over
    # (same process) when it starts training; a run that stops before then releases it.
    created = not os.path.exists(training_args.output_dir)
    lock = OutputDirLock(training_args.output_dir)
    claim_output_dir(lock, state, strict=training_args.routing_replay.replays)  # a ReplayMode once the config is built
    try:
        return _train(script_args, training_args, model_args, state)
    finally:
        lock.release()
        if created and state.is_main_process:  # a run that stopped at once leaves no empty output_dir behind
            with contextlib.suppress(OSError):
                os.rmdir(training_args.output_dir)


def _train(script_args, training_args, model_args, state):
    import transformers
    from packaging.version import Version
    from transformers import ProgressCallback
    from trl import get_peft_config, get_quantization_config

    from trl_moe_replay import MoEReplayGRPOTrainer
    from trl_moe_replay.cli.progress import KEY_METRICS, CompactProgressCallback
    from trl_moe_replay.core.launch import check_model_path

    if model_args.model_name_or_path is not None:  # a mistyped path or an unreachable Hub id: one line, now
        model_args.model_name_or_path = check_model_path(model_args.model_name_or_path, model_args.model_revision)
    resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
    announce_output_dir(training_args, resume)
    plot = script_args.plot and plots_possible(training_args.output_dir, state)  # one line, before training
    train_dataset, eval_dataset = load_datasets(script_args, training_args)
    tools = tool_functions(script_args.tools)
    processing_class = None
    if model_args.model_name_or_path is None:  # offline default: the tiny MoE, cold-started
        from trl_moe_replay.testing import tiny_tokenizer

        model = cold_started_tiny_model(script_args, training_args, train_dataset)
        processing_class = tiny_tokenizer(tools=bool(tools))
        model_init_kwargs = dict(dtype="float32")
    else:
        model = model_args.model_name_or_path
        model_init_kwargs = dict(
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
            attn_implementation=model_args.attn_implementation,
            dtype=model_args.dtype,
        )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    trainer = MoEReplayGRPOTrainer(
        model=model,
        reward_funcs=reward_functions(script_args.reward_funcs, training_args.max_completion_length),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processing_class,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
        tools=tools or None,
    )
    if not training_args.disable_tqdm:
        metrics = {**KEY_METRICS, "tools/call_frequency": "tool_calls"} if tools else KEY_METRICS
        trainer.remove_callback(ProgressCallback)
        print_every = max(10, training_args.logging_steps)
        trainer.add_callback(CompactProgressCallback(print_every=print_every, metrics=metrics))

    interrupt = SaveOnInterrupt()
    trainer.add_callback(interrupt)
    if resume is None:
        trainer.add_callback(StartOver())
    # a save_steps between generation batches is warned by the config's own check (saves_inside_generation_batches)

    try:
        trainer.train(resume_from_checkpoint=resume)
    except server_gone_errors() as error:  # the server went away: a stop of the whole job, or a failure (raised on)
        line = interrupt.engine_gone(error, trainer.state.global_step)
        if line is None:
            raise
        state.print(line)
        return trainer
    if interrupt.interrupted:
        if Version(transformers.__version__) >= Version("5.18.0"):
            trainer.end()
        step, max_steps = trainer.state.global_step, trainer.state.max_steps
        if step >= max_steps:  # the last step: nothing is left to resume (a resume would train no step)
            state.print(
                f"stopped at step {step} of {max_steps}{interrupt.took()}: the run is complete; its final "
                f"weights are in {interrupt.checkpoint} (the final save into {training_args.output_dir} and "
                "the summary were skipped)"
            )
        else:
            state.print(
                f"stopped at step {step} of {max_steps}{interrupt.took()}; checkpoint saved in "
                f"{interrupt.checkpoint}; resume with: {resume_command()}"
            )
        return trainer
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the log history the plots read

    if trainer.accelerator.is_main_process:
        print(reward_summary(trainer.state.log_history))
        if tools:
            print(reward_summary(trainer.state.log_history, key="tools/call_frequency", label="tool calls per sample"))
        if plot:
            from trl_moe_replay.cli.plotting import plot_run

            paths = plot_run(training_args.output_dir)
            print(f"plots: {', '.join(str(p) for p in paths)}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
    return trainer


def plots_possible(output_dir: str, state) -> bool:
    """Whether the plots can be drawn at the end (matplotlib, the `plot` extra). Checked before training, so a finished
    run never ends in a traceback for want of it: without it, one line says the plots are skipped and how to draw
    them from the saved run."""
    from trl_moe_replay.cli.plotting import MatplotlibMissingError, check_matplotlib

    try:
        check_matplotlib()
    except MatplotlibMissingError:
        state.print(
            f"plots: skipped, matplotlib is not installed; to draw them after the run: pip install "
            f'"trl-moe-replay[plot]", then trl-moe-replay plot {shlex.quote(output_dir)}'
        )
        return False
    return True


def announce_output_dir(training_args, resume: str | None) -> None:
    """One line when output_dir holds an earlier run: what this run does with it."""
    if not int(os.environ.get("RANK", "0")) == 0:
        return
    earlier = describe_run(training_args.output_dir)
    if resume is not None:
        print(f"resuming {training_args.output_dir} from {resume}")
    elif earlier is not None:
        again = (
            "" if earlier.startswith("a finished") else f"; to continue it instead, stop and run: {resume_command()}"
        )
        print(
            f"{training_args.output_dir} holds {earlier}: starting over, its checkpoints are deleted when training "
            f"starts{again}"
        )


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that resumes this run: the same launcher, script and arguments, with
    ``--resume_from_checkpoint`` (and no value: the newest checkpoint in output_dir)."""
    argv = list(sys.argv if argv is None else argv)
    args, skip = [], False
    for i, arg in enumerate(argv[1:], 1):
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        elif not arg.startswith("--resume_from_checkpoint="):
            args.append(arg)
    here = os.path.dirname(sys.executable)

    def program(name: str) -> str:
        """``name`` if it runs this environment's copy, else that copy's path (``.venv/bin/accelerate``)."""
        path, on_path = os.path.join(here, name), shutil.which(name)
        if not os.path.exists(path) or (on_path and os.path.samefile(on_path, path)):
            return name
        relative = os.path.relpath(path)
        return path if relative.startswith("..") else relative

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if any(k in os.environ for k in ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION")):
        launcher = [program("accelerate"), "launch"] + (["[your launch options]"] if world_size > 1 else [])
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = [program("torchrun"), "--standalone", "--nproc_per_node", str(world_size)]
    else:
        launcher = [program("python")]
    return " ".join(launcher + [shlex.quote(a) for a in [argv[0], *args, "--resume_from_checkpoint"]])


def reward_summary(log_history: list[dict], window: int = 10, key: str = "reward", label: str = "mean reward") -> str:
    """'mean reward: first N steps X -> last N steps Y' from the training log (or another logged ``key``)."""
    values = [h[key] for h in log_history if key in h and f"eval_{key}" not in h]
    if not values:
        return f"no {key} logged"
    n = max(1, min(window, len(values) // 3 or 1))
    first, last = sum(values[:n]) / n, sum(values[-n:]) / n
    return f"{label}: first {n} logged steps {first:.3f} -> last {n} logged steps {last:.3f}"


def run(argv: list[str] | None = None) -> int:
    """The script: parse, train; a mistake is one line on stderr (exit status 2), Ctrl-C exits with 130, SIGTERM
    with 143 (both after saving a checkpoint)."""
    from trl_moe_replay.checkpointing.checkpoint_files import CheckpointError
    from trl_moe_replay.checkpointing.distributed_checkpoint import DistributedCheckpointError
    from trl_moe_replay.core.launch import LaunchMismatchError, ModelPathError
    from trl_moe_replay.core.output_lock import OutputDirInUseError
    from trl_moe_replay.parallel.expert_parallel import ParallelSizesError, ShardedAtLoadUnsupportedError
    from trl_moe_replay.pr2.state import PR2CheckpointError
    from trl_moe_replay.routing import UnsupportedModelError
    from trl_moe_replay.upstream import quiet_upstream_notices
    from trl_moe_replay.weight_sync.server_requests import ServerModeDependencyError

    quiet_upstream_notices()  # before the cold start, whose save already imports DeepSpeed (where installed)
    user_errors = (
        RecipeArgumentError,
        NoCheckpointError,
        ModelPathError,
        UnsupportedModelError,
        OutputDirInUseError,
        LaunchMismatchError,
        ConfigTypeError,
        ConfigValueError,
        CheckpointError,
        PR2CheckpointError,
        DistributedCheckpointError,
        ShardedAtLoadUnsupportedError,
        ParallelSizesError,
        ServerModeDependencyError,
    )
    prog = os.path.basename(sys.argv[0])
    try:
        trainer = main(*parse_args(argv))
    except user_errors as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C: nothing new saved
        print(f"\n{prog}: interrupted; no checkpoint saved by this interruption", file=sys.stderr)
        return 130
    stopped = [
        cb
        for cb in trainer.callback_handler.callbacks
        if isinstance(cb, SaveOnInterrupt) and (cb.interrupted or cb.engine_lost)
    ]
    return stopped[0].exit_status if stopped else 0  # 130 after Ctrl-C, 143 after SIGTERM, as the shell reports them


if __name__ == "__main__":
    sys.exit(run())
