"""``trl-moe-replay plan CONFIG``: the arithmetic of a recipe config's layout, checked before any GPU is rented.

From the config (its values, TRL's defaults for the rest, and the launch lines of its header) and the model's numbers
(its ``config.json`` from a local folder or the Hub cache, never downloaded; or :data:`KNOWN_MODELS` for the models the
recipes name) it prints the batch arithmetic, the context length, an estimate of the memory of every training GPU
(weights, gradients, master weights, optimizer states and the optimizer step's temporaries under the layout's
sharding, activations at the config's lengths, the vLLM share), what a vLLM server GPU holds, and the route bytes per
rollout batch. A layout whose sizes cannot divide, or whose engine's max model length is below prompt + completion, is
refused in one line (:class:`PlanError`). The method and its margin: docs/recipes.md "Memory plan".

Units: GB = 1e9 bytes. Estimates are meant as upper bounds of the peak for the longest sequences the config allows;
compared with a measured peak once, at a small size (docs/recipes.md "Memory plan"), not at the recipes' sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import TrlMoeReplayError


GB = 1e9
MARGIN = 0.10  # of each GPU's memory, kept free: allocator fragmentation, unmodelled buffers (docs/recipes.md)
FIXED_GB = 3.0  # per training GPU: CUDA context, NCCL buffers, cuBLAS/cuDNN workspaces
DEFAULT_PROMPT_LENGTH = 1024  # TRL has no prompt-length limit; the recipes' math prompts stay well below this
VLLM_SERVER_UTILIZATION = 0.9  # `vllm serve --gpu-memory-utilization` default, where the server line names none
FOREACH_TEMPORARIES = ("torch's foreach AdamW step: _foreach_sqrt(exp_avg_sqs) and the like make one temporary of "
                       "the local trainable shard, in the optimizer states' dtype")
ROOT_OF_RECIPES = Path(__file__).resolve().parents[2]  # a clone's root: recipes/accelerate/*.yaml live there


class PlanError(TrlMoeReplayError, ValueError):
    """A layout whose sizes cannot divide, or a config or model the plan cannot read."""


# ------------------------------------------------------------------------------------------------------ the model
# config.json values of the models the recipes name (read from each repository's config.json on the Hub), so that
# the plan runs without the checkpoint. The model cards' counts, for the check in tests/cli/test_plan.py:
#   Qwen3-30B-A3B: "30.5B in total and 3.3B activated" (huggingface.co/Qwen/Qwen3-30B-A3B);
#   OLMoE-1B-7B: "1B active and 7B total parameters" (6.9B, arXiv 2409.02060 Table 1);
#   Granite-3.1-1B-A400M: "1.3B" total, "400M" active (huggingface.co/ibm-granite/granite-3.1-1b-a400m-instruct);
#   Mixtral-8x7B: "46.7B total parameters but only uses 12.9B parameters per token"
#   (mistral.ai/news/mixtral-of-experts).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=151936, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
        torch_dtype="bfloat16"),
    "allenai/OLMoE-1B-7B-0924-Instruct": dict(
        model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        num_experts=64, num_experts_per_tok=8, intermediate_size=1024, vocab_size=50304, tie_word_embeddings=False,
        torch_dtype="bfloat16"),
    "ibm-granite/granite-3.1-1b-a400m-instruct": dict(
        model_type="granitemoe", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
        num_local_experts=32, num_experts_per_tok=8, intermediate_size=512, vocab_size=49155, tie_word_embeddings=True,
        torch_dtype="bfloat16"),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": dict(
        model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336, vocab_size=32000,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
}
CARD_PARAMETERS = {  # (total, active) as the model cards round them
    "Qwen/Qwen3-30B-A3B": (30.5e9, 3.3e9),
    "allenai/OLMoE-1B-7B-0924-Instruct": (6.9e9, 1.3e9),
    "ibm-granite/granite-3.1-1b-a400m-instruct": (1.3e9, 0.4e9),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (46.7e9, 12.9e9),
}


@dataclasses.dataclass(frozen=True)
class ModelNumbers:
    """What the arithmetic needs of a MoE model, from its ``config.json`` values."""

    name: str
    source: str
    hidden: int
    layers: int
    moe_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int
    vocab: int
    params_total: int
    params_active: int
    layer_params: int  # the largest decoder layer's parameters
    layer_expert_params: int  # of which in its experts
    dtype: str  # the checkpoint's

    @classmethod
    def from_config(cls, values: Mapping[str, Any], name: str, source: str) -> ModelNumbers:
        """Counts parameters from the config's sizes: attention (q, k, v, o and q/k norms), router, experts (gate, up,
        down each), shared expert, dense MLP layers, norms, embeddings and an untied LM head (tested against the
        models transformers builds)."""
        values = dict(values.get("text_config") or values) if "num_hidden_layers" not in values else dict(values)
        try:
            h, layers, heads = values["hidden_size"], values["num_hidden_layers"], values["num_attention_heads"]
            kv = values.get("num_key_value_heads") or heads
            d = values.get("head_dim") or h // heads
            experts = values.get("num_experts") or values.get("num_local_experts") or values["n_routed_experts"]
            top_k, vocab = values["num_experts_per_tok"], values["vocab_size"]
            inter = values.get("moe_intermediate_size") or values["intermediate_size"]
        except KeyError as exc:
            raise PlanError(f"{source} has no {exc.args[0]}: the plan needs a MoE config.json (hidden_size, "
                            "num_hidden_layers, num_attention_heads, num_experts, num_experts_per_tok, vocab_size, "
                            "intermediate_size)") from None
        sparse_step = values.get("decoder_sparse_step") or 1
        dense = set(values.get("mlp_only_layers") or [])
        moe = [i for i in range(layers) if i not in dense and (i + 1) % sparse_step == 0]
        attention = h * heads * d + 2 * h * kv * d + heads * d * h
        if values.get("attention_bias"):
            attention += heads * d + 2 * kv * d + h
        qk_norm = {"qwen3_moe": 2 * d, "olmoe": (heads + kv) * d}.get(values.get("model_type", ""), 0)
        one_expert = 3 * h * inter
        shared = values.get("shared_expert_intermediate_size") or 0
        shared_params = 3 * h * shared + h if shared else 0
        moe_layer = attention + qk_norm + h * experts + experts * one_expert + shared_params + 2 * h
        dense_layer = attention + qk_norm + 3 * h * (values.get("intermediate_size") or inter) + 2 * h
        embeddings = vocab * h * (1 if values.get("tie_word_embeddings") else 2)
        total = len(moe) * moe_layer + (layers - len(moe)) * dense_layer + embeddings + h
        active = total - len(moe) * (experts - top_k) * one_expert
        return cls(name=name, source=source, hidden=h, layers=layers, moe_layers=len(moe), heads=heads, kv_heads=kv,
                   head_dim=d, experts=experts, top_k=top_k, expert_intermediate=inter, vocab=vocab,
                   params_total=total, params_active=active,
                   layer_params=max(moe_layer if moe else 0, dense_layer if dense else 0),
                   layer_expert_params=experts * one_expert,
                   dtype=str(values.get("dtype") or values.get("torch_dtype") or "bfloat16"))


def _hub_cache_config(name: str) -> Path | None:
    """``config.json`` of ``name`` in the Hugging Face Hub cache, without any network access."""
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" /
                                                                      "huggingface")) / "hub")
    snapshots = hub / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None


def model_numbers(name: str) -> ModelNumbers:
    """The numbers of ``name``: a local folder's ``config.json``, else the Hub cache's, else :data:`KNOWN_MODELS`;
    never a download."""
    local = Path(name) / "config.json"
    path = local if local.is_file() else _hub_cache_config(name)
    if path is not None:
        return ModelNumbers.from_config(json.loads(path.read_text()), name, str(path))
    if name in KNOWN_MODELS:
        return ModelNumbers.from_config(KNOWN_MODELS[name], name, "the plan's table (trl_moe_replay/cli/plan.py)")
    raise PlanError(f"no config.json for {name!r}: not a local folder, not in the Hub cache, not in the plan's "
                    f"table ({', '.join(KNOWN_MODELS)}); download it once (huggingface-cli download {name} "
                    "config.json) or pass a local folder")


# ------------------------------------------------------------------------------------------------------ the layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a config runs: training processes and their sharding, vLLM's GPUs, the machine-readable plan line."""

    sharding: str  # single, ddp, zero2, zero3, fsdp2, ep
    processes: int
    offload_optimizer: bool = False
    offload_params: bool = False
    vllm_gpus: int = 0
    vllm_tp: int = 1
    vllm_max_model_len: int | None = None  # the server line's --max-model-len
    vllm_utilization: float = VLLM_SERVER_UTILIZATION  # the server line's --gpu-memory-utilization
    shard: int = 1  # ranks each training tensor is split over (ep: fsdp_size x tp_size)
    ep_size: int = 1
    gpus: int | None = None  # from the header's `# plan:` line
    gpu_memory: float | None = None
    prompt_length: int | None = None


PLAN_LINE = re.compile(r"^# plan: (.*)$", re.MULTILINE)


def header_of(text: str) -> str:
    """The leading comment lines of a config file."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "\n".join(lines[:end])


def _commands(header: str) -> list[str]:
    """The shell commands written in a header's comments, continuation lines joined."""
    commands, current = [], ""
    for line in header.splitlines():
        body = line.lstrip("#").strip()
        body = re.sub(r"^(\d\)|or:|or,? with accelerate:)\s*", "", body)
        current = f"{current} {body}" if current else body
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        if re.search(r"\b(accelerate launch|torchrun|trl vllm-serve|vllm serve)\b", current):
            starts = ("CUDA_VISIBLE_DEVICES", "accelerate", "torchrun", "trl vllm-serve", "vllm serve")
            commands.append(current[current.find(next(w for w in starts if w in current)):])
        current = ""
    return commands


def _flag(words: list[str], name: str) -> str | None:
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def layout_from_header(text: str, values: Mapping[str, Any], root: Path = ROOT_OF_RECIPES) -> Layout:
    """The layout the header's launch lines start, and its ``# plan:`` line."""
    header = header_of(text)
    commands = _commands(header)
    train = next((c for c in commands if "accelerate launch" in c or "torchrun" in c), None)
    sizes = _parallel_sizes(values)
    fields: dict[str, Any] = {}
    if train is None:
        fields.update(sharding="single", processes=1)
    else:
        words = shlex.split(train)
        config_file = _flag(words, "--config_file")
        accelerate = {}
        if config_file:
            import yaml

            path = root / config_file
            if not path.is_file():
                raise PlanError(f"the launch line names {config_file}, which is not in {root}")
            accelerate = yaml.safe_load(path.read_text())
        if "torchrun" in words:
            processes = int(_flag(words, "--nproc_per_node") or 1) * int(_flag(words, "--nnodes") or 1)
        else:
            processes = int(_flag(words, "--num_processes") or accelerate.get("num_processes", 1))
        kind = accelerate.get("distributed_type", "MULTI_GPU" if processes > 1 else "NO")
        deepspeed = accelerate.get("deepspeed_config") or {}
        fsdp = accelerate.get("fsdp_config") or {}
        sharding = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp2",
                    "DEEPSPEED": f"zero{deepspeed.get('zero_stage', 2)}"}.get(kind, "ddp")
        optimizer_device = _flag(words, "--offload_optimizer_device") or deepspeed.get("offload_optimizer_device")
        param_device = _flag(words, "--offload_param_device") or deepspeed.get("offload_param_device")
        fsdp_offload = str(_flag(words, "--fsdp_offload_params") or fsdp.get("fsdp_offload_params")).lower() == "true"
        fields.update(sharding=sharding, processes=processes,
                      offload_optimizer=optimizer_device == "cpu" or fsdp_offload,
                      offload_params=param_device == "cpu" or fsdp_offload)
        if sharding == "single" and processes > 1:
            fields["sharding"] = "ddp"
    if sizes:  # transformers shards the model at load time: accelerate only starts the processes
        fields.update(sharding="ep", shard=sizes.get("fsdp_size", 1) * sizes.get("tp_size", 1),
                      ep_size=sizes.get("ep_size", 1), offload_optimizer=False, offload_params=False)
    elif fields["sharding"] in ("zero3", "fsdp2"):
        fields["shard"] = fields["processes"]
    server = next((c for c in commands if "vllm-serve" in c or "vllm serve" in c), None)
    if server is not None:
        words = shlex.split(server)
        visible = next((w.split("=", 1)[1] for w in words if w.startswith("CUDA_VISIBLE_DEVICES=")), None)
        tp = int(_flag(words, "--tensor-parallel-size") or 1)
        dp = int(_flag(words, "--data-parallel-size") or 1)
        fields.update(vllm_gpus=len(visible.split(",")) if visible else tp * dp, vllm_tp=tp)
        max_len, util = _flag(words, "--max-model-len"), _flag(words, "--gpu-memory-utilization")
        if max_len:
            fields["vllm_max_model_len"] = int(max_len)
        if util:
            fields["vllm_utilization"] = float(util)
    plan = PLAN_LINE.search(header)
    if plan is not None:
        words = shlex.split(plan.group(1))
        gpus, memory, prompt = (_flag(words, f) for f in ("--gpus", "--gpu-memory", "--prompt-length"))
        fields.update(gpus=int(gpus) if gpus else None, gpu_memory=float(memory) if memory else None,
                      prompt_length=int(prompt) if prompt else None)
    return Layout(**fields)


def _parallel_sizes(values: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's ``ep_size``/``fsdp_size``/... keys over ``model_init_kwargs.distributed_config``."""
    sizes = dict((values.get("model_init_kwargs") or {}).get("distributed_config") or {})
    sizes.update({k: values[k] for k in ("ep_size", "fsdp_size", "tp_size", "dp_replicate_size", "ep_implementation")
                  if values.get(k) is not None})
    return sizes


# ---------------------------------------------------------------------------------------------------- the config
@functools.cache
def _defaults() -> dict[str, Any]:
    """TRL's (and this package's) defaults for what a config leaves out, read from the config classes."""
    from trl import ModelConfig

    from ..trainer.grpo_config import MoEReplayGRPOConfig

    defaults = {}
    for cls in (ModelConfig, MoEReplayGRPOConfig):
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                defaults[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                defaults[field.name] = field.default_factory()
    return defaults


def check_batch(values: Mapping[str, Any], processes: int) -> dict[str, int]:
    """The batch arithmetic with ``processes`` training processes, or :class:`PlanError` where TRL's
    ``GRPOConfig.__post_init__`` would refuse it (its rules with ``world_size = processes``)."""
    b, ga, g = values["per_device_train_batch_size"], values["gradient_accumulation_steps"], values["num_generations"]
    spg = values.get("steps_per_generation") or ga
    if values.get("generation_batch_size"):
        if values["generation_batch_size"] % (b * processes):
            raise PlanError(f"generation_batch_size {values['generation_batch_size']} is not a multiple of "
                            f"per_device_train_batch_size {b} x {processes} processes: TRL refuses it")
        spg = values["generation_batch_size"] // (b * processes)
    rollout = b * processes * spg
    if rollout % g:
        raise PlanError(f"a rollout batch of {b} per device x {processes} processes x {spg} steps_per_generation = "
                        f"{rollout} completions is not a multiple of num_generations {g}: TRL refuses it (whole "
                        "prompt groups only); change per_device_train_batch_size or steps_per_generation")
    eval_on = values.get("eval_strategy", "no") != "no"  # TRL checks whenever evaluation is on (do_eval follows it)
    eval_g = values.get("num_generations_eval") or g
    if eval_on and values["per_device_eval_batch_size"] * processes % eval_g:
        raise PlanError(f"per_device_eval_batch_size {values['per_device_eval_batch_size']} x {processes} processes "
                        f"is not a multiple of {eval_g} generations for evaluation: TRL refuses it")
    return dict(per_device=b, accumulation=ga, steps_per_generation=spg, update=b * processes * ga, rollout=rollout,
                num_generations=g)


def check_sizes(model: ModelNumbers, layout: Layout, values: Mapping[str, Any]) -> None:
    """Expert parallelism's sizes against the processes and the experts (transformers' own checks through
    :func:`trl_moe_replay.parallel.expert_parallel.distributed_config_from_args`), in one line."""
    from types import SimpleNamespace

    from ..parallel.expert_parallel import ParallelSizesError, distributed_config_from_args

    if layout.sharding != "ep":
        return
    sizes = _parallel_sizes(values)
    try:
        distributed_config_from_args(SimpleNamespace(model_init_kwargs={"distributed_config": sizes}),
                                     world_size=layout.processes, gpus=True)
    except ParallelSizesError as exc:
        raise PlanError(str(exc)) from None
    if model.experts % layout.ep_size:
        raise PlanError(f"ep_size {layout.ep_size} does not divide {model.name}'s {model.experts} experts: each rank "
                        f"holds num_experts / ep_size of them; use an ep_size that divides both {model.experts} and "
                        "fsdp_size x tp_size")


# ---------------------------------------------------------------------------------------------------- the estimate
@dataclasses.dataclass
class Plan:
    model: ModelNumbers
    layout: Layout
    batch: dict[str, int]
    prompt_length: int
    completion_length: int
    gpu_memory: float
    train_lines: list[tuple[str, float, str]]  # (what, GB, how)
    budget: float  # GB a training GPU may use
    cpu_gb: float  # offloaded state, per node of training processes (all ranks)
    vllm_lines: list[str]
    route_lines: list[str]

    @property
    def train_total(self) -> float:
        return sum(gb for _, gb, _ in self.train_lines)

    @property
    def fits(self) -> bool:
        return self.train_total <= self.budget and all("does not fit" not in line for line in self.vllm_lines)


def _lora_params(model: ModelNumbers, values: Mapping[str, Any]) -> int:
    r = values.get("lora_r") or 16
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    targets = values.get("lora_target_modules") or ["q_proj", "v_proj"]
    unknown = [t for t in targets if t not in sizes]
    if unknown or values.get("lora_target_parameters"):
        raise PlanError(f"the plan counts LoRA adapters on attention projections only ({', '.join(sizes)}); this "
                        f"config also targets {unknown or values.get('lora_target_parameters')}")
    return model.layers * r * sum(sizes[t] for t in targets)


def estimate(config: str | Path, gpus: int | None = None, gpu_memory: float | None = None,
             prompt_length: int | None = None) -> Plan:
    """The plan of a recipe config file (see the module's docstring); ``gpus``/``gpu_memory``/``prompt_length``
    default to its ``# plan:`` line."""
    import yaml

    path = Path(config)
    if not path.is_file():
        raise PlanError(f"{config} is not a file: pass a recipe config (recipes/configs/*.yaml)")
    text = path.read_text()
    values = {**_defaults(), **(yaml.safe_load(text) or {})}
    if not values.get("model_name_or_path"):
        raise PlanError(f"{path.name} names no model (the offline tiny MoE): nothing to plan on GPUs")
    layout = layout_from_header(text, values)
    gpus = gpus or layout.gpus
    gpu_memory = gpu_memory or layout.gpu_memory
    if not gpus or not gpu_memory:
        raise PlanError(f"{path.name}: say the GPUs, --gpus N --gpu-memory GB (or a `# plan: --gpus N --gpu-memory GB`"
                        " line in its header)")
    model = model_numbers(values["model_name_or_path"])
    check_sizes(model, layout, values)
    batch = check_batch(values, layout.processes)
    colocate = bool(values.get("use_vllm")) and values.get("vllm_mode") == "colocate"
    used = layout.processes + (0 if colocate else layout.vllm_gpus)
    if used > gpus:
        raise PlanError(f"the layout uses {used} GPUs ({layout.processes} training processes + {layout.vllm_gpus} "
                        f"for vLLM), more than the {gpus} given")
    if values.get("use_vllm") and not colocate and layout.vllm_gpus == 0:
        raise PlanError(f"{path.name} generates on a vLLM server but its header has no `trl vllm-serve` line with "
                        "CUDA_VISIBLE_DEVICES: say which GPUs serve")
    p = prompt_length or layout.prompt_length or DEFAULT_PROMPT_LENGTH
    c = values["max_completion_length"]
    s = p + c
    n, shard = layout.processes, layout.shard
    max_len = (values.get("vllm_max_model_length") if colocate else layout.vllm_max_model_len) \
        if values.get("use_vllm") else None
    if max_len is not None and max_len < s:
        what = "vllm_max_model_length" if colocate else "the vllm-serve line's --max-model-len"
        raise PlanError(f"{path.name}: {what} {max_len} is below prompt {p} + completion {c} = {s} tokens: vLLM would "
                        f"refuse or cut such sequences; raise it to {s} or lower max_completion_length or "
                        "--prompt-length")

    # ---- training state
    lines: list[tuple[str, float, str]] = []
    P = model.params_total
    peft = bool(values.get("use_peft"))
    T = _lora_params(model, values) if peft else P
    loaded = values.get("dtype") or model.dtype
    w = 4 if loaded in ("float32", "torch.float32") else 2
    bf16 = bool(values.get("bf16"))
    where = "" if shard == 1 else f" / {shard}"
    sharding = layout.sharding
    cpu = 0.0
    if sharding in ("zero2", "zero3"):  # DeepSpeed casts the model to bf16 and keeps fp32 masters in its optimizer
        weights = 2 * (P - T if peft else P) + (4 * T if peft else 0)
        w_shard = n if sharding == "zero3" else 1
        opt = (4 + 8) * T  # fp32 masters + Adam m, v
        grads = (4 if peft else 2) * T
        if layout.offload_params and sharding == "zero3":
            cpu += weights
            lines.append(("weights", 0.0, "offloaded to CPU (offload_param_device cpu)"))
        else:
            lines.append(("weights", weights / w_shard / GB, f"bf16{' (adapters fp32)' * peft}"
                          + (f" / {n}" if w_shard > 1 else ", whole on each GPU")))
        lines.append(("gradients", grads / n / GB, f"{'fp32 adapters' if peft else 'bf16'} / {n}"))
        if layout.offload_optimizer:
            cpu += opt + 4 * T  # DeepSpeedCPUAdam's fp32 gradient partition too
            lines.append(("masters + Adam m, v", 0.0, f"offloaded to CPU: {opt / GB:.0f} GB + fp32 grads"))
        else:
            lines.append(("masters + Adam m, v", opt / n / GB, f"fp32, 12 bytes/param / {n}"))
            # DeepSpeed steps the Trainer's torch AdamW on its fp32 partition
            lines.append(("optimizer-step temporaries", 4 * T / n / GB, f"4 bytes/param / {n}: {FOREACH_TEMPORARIES}"))
        a_bytes, gathered = 2, (2 * 2 * model.layer_params if sharding == "zero3" else 0)
    elif sharding == "fsdp2":  # accelerate upcasts trainable parameters to fp32; MixedPrecisionPolicy computes in bf16
        base = (P - T) * w if peft else 0  # a frozen base stays in its loaded dtype
        if layout.offload_params:
            cpu += base + 16 * T
            lines.append(("weights + grads + Adam", 0.0, "offloaded to CPU (fsdp_offload_params: CPUOffloadPolicy)"))
        else:
            lines.append(("weights", (4 * T + base) / n / GB, f"fp32 (the masters) / {n}"))
            lines.append(("gradients", 4 * T / n / GB, f"fp32 / {n}"))
            lines.append(("Adam m, v", 8 * T / n / GB, f"fp32 / {n}"))
            lines.append(("optimizer-step temporaries", 4 * T / n / GB, f"4 bytes/param / {n}: {FOREACH_TEMPORARIES}"))
        a_bytes, gathered = (2 if bf16 else 4), 2 * (2 if bf16 else 4) * model.layer_params
    else:  # single, ddp, ep: the parameters are the masters, in the loaded dtype (LoRA adapters: fp32)
        t_bytes = 4 if peft else w
        lines.append(("weights", ((P - T) * w + T * t_bytes if peft else P * w) / shard / GB,
                      f"{'fp32' if w == 4 else 'bf16'}{where or ', whole on each GPU'}"))
        lines.append(("gradients", T * t_bytes / shard / GB, f"{'fp32' if t_bytes == 4 else 'bf16'}{where}"))
        lines.append(("Adam m, v", 2 * T * t_bytes / shard / GB, f"2 x {t_bytes} bytes/param{where}"))
        lines.append(("optimizer-step temporaries", T * t_bytes / shard / GB,
                      f"{t_bytes} bytes/param{where}: {FOREACH_TEMPORARIES}"))
        if sharding == "ddp":
            lines.append(("DDP gradient buckets", T * t_bytes / GB, "a second copy of the gradients (accelerate's "
                          "DDP: gradient_as_bucket_view off)"))
        a_bytes = 4 if w == 4 else 2
        gathered = 2 * 4 * (model.layer_params - model.layer_expert_params) if sharding == "ep" else 0
        if bf16 and w == 4:
            lines.append(("bf16 autocast copies", 2 * (P - T if peft else P) / shard / GB + 0,
                          f"autocast keeps the bf16 casts of the weights for the forward{where}"))
    if gathered:
        lines.append(("gathered layers", gathered / GB, "2 decoder layers unsharded (the current and the prefetched)"))
    # ---- activations of one micro-batch (b sequences of s tokens, c of them completion)
    b = batch["per_device"]
    h, k, i = model.hidden, model.top_k, model.expert_intermediate
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    layer_bytes = 2 * (2 * h + q + 2 * kv + q + h + k * (h + 3 * i + h)) + 4 * model.experts  # per token, one layer
    if values.get("gradient_checkpointing"):
        lines.append(("checkpointed layer inputs", b * s * model.layers * h * a_bytes / GB,
                      f"{b} x {s} tokens x {model.layers} layers x hidden {h} x {a_bytes} bytes"))
        lines.append(("one layer's activations", 2 * b * s * layer_bytes / GB,
                      f"recomputed in the backward, x2 for their gradients ({layer_bytes} bytes/token)"))
    else:
        lines.append(("activations", (model.layers + 1) * b * s * layer_bytes / GB,
                      f"every layer kept ({layer_bytes} bytes/token/layer), no gradient checkpointing"))
    lines.append(("logits", 8 * b * c * model.vocab / GB,
                  f"{b} x {c} completion tokens x vocab {model.vocab} x 8 bytes (4 bf16 copies: logits, scaled, "
                  "log-softmax, gradient)"))
    route_bytes = 1 if model.experts <= 256 else 2
    routes_rank = batch["rollout"] / n * s * model.moe_layers * k * route_bytes
    from ..core.routing_options import ReplayMode

    if ReplayMode.parse(values["routing_replay"]).replays:  # the config's value, or the declared default
        lines.append(("routes of the rollout batch", routes_rank / GB,
                      f"this rank's {batch['rollout'] // n} completions x {s} x {model.moe_layers} x {k}"))
    lines.append(("CUDA context, NCCL, workspaces", FIXED_GB, "fixed"))

    # ---- vLLM
    vllm: list[str] = []
    engine = 2 * P  # bf16 weights
    kv_token = 2 * model.layers * kv * 2  # bytes per token: K and V, bf16
    if colocate:
        util = values.get("vllm_gpu_memory_utilization") or 0.3
        tp = values.get("vllm_tensor_parallel_size") or 1
        share = util * gpu_memory
        free = share - engine / tp / GB - 1.0
        vllm.append(f"vLLM colocated on every training GPU: vllm_gpu_memory_utilization {util} = {share:.1f} GB "
                    f"(bf16 weights {engine / tp / GB:.1f} GB{f' / tp {tp}' if tp > 1 else ''}, ~1 GB of buffers, KV "
                    f"cache {max(free, 0):.1f} GB = {max(free, 0) * GB / (kv_token / tp):,.0f} tokens, "
                    f"{max(free, 0) * GB / (kv_token / tp) / s:.1f} sequences of {s})"
                    + ("" if free * GB >= s * kv_token / tp else ": does not fit one sequence"))
        budget = (1 - util - MARGIN) * gpu_memory
    else:
        budget = (1 - MARGIN) * gpu_memory
        if layout.vllm_gpus:
            tp = layout.vllm_tp
            replicas = layout.vllm_gpus // tp
            util = layout.vllm_utilization
            free = util * gpu_memory - engine / tp / GB - 2.0
            tokens = max(free, 0) * GB / (kv_token / tp) * replicas
            vllm.append(f"vLLM server on {layout.vllm_gpus} GPUs ({replicas} x tensor parallel {tp}): bf16 weights "
                        f"{engine / tp / GB:.1f} GB per GPU, ~2 GB buffers and CUDA graphs, KV cache "
                        f"{max(free, 0):.1f} GB per GPU at --gpu-memory-utilization {util:g} = "
                        f"{tokens:,.0f} tokens, {tokens / s:.0f} sequences of {s} at once"
                        + ("" if free * GB >= s * kv_token / tp else ": does not fit one sequence"))
    # ---- routes on the wire
    per_completion = (s - 1) * model.moe_layers * k * route_bytes
    raw = batch["rollout"] * per_completion
    routes = [f"routes per rollout batch: {batch['rollout']} completions x {s - 1} tokens x {model.moe_layers} MoE "
              f"layers x top-{k} x {route_bytes} byte{'s' * (route_bytes > 1)} "
              f"({'uint8' if route_bytes == 1 else 'int16'}: {model.experts} experts) = {raw / GB:.2f} GB raw, "
              f"{raw * 4 / 3 / GB:.2f} GB as base64 on the wire (x4/3), {raw / n / GB:.2f} GB raw per training rank"]
    return Plan(model=model, layout=layout, batch=batch, prompt_length=p, completion_length=c, gpu_memory=gpu_memory,
                train_lines=lines, budget=budget, cpu_gb=cpu / GB, vllm_lines=vllm, route_lines=routes)


_NAMES = {"single": "one process", "ddp": "DDP", "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3",
          "fsdp2": "FSDP2", "ep": "expert parallelism (DistributedConfig)"}


def format_plan(plan: Plan, config: str) -> str:
    m, lay, bt = plan.model, plan.layout, plan.batch
    offload = [what for what, on in (("optimizer", lay.offload_optimizer), ("parameters", lay.offload_params)) if on]
    g = bt["num_generations"]
    out = [
        f"plan of {config}: {m.name} ({m.source}): {m.params_total / 1e9:.2f}B parameters, "
        f"{m.params_active / 1e9:.2f}B active; {m.layers} layers ({m.moe_layers} MoE), {m.experts} experts, top-{m.top_k}, hidden {m.hidden}, "
        f"vocab {m.vocab}",
        f"GPUs: {lay.processes} training ({_NAMES[lay.sharding]}"
        + (f", ep_size {lay.ep_size}, sharded over {lay.shard}" if lay.sharding == "ep" else "")
        + (f", {' and '.join(offload)} offloaded to CPU" if offload else "") + ")"
        + (f" + {lay.vllm_gpus} vLLM server" if lay.vllm_gpus else "") + f", {plan.gpu_memory:g} GB each",
        f"batch: {bt['per_device']} per device x {lay.processes} processes x {bt['accumulation']} accumulation = "
        f"{bt['update']} completions per optimizer update ({bt['update'] / g:g} prompts x {g}); rollout batch "
        f"{bt['per_device']} x {lay.processes} x {bt['steps_per_generation']} steps_per_generation = {bt['rollout']} "
        f"completions ({bt['rollout'] // g} prompts x {g}), {bt['steps_per_generation'] / bt['accumulation']:g} "
        "updates per rollout batch",
        f"context: prompt <= {plan.prompt_length} + completion <= {plan.completion_length} = "
        f"{plan.prompt_length + plan.completion_length} tokens per sequence",
        "per training GPU (GB):",
    ]
    out += [f"  {what:<32}{gb:7.1f}  {how}" for what, gb, how in plan.train_lines]
    verdict = "fits" if plan.train_total <= plan.budget else "does not fit"
    colocated = " and the vLLM share" if "colocated" in " ".join(plan.vllm_lines) else ""
    out.append(f"  {'total':<32}{plan.train_total:7.1f}  of a budget of {plan.budget:.1f} GB "
               f"({plan.gpu_memory:g} GB less {MARGIN:.0%} margin{colocated}): {verdict}")
    if plan.cpu_gb:
        out.append(f"CPU memory for the offloaded state: {plan.cpu_gb:.0f} GB on the training node (all ranks)")
    out += plan.vllm_lines + plan.route_lines
    out.append("verdict: " + ("fits" if plan.fits else "does NOT fit") + " (an estimate; measured against a GPU's "
               "peak only at a small size: docs/recipes.md, Memory plan)")
    return "\n".join(out)


def run_plan(config: str, gpus: int | None = None, gpu_memory: float | None = None,
             prompt_length: int | None = None) -> tuple[str, bool]:
    plan = estimate(config, gpus, gpu_memory, prompt_length)
    return format_plan(plan, config), plan.fits
