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
import math
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
DISK_GB_PER_S = 1.0  # the checkpoint write speed the preemption figures assume (docs/recipes.md, "Preemption grace")
VLLM_BUFFERS_GB = 1.0  # a colocated engine's buffers beside its weights and KV cache (kept while it sleeps)
# the training lines that stay on the GPU while a colocated engine generates (sleep mode): what outlives a step
RESIDENT_WHILE_GENERATING = (
    "weights",
    "masters + Adam m, v",
    "Adam m, v",
    "DDP gradient buckets",
    "reference model (beta > 0)",
    "CUDA context, NCCL, workspaces",
)
DEFAULT_PROMPT_LENGTH = 1024  # TRL has no prompt-length limit; the recipes' math prompts stay well below this
VLLM_SERVER_UTILIZATION = 0.9  # `vllm serve --gpu-memory-utilization` default, where the server line names none
FOREACH_TEMPORARIES = (
    "torch's foreach AdamW step: _foreach_sqrt(exp_avg_sqs) and the like make one temporary of "
    "the local trainable shard, in the optimizer states' dtype"
)
MAX_CONFIG_BYTES = 2**20  # a recipe config or accelerate file (the shipped ones are under 10 kB)
MAX_MODEL_CONFIG_BYTES = 16 * 2**20  # a model's config.json (tens of kB with a label table)
MAX_MODEL_CONFIG_VALUES = 2**20
ROOT_OF_RECIPES = Path(__file__).resolve().parents[2]  # a clone's root: recipes/accelerate/*.yaml live there


def kv_bytes_per_token(model: ModelNumbers, tp: int) -> int:
    """KV-cache bytes per token on one GPU of a vLLM engine of tensor parallel ``tp`` (K and V, bf16, every layer):
    vLLM splits the KV heads over the GPUs and, where ``tp`` exceeds them, keeps one whole head per GPU (replicated),
    so the bytes stop falling at ``tp = kv_heads`` (Qwen3-30B-A3B: 4 KV heads; at TP 8, 1 head per GPU: 2 x 48 x 1 x
    128 x 2 = 24,576 bytes)."""
    return 2 * model.layers * max(1, model.kv_heads // tp) * model.head_dim * 2


def _optimizer_temporaries(optim: str) -> bool:
    """Whether the optimizer step makes a full temporary of the trainable shard on the GPU: torch's foreach AdamW
    (``adamw_torch``) does; the fused kernel (``adamw_torch_fused``, transformers' default on torch >= 2.8) steps in
    place. Other optimizers keep other states: the plan does not model them, and says so in one line."""
    if optim not in ("adamw_torch", "adamw_torch_fused"):
        raise PlanError(
            f"the config's optim is {optim!r}: the plan models torch's AdamW only (adamw_torch_fused, the "
            "default, or adamw_torch); plan with one of them and count the optimizer's states yourself"
        )
    return optim == "adamw_torch"


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
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        torch_dtype="bfloat16",
    ),
    "allenai/OLMoE-1B-7B-0924-Instruct": dict(
        model_type="olmoe",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        intermediate_size=1024,
        vocab_size=50304,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "ibm-granite/granite-3.1-1b-a400m-instruct": dict(
        model_type="granitemoe",
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_local_experts=32,
        num_experts_per_tok=8,
        intermediate_size=512,
        vocab_size=49155,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": dict(
        model_type="mixtral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=14336,
        vocab_size=32000,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
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
    model_type: str = ""
    # the parameters by part (PARTS), all layers together: what a tensor-parallel plan may shard, part by part
    parts: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_config(cls, values: Any, name: str, source: str) -> ModelNumbers:
        """Counts parameters from the config's sizes: attention (q, k, v, o and q/k norms), router, experts (gate, up,
        down each), shared expert, dense MLP layers, norms, embeddings and an untied LM head (tested against the
        models transformers builds). Every value it reads is checked first (type, sign, non-zero), one line each."""
        values = _model_sizes(values, source)
        h, layers, heads = values["hidden_size"], values["num_hidden_layers"], values["num_attention_heads"]
        kv, d, experts, top_k = (
            values["num_key_value_heads"],
            values["head_dim"],
            values["experts"],
            values["num_experts_per_tok"],
        )
        vocab, inter = values["vocab_size"], values["expert_intermediate"]
        sparse_step = values["decoder_sparse_step"]
        dense = set(values["mlp_only_layers"])
        moe = [i for i in range(layers) if i not in dense and (i + 1) % sparse_step == 0]
        attention = h * heads * d + 2 * h * kv * d + heads * d * h
        if values["attention_bias"]:
            attention += heads * d + 2 * kv * d + h
        qk_norm = {"qwen3_moe": 2 * d, "olmoe": (heads + kv) * d}.get(values["model_type"], 0)
        one_expert = 3 * h * inter
        shared = values["shared_expert_intermediate_size"]
        shared_params = 3 * h * shared + h if shared else 0
        moe_layer = attention + qk_norm + h * experts + experts * one_expert + shared_params + 2 * h
        dense_layer = attention + qk_norm + 3 * h * values["dense_intermediate"] + 2 * h
        embeddings = vocab * h * (1 if values["tie_word_embeddings"] else 2)
        total = len(moe) * moe_layer + (layers - len(moe)) * dense_layer + embeddings + h
        active = total - len(moe) * (experts - top_k) * one_expert
        parts = {
            "attention": layers * (attention - (h if values["attention_bias"] else 0)),
            "experts": len(moe) * experts * one_expert,
            "shared_expert": len(moe) * 3 * h * shared,
            "dense_mlp": (layers - len(moe)) * 3 * h * values["dense_intermediate"],
            "embed_tokens": vocab * h,
            "lm_head": 0 if values["tie_word_embeddings"] else vocab * h,
        }
        parts["other"] = total - sum(parts.values())  # norms, routers, q/k norms, biases, shared-expert gates
        return cls(
            name=name,
            source=source,
            hidden=h,
            layers=layers,
            moe_layers=len(moe),
            heads=heads,
            kv_heads=kv,
            head_dim=d,
            experts=experts,
            top_k=top_k,
            expert_intermediate=inter,
            vocab=vocab,
            params_total=total,
            params_active=active,
            layer_params=max(moe_layer if moe else 0, dense_layer if dense else 0),
            layer_expert_params=experts * one_expert,
            dtype=values["dtype"],
            model_type=values["model_type"],
            parts=tuple(parts.items()),
        )


MAX_SIZE = 2**31 - 1  # the largest size a config.json or recipe value may give (torch's int32 index range)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def checked_int(value: Any, name: str, where: str, minimum: int = 1) -> int:
    """``value`` if it is an integer in [``minimum``, :data:`MAX_SIZE`] (not a bool), else :class:`PlanError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_SIZE:
        raise PlanError(
            f"{where}: {name} must be an integer from {minimum} to {MAX_SIZE:,}, got {_shown(value)}; fix the value"
        )
    return value


def checked_number(value: Any, name: str, where: str, low: float = 0.0, high: float = math.inf) -> float:
    """``value`` if it is a finite number in (``low``, ``high``] (not a bool), else :class:`PlanError`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low < value <= high
    ):
        bound = f" and at most {high:g}" if high != math.inf else ""
        raise PlanError(
            f"{where}: {name} must be a finite number above {low:g}{bound}, got {_shown(value)}; fix the value"
        )
    return float(value)


def checked_bool(value: Any, name: str, where: str) -> bool:
    """``value`` if it is ``True``/``False`` (``None``: ``False``), else :class:`PlanError` (``"no"`` is no bool)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    raise PlanError(f"{where}: {name} must be true or false, got {_shown(value)}; YAML booleans are written unquoted")


def checked_text(value: Any, name: str, where: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        expected = f"one of {list(choices)}" if choices else "a text"
        raise PlanError(f"{where}: {name} must be {expected}, got {_shown(value)}; fix the value")
    return value


def _model_sizes(values: Any, source: str) -> dict[str, Any]:
    """The sizes :meth:`ModelNumbers.from_config` reads from a ``config.json`` (or its ``text_config``), each checked:
    an object, integers >= 1 (``shared_expert_intermediate_size`` >= 0), ``num_experts_per_tok`` at most the experts,
    booleans and texts where a config has them. One :class:`PlanError` line for the first that is not."""
    if not isinstance(values, Mapping):
        raise PlanError(
            f"{source} must hold a JSON object of the model's sizes, got {_shown(values)}: the file is "
            "damaged or not a model's config.json"
        )
    if "num_hidden_layers" not in values and values.get("text_config") is not None:
        if not isinstance(values["text_config"], Mapping):
            raise PlanError(
                f"{source}: text_config must be an object of the language model's sizes, got "
                f"{_shown(values['text_config'])}"
            )
        values = values["text_config"]
    names = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok", "vocab_size"}
    expert_keys = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if values.get(k) is not None]
    inter_keys = [k for k in ("moe_intermediate_size", "intermediate_size") if values.get(k) is not None]
    missing = (
        sorted(k for k in names if values.get(k) is None)
        + ["num_experts"] * (not expert_keys)
        + ["intermediate_size"] * (not inter_keys)
    )
    if missing:
        raise PlanError(
            f"{source} has no {missing[0]}: the plan needs a MoE config.json (hidden_size, "
            "num_hidden_layers, num_attention_heads, num_experts, num_experts_per_tok, vocab_size, "
            "intermediate_size)"
        )
    where = str(source)
    out: dict[str, Any] = {k: checked_int(values[k], k, where) for k in sorted(names)}
    out["experts"] = checked_int(values[expert_keys[0]], expert_keys[0], where)
    out["expert_intermediate"] = checked_int(values[inter_keys[0]], inter_keys[0], where)
    if out["num_experts_per_tok"] > out["experts"]:
        raise PlanError(
            f"{where}: num_experts_per_tok {out['num_experts_per_tok']} is more than the "
            f"{out['experts']} experts; fix the value"
        )
    optional = {
        "num_key_value_heads": out["num_attention_heads"],
        "decoder_sparse_step": 1,
        "intermediate_size": out["expert_intermediate"],
    }
    for key, default in optional.items():
        out[key] = default if values.get(key) is None else checked_int(values[key], key, where)
    out["dense_intermediate"] = out.pop("intermediate_size")
    h, heads = out["hidden_size"], out["num_attention_heads"]
    if values.get("head_dim") is not None:
        out["head_dim"] = checked_int(values["head_dim"], "head_dim", where)
    elif h // heads >= 1:
        out["head_dim"] = h // heads
    else:
        raise PlanError(
            f"{where}: hidden_size {h} over num_attention_heads {heads} leaves no head_dim, and the file "
            "names none; fix the values"
        )
    shared = values.get("shared_expert_intermediate_size")
    out["shared_expert_intermediate_size"] = (
        0 if shared is None else checked_int(shared, "shared_expert_intermediate_size", where, minimum=0)
    )
    layers = values.get("mlp_only_layers")
    if layers is None:
        layers = []
    if not isinstance(layers, list):
        raise PlanError(f"{where}: mlp_only_layers must be a list of layer indices, got {_shown(layers)}")
    out["mlp_only_layers"] = [checked_int(i, "mlp_only_layers[]", where, minimum=0) for i in layers]
    for key in ("attention_bias", "tie_word_embeddings"):
        out[key] = checked_bool(values.get(key), key, where)
    model_type, dtype = values.get("model_type"), values.get("dtype") or values.get("torch_dtype")
    out["model_type"] = "" if model_type is None else checked_text(model_type, "model_type", where)
    out["dtype"] = "bfloat16" if dtype is None else checked_text(dtype, "dtype", where)
    return out


def _hub_cache_config(name: str) -> Path | None:
    """``config.json`` of ``name`` in the Hugging Face Hub cache, without any network access."""
    hub = Path(
        os.environ.get("HF_HUB_CACHE")
        or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    )
    snapshots = hub / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None


def model_numbers(name: str) -> ModelNumbers:
    """The numbers of ``name``: a local folder's ``config.json``, else the Hub cache's, else :data:`KNOWN_MODELS`;
    never a download."""
    local = Path(name) / "config.json"
    path = local if local.is_file() else _hub_cache_config(name)
    if path is not None:
        from ..bounded_json import JSONFileError, read_json_file

        try:  # bounded: a damaged file (a 100,000-deep array, gigabytes) is one line, not a traceback
            values = read_json_file(path, max_bytes=MAX_MODEL_CONFIG_BYTES, max_values=MAX_MODEL_CONFIG_VALUES)
        except (JSONFileError, OSError) as exc:
            raise PlanError(f"the model's config.json is not read: {' '.join(str(exc).split())}") from None
        return ModelNumbers.from_config(values, name, str(path))
    if name in KNOWN_MODELS:
        return ModelNumbers.from_config(KNOWN_MODELS[name], name, "the plan's table (trl_moe_replay/cli/plan.py)")
    raise PlanError(
        f"no config.json for {name!r}: not a local folder, not in the Hub cache, not in the plan's "
        f"table ({', '.join(KNOWN_MODELS)}); download it once (huggingface-cli download {name} "
        "config.json) or pass a local folder"
    )


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
    vllm_replicas: int = 1  # the server line's --data-parallel-size
    vllm_max_model_len: int | None = None  # the server line's --max-model-len
    vllm_utilization: float = VLLM_SERVER_UTILIZATION  # the server line's --gpu-memory-utilization
    shard: int = 1  # ranks each training tensor is split over (ep: fsdp_size x tp_size, see params_per_gpu)
    ep_size: int = 1
    fsdp_size: int = 1  # ep: FSDP2's shards (dp_replicate_size replicates them)
    tp_size: int = 1  # ep: tensor parallelism (what the installed transformers' plan shards, see params_per_gpu)
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
            commands.append(current[current.find(next(w for w in starts if w in current)) :])
        current = ""
    return commands


def _flag(words: list[str], name: str) -> str | None:
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _words(command: str, where: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError as exc:  # an unclosed quote
        raise PlanError(f"{where} cannot be split into words ({exc}): {command[:80]!r}; fix the line") from None


def _int_flag(words: list[str], name: str, where: str, minimum: int = 1) -> int | None:
    """The integer after ``name`` in a command line, or None where it is absent; :class:`PlanError` for text, 0 or a
    negative number."""
    given = _flag(words, name)
    if given is None:
        return None
    try:
        value = int(given)
    except ValueError:
        raise PlanError(f"{where}: {name} must be an integer from {minimum}, got {given!r}; fix the line") from None
    return checked_int(value, name, where, minimum)


def _float_flag(words: list[str], name: str, where: str, high: float = math.inf) -> float | None:
    given = _flag(words, name)
    if given is None:
        return None
    try:
        value = float(given)
    except ValueError:
        raise PlanError(f"{where}: {name} must be a number, got {given!r}; fix the line") from None
    return checked_number(value, name, where, high=high)


def read_yaml_file(path: str | Path, what: str) -> tuple[dict[str, Any], str]:
    """The mapping a YAML file holds and its text, read through the bounded reader (a regular file of at most
    :data:`MAX_CONFIG_BYTES`), or :class:`PlanError` in one line: not a file, not UTF-8, not YAML, nested too deeply,
    not a mapping of keys."""
    import yaml

    from ..bounded_json import JSONFileError, read_regular_file

    try:
        data = read_regular_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise PlanError(f"{path} is not a file: pass {what}") from None
    except (JSONFileError, OSError) as exc:
        raise PlanError(f"{what} {path} is not read: {' '.join(str(exc).split())}") from None
    try:
        text = data.decode("utf-8")
        values = yaml.safe_load(text)
    except UnicodeDecodeError:
        raise PlanError(f"{path} is not UTF-8 text: pass {what}") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path} is not valid YAML ({' '.join(str(exc).split())}); fix the file") from None
    except RecursionError:
        raise PlanError(f"{path} nests YAML lists or mappings too deeply to read; fix the file") from None
    if values is None:
        return {}, text
    if not isinstance(values, dict):
        raise PlanError(f"{path} must hold a YAML mapping (key: value lines), got {_shown(values)}; pass {what}")
    return values, text


def layout_from_header(text: str, values: Mapping[str, Any], root: Path = ROOT_OF_RECIPES) -> Layout:
    """The layout the header's launch lines start, and its ``# plan:`` line; every number in them checked."""
    header = header_of(text)
    commands = _commands(header)
    train = next((c for c in commands if "accelerate launch" in c or "torchrun" in c), None)
    sizes = _parallel_sizes(values)
    fields: dict[str, Any] = {}
    if train is None:
        fields.update(sharding="single", processes=1)
    else:
        where = "the header's launch line"
        words = _words(train, where)
        config_file = _flag(words, "--config_file")
        accelerate: dict[str, Any] = {}
        if config_file:
            path = root / config_file
            if not path.is_file():
                raise PlanError(f"the launch line names {config_file}, which is not in {root}")
            accelerate, _ = read_yaml_file(path, "an accelerate config (recipes/accelerate/*.yaml)")
        a_where = f"the accelerate config {config_file}"
        if "torchrun" in words:
            processes = (_int_flag(words, "--nproc_per_node", where) or 1) * (_int_flag(words, "--nnodes", where) or 1)
        else:
            processes = _int_flag(words, "--num_processes", where) or checked_int(
                accelerate.get("num_processes", 1), "num_processes", a_where
            )
        kind = checked_text(
            accelerate.get("distributed_type", "MULTI_GPU" if processes > 1 else "NO"), "distributed_type", a_where
        )
        deepspeed = accelerate.get("deepspeed_config") or {}
        fsdp = accelerate.get("fsdp_config") or {}
        for name, part in (("deepspeed_config", deepspeed), ("fsdp_config", fsdp)):
            if not isinstance(part, dict):
                raise PlanError(f"{a_where}: {name} must be a mapping, got {_shown(part)}; fix the file")
        stage = checked_int(deepspeed.get("zero_stage", 2), "zero_stage", a_where, minimum=0)
        if kind == "DEEPSPEED" and stage not in (2, 3):
            raise PlanError(
                f"{a_where}: the plan models DeepSpeed ZeRO stages 2 and 3, got zero_stage {stage}; use "
                "recipes/accelerate/zero2.yaml or zero3.yaml"
            )
        sharding = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp2", "DEEPSPEED": f"zero{stage}"}.get(kind, "ddp")
        optimizer_device = _flag(words, "--offload_optimizer_device") or deepspeed.get("offload_optimizer_device")
        param_device = _flag(words, "--offload_param_device") or deepspeed.get("offload_param_device")
        fsdp_offload = str(_flag(words, "--fsdp_offload_params") or fsdp.get("fsdp_offload_params")).lower() == "true"
        fields.update(
            sharding=sharding,
            processes=processes,
            offload_optimizer=optimizer_device == "cpu" or fsdp_offload,
            offload_params=param_device == "cpu" or fsdp_offload,
        )
        if sharding == "single" and processes > 1:
            fields["sharding"] = "ddp"
    if sizes:  # transformers shards the model at load time: accelerate only starts the processes
        fields.update(
            sharding="ep",
            shard=sizes.get("fsdp_size", 1) * sizes.get("tp_size", 1),
            ep_size=sizes.get("ep_size", 1),
            fsdp_size=sizes.get("fsdp_size", 1),
            tp_size=sizes.get("tp_size", 1),
            offload_optimizer=False,
            offload_params=False,
        )
    elif fields["sharding"] in ("zero3", "fsdp2"):
        fields["shard"] = fields["processes"]
    server = next((c for c in commands if "vllm-serve" in c or "vllm serve" in c), None)
    if server is not None:
        where = "the header's vllm-serve line"
        words = _words(server, where)
        visible = next((w.split("=", 1)[1] for w in words if w.startswith("CUDA_VISIBLE_DEVICES=")), None)
        tp = _int_flag(words, "--tensor-parallel-size", where) or 1
        dp = _int_flag(words, "--data-parallel-size", where) or 1
        gpus = len(visible.split(",")) if visible else tp * dp
        if tp * dp > gpus:  # vLLM starts tp x dp workers, one GPU each, among the visible ones
            raise PlanError(
                f"{where} asks for tensor parallel {tp} x data parallel {dp} = {tp * dp} GPUs under "
                f"CUDA_VISIBLE_DEVICES={visible} ({gpus} GPUs): vLLM refuses it; make the visible GPUs "
                "as many as --tensor-parallel-size x --data-parallel-size"
            )
        fields.update(vllm_gpus=gpus, vllm_tp=tp, vllm_replicas=dp)
        max_len = _int_flag(words, "--max-model-len", where)
        util = _float_flag(words, "--gpu-memory-utilization", where, high=1.0)
        if max_len:
            fields["vllm_max_model_len"] = max_len
        if util:
            fields["vllm_utilization"] = util
    plan = PLAN_LINE.search(header)
    if plan is not None:
        where = "the header's `# plan:` line"
        words = _words(plan.group(1), where)
        fields.update(
            gpus=_int_flag(words, "--gpus", where),
            gpu_memory=_float_flag(words, "--gpu-memory", where),
            prompt_length=_int_flag(words, "--prompt-length", where),
        )
    return Layout(**fields)


def _parallel_sizes(values: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's ``ep_size``/``fsdp_size``/... keys over ``model_init_kwargs.distributed_config``, the sizes
    checked (integers >= 1)."""
    kwargs = values.get("model_init_kwargs") or {}
    distributed = kwargs.get("distributed_config") or {} if isinstance(kwargs, dict) else None
    if not isinstance(distributed, dict):
        what = "model_init_kwargs" if not isinstance(kwargs, dict) else "model_init_kwargs.distributed_config"
        raise PlanError(
            f"the config's {what} must be a YAML mapping, got "
            f"{_shown(kwargs if what == 'model_init_kwargs' else distributed)}; fix the value"
        )
    sizes = dict(distributed)
    sizes.update(
        {
            k: values[k]
            for k in ("ep_size", "fsdp_size", "tp_size", "dp_replicate_size", "ep_implementation")
            if values.get(k) is not None
        }
    )
    for key in ("ep_size", "fsdp_size", "tp_size", "dp_replicate_size"):
        if sizes.get(key) is not None:
            checked_int(sizes[key], key, "the config")
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


def config_values(values: dict[str, Any], where: str) -> None:
    """Check every value of the config the estimate reads besides the batch's (:func:`check_batch`) and the parallel
    sizes (:func:`_parallel_sizes`): type, sign, non-zero, finite; one :class:`PlanError` line for the first that is
    not. A YAML ``null`` where a number is needed is refused, never replaced by a default."""
    checked_text(values["model_name_or_path"], "model_name_or_path", where)
    for key in ("use_vllm", "use_peft", "gradient_checkpointing", "vllm_enable_sleep_mode"):
        values[key] = checked_bool(values.get(key), key, where)
    if values.get("bf16") is not None:
        checked_bool(values["bf16"], "bf16", where)
    if values["use_vllm"]:
        checked_text(values.get("vllm_mode"), "vllm_mode", where, ("server", "colocate"))
    checked_int(values["max_completion_length"], "max_completion_length", where)
    if values.get("vllm_max_model_length") is not None:
        checked_int(values["vllm_max_model_length"], "vllm_max_model_length", where)
    checked_number(values["vllm_gpu_memory_utilization"], "vllm_gpu_memory_utilization", where, high=1.0)
    checked_int(values["vllm_tensor_parallel_size"], "vllm_tensor_parallel_size", where)
    beta = values["beta"]
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < math.inf:
        raise PlanError(f"{where}: beta must be a finite number >= 0, got {_shown(beta)}; fix the value")
    checked_text(values["optim"], "optim", where)
    if values.get("dtype") is not None:
        checked_text(values["dtype"], "dtype", where)
    if values["use_peft"]:
        checked_int(values["lora_r"], "lora_r", where)
        targets = values.get("lora_target_modules")
        if isinstance(targets, str):
            values["lora_target_modules"] = [targets]
        elif targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
            raise PlanError(f"{where}: lora_target_modules must be a list of module names, got {_shown(targets)}")


def trainer_checks(values: Mapping[str, Any]) -> None:
    """The trainer's own config checks on the config's values, the functions ``MoEReplayGRPOConfig.__post_init__``
    runs: ``check_config`` (our fields by type and range, TRL's by ``UPSTREAM_REFUSALS``) and
    ``check_generation_support`` (generation setups whose routes cannot be kept, such as colocated vLLM >= 0.31 with
    ``vllm_tensor_parallel_size`` > 1, judged by the installed vLLM as the trainer judges it). They raise the
    trainer's own exception with its own line. TRL's ``__post_init__`` itself is not run (it needs the launched
    world); its batch rule is :func:`check_batch`'s, with the layout's processes."""
    from types import SimpleNamespace

    from ..core.config_checks import check_config
    from ..trainer.grpo_config import MoEReplayGRPOConfig, check_generation_support

    # the checks read attributes only: a namespace of the file's values stands in for the config object
    args: Any = SimpleNamespace(**{k: v for k, v in values.items() if isinstance(k, str)})
    check_config(args, MoEReplayGRPOConfig)
    check_generation_support(args)


def check_batch(values: Mapping[str, Any], processes: int) -> dict[str, int]:
    """The batch arithmetic with ``processes`` training processes, or :class:`PlanError` where TRL's
    ``GRPOConfig.__post_init__`` would refuse it (its rules with ``world_size = processes``)."""
    where = "the config"
    b, ga = (checked_int(values[k], k, where) for k in ("per_device_train_batch_size", "gradient_accumulation_steps"))
    g = checked_int(values["num_generations"], "num_generations", where, minimum=2)  # TRL: GRPO needs 2 to compare
    spg = (
        ga
        if values.get("steps_per_generation") is None
        else checked_int(values["steps_per_generation"], "steps_per_generation", where)
    )
    if values.get("generation_batch_size") is not None:
        checked_int(values["generation_batch_size"], "generation_batch_size", where)
        if values["generation_batch_size"] % (b * processes):
            raise PlanError(
                f"generation_batch_size {values['generation_batch_size']} is not a multiple of "
                f"per_device_train_batch_size {b} x {processes} processes: TRL refuses it"
            )
        spg = values["generation_batch_size"] // (b * processes)
    rollout = b * processes * spg
    if rollout % g:
        raise PlanError(
            f"a rollout batch of {b} per device x {processes} processes x {spg} steps_per_generation = "
            f"{rollout} completions is not a multiple of num_generations {g}: TRL refuses it (whole "
            "prompt groups only); change per_device_train_batch_size or steps_per_generation"
        )
    eval_on = values.get("eval_strategy", "no") != "no"  # TRL checks whenever evaluation is on (do_eval follows it)
    eval_g = (
        g
        if values.get("num_generations_eval") is None
        else checked_int(values["num_generations_eval"], "num_generations_eval", where)
    )
    if (
        eval_on
        and checked_int(values["per_device_eval_batch_size"], "per_device_eval_batch_size", where) * processes % eval_g
    ):
        raise PlanError(
            f"per_device_eval_batch_size {values['per_device_eval_batch_size']} x {processes} processes "
            f"is not a multiple of {eval_g} generations for evaluation: TRL refuses it"
        )
    return dict(
        per_device=b,
        accumulation=ga,
        steps_per_generation=spg,
        update=b * processes * ga,
        rollout=rollout,
        num_generations=g,
    )


def check_sizes(model: ModelNumbers, layout: Layout, values: Mapping[str, Any]) -> None:
    """Expert parallelism's sizes against the processes and the experts (transformers' own checks through
    :func:`trl_moe_replay.parallel.expert_parallel.distributed_config_from_args`), in one line."""
    from types import SimpleNamespace

    from ..parallel.expert_parallel import ParallelSizesError, distributed_config_from_args

    if layout.sharding != "ep":
        return
    sizes = _parallel_sizes(values)
    try:
        distributed_config_from_args(
            SimpleNamespace(model_init_kwargs={"distributed_config": sizes}), world_size=layout.processes, gpus=True
        )
    except ParallelSizesError as exc:
        raise PlanError(str(exc)) from None
    if model.experts % layout.ep_size:
        raise PlanError(
            f"ep_size {layout.ep_size} does not divide {model.name}'s {model.experts} experts: each rank "
            f"holds num_experts / ep_size of them; use an ep_size that divides both {model.experts} and "
            "fsdp_size x tp_size"
        )


def _part_of(name: str) -> str:
    """The part (:attr:`ModelNumbers.parts`) a parameter name belongs to."""
    if ".experts." in name:
        return "experts"
    if ".shared_expert." in name:
        return "shared_expert"
    if re.search(r"\.self_attn\.[qkvo]_proj\.", name):
        return "attention"
    if re.search(r"\.mlp\.(gate|up|down)_proj\.", name):
        return "dense_mlp"
    return next((part for part in ("embed_tokens", "lm_head") if f"{part}." in name), "other")


@functools.cache
def tensor_parallel_parts(model_type: str) -> frozenset[str]:
    """The parts of a ``model_type`` model the installed transformers' tensor-parallel plan shards: a part counts
    when the plan shards every weight of it (norms, routers and biases of a sharded part are small)."""
    from ..upstream import tp_sharded_parameters

    names, sharded = tp_sharded_parameters(model_type)
    parts: dict[str, bool] = {}
    for name in names:
        part = _part_of(name)
        if name.endswith(".bias") or part == "other":
            continue
        parts[part] = parts.get(part, True) and name in sharded
    return frozenset(part for part, all_sharded in parts.items() if all_sharded)


def params_per_gpu(model: ModelNumbers, layout: Layout) -> tuple[float, str]:
    """A model sharded at load time (``DistributedConfig``): the parameters one GPU holds, and how they were divided.

    FSDP2 shards every decoder layer over ``fsdp_size`` (``dp_replicate_size`` replicates); expert parallelism
    (``ep_size > 1``) splits the experts over ``ep_size`` and FSDP2 shards them over the rest, ``fsdp_size x tp_size /
    ep_size``: experts / (fsdp x tp). Tensor parallelism divides by ``tp_size`` only the parts the installed
    transformers' TP plan shards (:func:`~trl_moe_replay.upstream.tensor_parallel_parts`): from transformers 5.25 the
    MoE plans leave the routed experts out, so at ``tp_size > 1`` with ``ep_size 1`` every GPU of a TP group holds
    the same expert shards."""
    f, t = layout.fsdp_size, layout.tp_size
    if t == 1:
        return model.params_total / f, f"/ {f}" if f > 1 else ""
    split = tensor_parallel_parts(model.model_type) | ({"experts"} if layout.ep_size > 1 else set())
    local = sum(n / (f * t if part in split else f) for part, n in model.parts)
    names = sorted(part for part, n in model.parts if part in split and n)
    return (
        local,
        f"/ {f * t} for {', '.join(names) or 'nothing'}, / {f} for the rest (tp_size {t}, ep_size {layout.ep_size})",
    )


def gathered_layer_params(model: ModelNumbers, layout: Layout) -> float:
    """The parameters of the largest decoder layer one GPU holds while FSDP2 has it unsharded: FSDP2 gathers over its
    own shards only, so the experts are left out where EP holds them, and the parts the installed TP plan shards
    (:func:`tensor_parallel_parts`) stay divided by ``tp_size``."""
    layer = model.layer_params - (model.layer_expert_params if layout.ep_size > 1 else 0)
    t = layout.tp_size
    if t == 1:
        return layer
    split = tensor_parallel_parts(model.model_type)
    parts = dict(model.parts)
    per_layer = {
        "attention": parts.get("attention", 0) / model.layers,
        "shared_expert": parts.get("shared_expert", 0) / max(model.moe_layers, 1),
    }
    if layout.ep_size == 1:
        per_layer["experts"] = model.layer_expert_params
    return layer - sum(n * (1 - 1 / t) for part, n in per_layer.items() if part in split)


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
    generation_phase: tuple[float, float] | None = (
        None  # colocated with sleep mode: (GB resident while generating, budget)
    )
    warnings: list[str] = dataclasses.field(default_factory=list)  # the trainer's config warnings, one line each
    checkpoint_gb: tuple[float, float] = (0.0, 0.0)  # a checkpoint's weights and optimizer state, all ranks together

    @property
    def train_total(self) -> float:
        return sum(gb for _, gb, _ in self.train_lines)

    @property
    def fits(self) -> bool:
        return self.train_total <= self.budget and all("does not fit" not in line for line in self.vllm_lines)


def _lora_params(model: ModelNumbers, values: Mapping[str, Any]) -> int:
    r = values["lora_r"]
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    targets = values.get("lora_target_modules") or ["q_proj", "v_proj"]
    unknown = [t for t in targets if t not in sizes]
    if unknown or values.get("lora_target_parameters"):
        raise PlanError(
            f"the plan counts LoRA adapters on attention projections only ({', '.join(sizes)}); this "
            f"config also targets {unknown or values.get('lora_target_parameters')}"
        )
    return model.layers * r * sum(sizes[t] for t in targets)


def estimate(
    config: str | Path, gpus: int | None = None, gpu_memory: float | None = None, prompt_length: int | None = None
) -> Plan:
    """The plan of a recipe config file (see the module's docstring); ``gpus``/``gpu_memory``/``prompt_length``
    default to its ``# plan:`` line, and a value given here is used as given (0 or a negative is refused, never
    replaced by the header's)."""
    given = "the command line"
    if gpus is not None:
        checked_int(gpus, "--gpus", given)
    if gpu_memory is not None:
        checked_number(gpu_memory, "--gpu-memory", given)
    if prompt_length is not None:
        checked_int(prompt_length, "--prompt-length", given)
    path = Path(config)
    what = "a recipe config (recipes/configs/*.yaml)"
    in_file, text = read_yaml_file(path, what)
    values = {**_defaults(), **in_file}
    name = values.get("model_name_or_path")
    if name is None or name == "":
        raise PlanError(f"{path.name} names no model (the offline tiny MoE): nothing to plan on GPUs")
    config_values(values, path.name)
    layout = layout_from_header(text, values)
    gpus = layout.gpus if gpus is None else gpus
    gpu_memory = layout.gpu_memory if gpu_memory is None else gpu_memory
    if gpus is None or gpu_memory is None:
        raise PlanError(
            f"{path.name}: say the GPUs, --gpus N --gpu-memory GB (or a `# plan: --gpus N --gpu-memory GB`"
            " line in its header)"
        )
    model = model_numbers(name)
    check_sizes(model, layout, values)
    batch = check_batch(values, layout.processes)
    trainer_checks(values)
    from types import SimpleNamespace

    from ..checkpointing.checkpoints import saves_inside_generation_batches

    saving = saves_inside_generation_batches(
        SimpleNamespace(
            save_strategy=values.get("save_strategy"),
            save_steps=values.get("save_steps"),
            steps_per_generation=batch["steps_per_generation"],
            num_iterations=checked_int(values["num_iterations"], "num_iterations", path.name),
            gradient_accumulation_steps=batch["accumulation"],
        )
    )
    colocate = values["use_vllm"] and values["vllm_mode"] == "colocate"
    used = layout.processes + (0 if colocate else layout.vllm_gpus)
    if used > gpus:
        raise PlanError(
            f"the layout uses {used} GPUs ({layout.processes} training processes + {layout.vllm_gpus} "
            f"for vLLM), more than the {gpus} given"
        )
    if values["use_vllm"] and not colocate and layout.vllm_gpus == 0:
        raise PlanError(
            f"{path.name} generates on a vLLM server but its header has no `trl vllm-serve` line with "
            "CUDA_VISIBLE_DEVICES: say which GPUs serve"
        )
    p = next(v for v in (prompt_length, layout.prompt_length, DEFAULT_PROMPT_LENGTH) if v is not None)
    c = values["max_completion_length"]
    s = p + c
    n = layout.processes
    shard: float = layout.shard  # an int but under a model sharded at load time (params_per_gpu)
    max_len = (
        (values["vllm_max_model_length"] if colocate else layout.vllm_max_model_len) if values["use_vllm"] else None
    )
    if max_len is not None and max_len < s:
        what = "vllm_max_model_length" if colocate else "the vllm-serve line's --max-model-len"
        raise PlanError(
            f"{path.name}: {what} {max_len} is below prompt {p} + completion {c} = {s} tokens: vLLM would "
            f"refuse or cut such sequences; raise it to {s} or lower max_completion_length or "
            "--prompt-length"
        )

    # ---- training state
    lines: list[tuple[str, float, str]] = []
    P = model.params_total
    peft = bool(values.get("use_peft"))
    T = _lora_params(model, values) if peft else P
    loaded = values.get("dtype") or model.dtype
    w = 4 if loaded in ("float32", "torch.float32") else 2
    fp16 = checked_bool(values.get("fp16"), "fp16", "the config")
    bf16 = not fp16 if values.get("bf16") is None else values["bf16"]  # TRL's rule for an unset bf16
    foreach = _optimizer_temporaries(values["optim"])
    where = "" if shard == 1 else f" / {shard}"
    sharding = layout.sharding
    if sharding == "ep":  # not every part divides by fsdp x tp (params_per_gpu); PEFT is refused on such a model
        local, how = params_per_gpu(model, layout)
        shard, where = P / local, f" {how}" if how else ""
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
            lines.append(
                (
                    "weights",
                    weights / w_shard / GB,
                    f"bf16{' (adapters fp32)' * peft}" + (f" / {n}" if w_shard > 1 else ", whole on each GPU"),
                )
            )
        lines.append(("gradients", grads / n / GB, f"{'fp32 adapters' if peft else 'bf16'} / {n}"))
        if layout.offload_optimizer:
            cpu += opt + 4 * T  # DeepSpeedCPUAdam's fp32 gradient partition too
            lines.append(("masters + Adam m, v", 0.0, f"offloaded to CPU: {opt / GB:.0f} GB + fp32 grads"))
        else:
            lines.append(("masters + Adam m, v", opt / n / GB, f"fp32, 12 bytes/param / {n}"))
            if foreach:  # DeepSpeed steps the Trainer's torch AdamW on its fp32 partition
                lines.append(
                    ("optimizer-step temporaries", 4 * T / n / GB, f"4 bytes/param / {n}: {FOREACH_TEMPORARIES}")
                )
        a_bytes, gathered = 2, (2.0 * 2 * model.layer_params if sharding == "zero3" else 0.0)
    elif sharding == "fsdp2":  # accelerate upcasts trainable parameters to fp32; MixedPrecisionPolicy computes in bf16
        base = (P - T) * w if peft else 0  # a frozen base stays in its loaded dtype
        if layout.offload_params:
            cpu += base + 16 * T
            lines.append(("weights + grads + Adam", 0.0, "offloaded to CPU (fsdp_offload_params: CPUOffloadPolicy)"))
        else:
            lines.append(("weights", (4 * T + base) / n / GB, f"fp32 (the masters) / {n}"))
            lines.append(("gradients", 4 * T / n / GB, f"fp32 / {n}"))
            lines.append(("Adam m, v", 8 * T / n / GB, f"fp32 / {n}"))
            if foreach:
                lines.append(
                    ("optimizer-step temporaries", 4 * T / n / GB, f"4 bytes/param / {n}: {FOREACH_TEMPORARIES}")
                )
        a_bytes, gathered = (2 if bf16 else 4), 2 * (2 if bf16 else 4) * model.layer_params
    else:  # single, ddp, ep: the parameters are the masters, in the loaded dtype (LoRA adapters: fp32)
        t_bytes = 4 if peft else w
        lines.append(
            (
                "weights",
                ((P - T) * w + T * t_bytes if peft else P * w) / shard / GB,
                f"{'fp32' if w == 4 else 'bf16'}{where or ', whole on each GPU'}",
            )
        )
        lines.append(("gradients", T * t_bytes / shard / GB, f"{'fp32' if t_bytes == 4 else 'bf16'}{where}"))
        lines.append(("Adam m, v", 2 * T * t_bytes / shard / GB, f"2 x {t_bytes} bytes/param{where}"))
        if foreach:
            lines.append(
                (
                    "optimizer-step temporaries",
                    T * t_bytes / shard / GB,
                    f"{t_bytes} bytes/param{where}: {FOREACH_TEMPORARIES}",
                )
            )
        if sharding == "ddp":
            lines.append(
                (
                    "DDP gradient buckets",
                    T * t_bytes / GB,
                    "a second copy of the gradients (accelerate's DDP: gradient_as_bucket_view off)",
                )
            )
        a_bytes = 4 if w == 4 else 2
        gathered = 0.0
        if sharding == "ep" and layout.fsdp_size > 1:  # FSDP2 unshards a layer; its experts too unless EP holds them
            gathered = 2 * 4 * gathered_layer_params(model, layout)
        if bf16 and w == 4:
            lines.append(
                (
                    "bf16 autocast copies",
                    2 * (P - T if peft else P) / shard / GB + 0,
                    f"autocast keeps the bf16 casts of the weights for the forward{where}",
                )
            )
    # ---- the checkpoint a save writes: the model's weights as saved, and the optimizer's state
    if sharding in ("zero2", "zero3"):  # the 16-bit model (zero3_save_16bit_model) + fp32 masters and Adam m, v
        saved, optimizer_state = (4 * T if peft else 2 * P), 12 * T
    elif sharding == "fsdp2":  # fp32 parameters (the masters) + Adam m, v
        saved, optimizer_state = 4 * T, 8 * T
    else:  # the parameters in their dtype (LoRA adapters fp32) + Adam m, v in the same
        t_bytes = 4 if peft else w
        saved, optimizer_state = t_bytes * T, 2 * t_bytes * T
    if values["beta"] > 0 and not peft:  # TRL loads a second copy; under PEFT it disables the adapters instead
        ref_bytes, ref_how = {
            "zero3": (2 * P / n, f"bf16 / {n} (ZeRO-3 shards it as the policy)"),
            "zero2": (2 * P, "bf16, whole on each GPU (TRL prepares it with ZeRO stage 0 under ZeRO-2)"),
            "fsdp2": (w * P / n, f"loaded dtype / {n} (TRL's prepare_fsdp shards it)"),
        }.get(sharding, (w * P / shard, f"loaded dtype{where or ', whole on each GPU'}"))
        if layout.offload_params and sharding in ("zero3", "fsdp2"):
            cpu += w * P if sharding == "fsdp2" else 2 * P
            lines.append(("reference model (beta > 0)", 0.0, "offloaded to CPU with the policy's parameters"))
        else:
            lines.append(("reference model (beta > 0)", ref_bytes / GB, ref_how))
    if gathered:
        lines.append(("gathered layers", gathered / GB, "2 decoder layers unsharded (the current and the prefetched)"))
    # ---- activations of one micro-batch (b sequences of s tokens, c of them completion)
    b = batch["per_device"]
    h, k, i = model.hidden, model.top_k, model.expert_intermediate
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    layer_bytes = 2 * (2 * h + q + 2 * kv + q + h + k * (h + 3 * i + h)) + 4 * model.experts  # per token, one layer
    if values.get("gradient_checkpointing"):
        lines.append(
            (
                "checkpointed layer inputs",
                b * s * model.layers * h * a_bytes / GB,
                f"{b} x {s} tokens x {model.layers} layers x hidden {h} x {a_bytes} bytes",
            )
        )
        lines.append(
            (
                "one layer's activations",
                2 * b * s * layer_bytes / GB,
                f"recomputed in the backward, x2 for their gradients ({layer_bytes} bytes/token)",
            )
        )
    else:
        lines.append(
            (
                "activations",
                (model.layers + 1) * b * s * layer_bytes / GB,
                f"every layer kept ({layer_bytes} bytes/token/layer), no gradient checkpointing",
            )
        )
    lines.append(
        (
            "logits",
            8 * b * c * model.vocab / GB,
            f"{b} x {c} completion tokens x vocab {model.vocab} x 8 bytes (4 bf16 copies: logits, scaled, "
            "log-softmax, gradient)",
        )
    )
    route_bytes = 1 if model.experts <= 256 else 2
    routes_rank = batch["rollout"] / n * s * model.moe_layers * k * route_bytes
    from ..core.routing_options import ReplayMode

    if ReplayMode.parse(values["routing_replay"]).replays:  # the config's value, or the declared default
        lines.append(
            (
                "routes of the rollout batch",
                routes_rank / GB,
                f"this rank's {batch['rollout'] // n} completions x {s} x {model.moe_layers} x {k}",
            )
        )
    lines.append(("CUDA context, NCCL, workspaces", FIXED_GB, "fixed"))

    # ---- vLLM
    vllm: list[str] = []
    engine = 2 * P  # bf16 weights
    generation_phase: tuple[float, float] | None = None
    if colocate:
        util, tp = values["vllm_gpu_memory_utilization"], values["vllm_tensor_parallel_size"]
        share = util * gpu_memory
        free = share - engine / tp / GB - VLLM_BUFFERS_GB
        kv_token = kv_bytes_per_token(model, tp)
        vllm.append(
            f"vLLM colocated on every training GPU: vllm_gpu_memory_utilization {util} = {share:.1f} GB "
            f"(bf16 weights {engine / tp / GB:.1f} GB{f' / tp {tp}' if tp > 1 else ''}, ~1 GB of buffers, KV "
            f"cache {max(free, 0):.1f} GB = {max(free, 0) * GB / kv_token:,.0f} tokens at {kv_token:,} "
            f"bytes/token per GPU, {max(free, 0) * GB / kv_token / s:.1f} sequences of {s})"
            + ("" if free * GB >= s * kv_token else ": does not fit one sequence")
        )
        if values["vllm_enable_sleep_mode"]:  # TRL: llm.sleep(level=2) after generating, wake_up before the next
            budget = (1 - MARGIN) * gpu_memory
            lines.append(
                (
                    "vLLM asleep (sleep mode)",
                    VLLM_BUFFERS_GB,
                    "weights and KV cache released by sleep level 2 while training; its buffers stay",
                )
            )
            resident = sum(gb for what, gb, _ in lines if what in RESIDENT_WHILE_GENERATING)
            generation_phase = (resident + share, budget)
            vllm.append(
                f"generation phase (sleep mode): the training state that stays ({resident:.1f} GB: weights, "
                f"optimizer state, fixed; gradients freed by zero_grad, no activations) + vLLM's share "
                f"{share:.1f} GB = {resident + share:.1f} GB of a budget of {budget:.1f} GB"
                + ("" if resident + share <= budget else ": does not fit")
            )
        else:
            budget = (1 - util - MARGIN) * gpu_memory
    else:
        budget = (1 - MARGIN) * gpu_memory
        if layout.vllm_gpus:
            tp, replicas = layout.vllm_tp, layout.vllm_replicas
            if model.heads % tp:
                raise PlanError(
                    f"the vllm-serve line's --tensor-parallel-size {tp} does not divide {model.name}'s "
                    f"{model.heads} attention heads: vLLM refuses it; use a divisor of {model.heads}"
                )
            util = layout.vllm_utilization
            free = util * gpu_memory - engine / tp / GB - 2.0
            kv_token = kv_bytes_per_token(model, tp)
            tokens = max(free, 0) * GB / kv_token * replicas
            vllm.append(
                f"vLLM server on {layout.vllm_gpus} GPUs ({replicas} x tensor parallel {tp}): bf16 weights "
                f"{engine / tp / GB:.1f} GB per GPU, ~2 GB buffers and CUDA graphs, KV cache "
                f"{max(free, 0):.1f} GB per GPU at --gpu-memory-utilization {util:g} = "
                f"{tokens:,.0f} tokens at {kv_token:,} bytes/token per GPU, {tokens / s:.0f} sequences of "
                f"{s} at once" + ("" if free * GB >= s * kv_token else ": does not fit one sequence")
            )
    # ---- routes on the wire
    per_completion = (s - 1) * model.moe_layers * k * route_bytes
    raw = batch["rollout"] * per_completion
    routes = [
        f"routes per rollout batch: {batch['rollout']} completions x {s - 1} tokens x {model.moe_layers} MoE "
        f"layers x top-{k} x {route_bytes} byte{'s' * (route_bytes > 1)} "
        f"({'uint8' if route_bytes == 1 else 'int16'}: {model.experts} experts) = {raw / GB:.2f} GB raw, "
        f"{raw * 4 / 3 / GB:.2f} GB as base64 on the wire (x4/3), {raw / n / GB:.2f} GB raw per training rank"
    ]
    return Plan(
        model=model,
        layout=layout,
        batch=batch,
        prompt_length=p,
        completion_length=c,
        gpu_memory=gpu_memory,
        train_lines=lines,
        budget=budget,
        cpu_gb=cpu / GB,
        vllm_lines=vllm,
        route_lines=routes,
        generation_phase=generation_phase,
        warnings=[saving] if saving else [],
        checkpoint_gb=(saved / GB, optimizer_state / GB),
    )


_NAMES = {
    "single": "one process",
    "ddp": "DDP",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp2": "FSDP2",
    "ep": "expert parallelism (DistributedConfig)",
}


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
        + (f", {' and '.join(offload)} offloaded to CPU" if offload else "")
        + ")"
        + (f" + {lay.vllm_gpus} vLLM server" if lay.vllm_gpus else "")
        + f", {plan.gpu_memory:g} GB each",
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
    colocated = (
        " and the vLLM share" if "colocated" in " ".join(plan.vllm_lines) and plan.generation_phase is None else ""
    )
    out.append(
        f"  {'total':<32}{plan.train_total:7.1f}  of a budget of {plan.budget:.1f} GB "
        f"({plan.gpu_memory:g} GB less {MARGIN:.0%} margin{colocated}): {verdict}"
    )
    if plan.cpu_gb:
        out.append(f"CPU memory for the offloaded state: {plan.cpu_gb:.0f} GB on the training node (all ranks)")
    out += plan.vllm_lines + plan.route_lines
    weights, optimizer = plan.checkpoint_gb
    out.append(
        f"checkpoint: about {weights + optimizer:.0f} GB (weights {weights:.0f} GB + optimizer state "
        f"{optimizer:.0f} GB), {(weights + optimizer) / DISK_GB_PER_S:.0f} s to write at {DISK_GB_PER_S:g} GB/s: "
        "a preemption grace period covers that plus the rest of the generation batch in progress "
        "(docs/recipes.md, Preemption grace period)"
    )
    out += [f"warning: {line}" for line in plan.warnings]
    out.append(
        "verdict: " + ("fits" if plan.fits else "does NOT fit") + " (an estimate; measured against a GPU's "
        "peak only at a small size: docs/recipes.md, Memory plan)"
    )
    return "\n".join(out)


def run_plan(
    config: str, gpus: int | None = None, gpu_memory: float | None = None, prompt_length: int | None = None
) -> tuple[str, bool]:
    plan = estimate(config, gpus, gpu_memory, prompt_length)
    return format_plan(plan, config), plan.fits
