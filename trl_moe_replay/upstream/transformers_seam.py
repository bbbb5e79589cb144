"""The transformers part of the seam: transformers internals the package relies on, each one named entry.

RouterReplay relies on two internals that changed between releases inside the declared range
(``stack_cache_keyword``, ``router_output_order``), read and rebuilt only through these functions, which fail with
:class:`TransformersChangedError` naming the entry. The trainers rely on ``Trainer``'s private methods and on how
``save_pretrained`` names and leaves out weights. TRL-free: the routing package imports this part.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from packaging.version import Version

from .entries import Finding, TransformersChangedError, entry, method_finding


TRANSFORMERS_VERIFIED = ("5.16.1", "5.24.0", "5.25.0")
"""transformers versions the routing entries were verified on (the whole family and replay suites ran there)."""


# ---------------------------------------------------------------------------------------------------------------
# stack_cache_keyword: the KV cache keyword of the decoder stack (RouterReplay's stack pre-hook,
#    trl_moe_replay/routing/replay.py).
#    Before transformers 5.24 `generate` hands the stack (e.g. Qwen3MoeModel.forward) its cache as
#    `past_key_values=`; from 5.24 as `cache=` (`past_key_values` stays a deprecated alias, renamed inside
#    forward, so a pre-hook can see either). A pre-hook that misses the cache takes every decode step for a fresh
#    forward. Verified on transformers 5.16.1, 5.24.0 and 5.25.0 (TRANSFORMERS_VERIFIED; CI runs both ends).
# ---------------------------------------------------------------------------------------------------------------
STACK_CACHE_KEYWORD = entry("stack_cache_keyword", "transformers", "5.24.0", TRANSFORMERS_VERIFIED)
STACK_CACHE_KEYWORDS = ("cache", "past_key_values")


def check_stack_cache_keyword(stack: Any) -> None:
    """Raise :class:`TransformersChangedError` (entry ``stack_cache_keyword``) unless ``stack.forward`` takes one of
    :data:`STACK_CACHE_KEYWORDS`. Called when RouterReplay attaches to a model."""
    params = inspect.signature(stack.forward).parameters
    if not any(keyword in params for keyword in STACK_CACHE_KEYWORDS):
        raise TransformersChangedError(
            f"[{STACK_CACHE_KEYWORD.name}] {type(stack).__name__}.forward takes neither of {STACK_CACHE_KEYWORDS} "
            f"(it takes "
            f"{tuple(params)}): transformers {transformers_version()} renamed the decoder stack's KV cache "
            "argument, and RouterReplay could not tell generate's decode steps from fresh forwards. Install a "
            "transformers inside this package's declared range (README, Tested versions)."
        )


def stack_cache(kwargs: dict) -> Any:
    """The KV cache a decoder-stack forward was called with (entry ``stack_cache_keyword``), or ``None``."""
    for keyword in STACK_CACHE_KEYWORDS:
        if kwargs.get(keyword) is not None:
            return kwargs[keyword]
    return None


# ---------------------------------------------------------------------------------------------------------------
# router_output_order: the order of a router's outputs (RouterReplay's router hook).
#    Every router in the family table returns (router_logits [N, E], gate_weights [N, K], expert_ids [N, K]), except,
#    before transformers 5.21, the GraniteMoe(-Shared, -Hybrid) and Aria routers, which return
#    (expert_ids, gate_weights, router_logits). Read from transformers 5.16.1 through 5.24.0 (every minor release);
#    verified by tests/routing/test_routers.py at 5.16.1, 5.24.0 and 5.25.0. RouterReplay reads and rebuilds a router's output only
#    through these two functions, which check the dtypes (integer ids, floating logits) so that a router whose
#    order changed again fails loudly with this entry's name instead of replaying logits as ids.
# ---------------------------------------------------------------------------------------------------------------
ROUTER_OUTPUT_ORDER = entry("router_output_order", "transformers", "5.24.0", TRANSFORMERS_VERIFIED)
IDS_FIRST_BEFORE = "5.21.0"
IDS_FIRST_ROUTERS = frozenset(
    {"GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter", "GraniteMoeHybridTopKRouter", "AriaTextTopKRouter"}
)


def transformers_version() -> str:
    """The installed transformers' version (one function, so tests can pretend another)."""
    import transformers

    return transformers.__version__


def router_ids_first(router: Any) -> bool:
    """Whether ``router`` returns ``(ids, weights, logits)`` in the installed transformers (entry
    ``router_output_order``)."""
    if Version(transformers_version()) >= Version(IDS_FIRST_BEFORE):
        return False
    return any(cls.__name__ in IDS_FIRST_ROUTERS for cls in type(router).__mro__)


def split_router_output(output: tuple, ids_first: bool, router_name: str) -> tuple[Any, Any, Any]:
    """``(logits, weights, ids)`` of a router's output, whatever its order (entry ``router_output_order``)."""
    logits, weights, ids = (output[2], output[1], output[0]) if ids_first else (output[0], output[1], output[2])
    if ids.dtype.is_floating_point or not logits.dtype.is_floating_point:
        raise TransformersChangedError(
            f"[{ROUTER_OUTPUT_ORDER.name}] router {router_name} ({transformers_version()}) returned "
            f"{tuple(o.dtype for o in output[:3])}; "
            f"expected {'(ids, weights, logits)' if ids_first else '(logits, weights, ids)'} as "
            f"trl_moe_replay/upstream/transformers_seam.py entry {ROUTER_OUTPUT_ORDER.name} records for this "
            "transformers. Its output order changed: install a transformers inside this package's declared range, or "
            "update the entry."
        )
    return logits, weights, ids


def join_router_output(output: tuple, ids_first: bool, logits: Any, weights: Any, ids: Any) -> tuple:
    """A router output in the router's own order with new ``weights`` and ``ids`` (entry ``router_output_order``)."""
    head = (ids, weights, logits) if ids_first else (logits, weights, ids)
    return (*head, *output[3:])


# ---------------------------------------------------------------------------------------------------------------
# hub_kernels: which layers of a model a Hub kernel replaced (RouterReplay refuses a model whose router or MoE block
#    one replaced, trl_moe_replay/routing/replay.py). From transformers 5.25 `from_pretrained` kernelizes every model
#    it loads unless told not to (`use_kernels=None` becomes True; `use_kernels=False` or the environment variable
#    USE_HUB_KERNELS=NO turn it off; modeling_utils.py, from_pretrained), so `model.use_kernels` is True after a plain
#    load, on a CPU too, while a layer's forward is replaced only where transformers' kernel mapping
#    (integrations/hub_kernels.py) has a kernel for the model's device and mode: none on a CPU (so nothing is fetched
#    from the Hub there, HF_HUB_OFFLINE or not), RMSNorm and RoPE on CUDA/ROCm, no router or MoE block on any device in
#    the default mapping. The `kernels` package (a dependency of transformers from 5.25, optional before) says which
#    layers were replaced: its public `get_kernelized_layers(model).layers`, {module name: (module, repository)},
#    kernels 0.19.1. Where it cannot (no `kernels`, or one without that function), only `model.use_kernels` is known.
#    Read from transformers 5.25.0 and kernels 0.19.1.
# ---------------------------------------------------------------------------------------------------------------
HUB_KERNELS = entry("hub_kernels", "transformers", "5.25.0")


def hub_kernel_layers(model: Any) -> dict[str, Any] | None:
    """``{module name: module}`` of the layers of ``model`` whose forward a Hub kernel replaced, or ``None`` when the
    installed ``kernels`` cannot tell (entry ``hub_kernels``)."""
    try:
        from kernels import get_kernelized_layers
    except ImportError:
        return None
    return {name: layer.module for name, layer in get_kernelized_layers(model).layers.items()}


# ---------------------------------------------------------------------------------------------------------------
# trainer_private_methods: transformers.Trainer's private methods both trainers override or call
#    (trl_moe_replay/trainer/grpo_trainer.py, pr2/trainer_mixin.py, core/trainer_base.py). An override forwards these
#    by name, so a renamed or reordered parameter must fail here rather than shift arguments:
#    _save_checkpoint / _load_optimizer_and_scheduler (PR2 checkpoints its predictors next to the Trainer's files,
#    in the directory _get_output_dir(trial) names; a model sharded at load time saves and loads its optimizer state
#    with torch's distributed checkpoint through _save_optimizer_and_scheduler / _load_optimizer_and_scheduler,
#    trl_moe_replay/checkpointing/distributed_checkpoint.py); _load_from_checkpoint / _load_best_model (resume loads the weights
#    through from_pretrained's conversion, transformers#48805); _clip_grad_norm (PR2 clips its predictors by their own
#    norm).
# ---------------------------------------------------------------------------------------------------------------
TRAINER_PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_save_optimizer_and_scheduler": ("self", "output_dir"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_best_model": ("self",),
    "_clip_grad_norm": ("self", "model"),
    "_get_output_dir": ("self", "trial"),
}
TRAINER_METHODS = entry(
    "trainer_private_methods",
    "transformers",
    "5.24.0",
    ("5.24.0", "5.25.0"),
    inherited=tuple(name for name in TRAINER_PRIVATE_METHODS if name != "_get_output_dir"),
)


def checkpoint_run_dir(trainer: Any, trial: Any) -> str:
    """The directory ``Trainer._save_checkpoint`` writes this run's checkpoints into (entry
    ``trainer_private_methods``)."""
    return trainer._get_output_dir(trial=trial)


# ---------------------------------------------------------------------------------------------------------------
# trainer_end: Trainer.end (transformers 5.18+) finishes the trackers and destroys the process group
#    (accelerator.end_training()); transformers 5.16-5.17 have no end. Both trainers' end() release what they hold
#    (core/trainer_base.py) and then call it through end_trainer, which does what 5.25's Trainer.end does where the
#    method is absent. Read from transformers 5.25.0 (trainer.py, Trainer.end).
# ---------------------------------------------------------------------------------------------------------------
TRAINER_END = entry("trainer_end", "transformers", "5.25.0")


def end_trainer(trainer: Any) -> None:
    """``transformers.Trainer.end`` on ``trainer`` (entry ``trainer_end``); before transformers 5.18, which has no
    ``end``, what it does: ``accelerator.end_training()``."""
    from transformers import Trainer

    end = getattr(Trainer, "end", None)
    if end is None:
        trainer.accelerator.end_training()
    else:
        end(trainer)


# ---------------------------------------------------------------------------------------------------------------
# resume_at_max_steps: Trainer._run_epoch (transformers 5.24) takes each optimizer step's batches with
#    get_batch_samples(epoch_iterator, num_batches, device) before on_step_begin and training_step, and leaves the
#    epoch, then _inner_training_loop the run, when control.should_training_stop is set after a step that had no
#    batch; max_steps is judged only after a step (DefaultFlowCallback.on_step_end), so a run resumed at
#    global_step == max_steps trains one step more. MoEReplayTrainerMixin.get_batch_samples
#    (trl_moe_replay/core/trainer_base.py, checkpoint_weights.stop_if_resumed_complete) answers such a run with no batch and the stop. Checked here
#    by signature; the behaviour by tests/checkpointing/test_checkpoints.py (a resume at max_steps trains nothing).
# ---------------------------------------------------------------------------------------------------------------
RESUME_AT_MAX_STEPS = entry("resume_at_max_steps", "transformers", "5.24.0")


# ---------------------------------------------------------------------------------------------------------------
# keys_ignored_on_save: PreTrainedModel._keys_to_ignore_on_save (a class attribute, None or a set of state-dict
#    names) is what save_pretrained leaves out of the weights it writes. PR2 adds its predictors to it on the model
#    instance (trl_moe_replay/pr2/state.py); resume integrity expects no checkpoint to hold them
#    (trl_moe_replay/checkpointing/checkpoint_weights.py). Read from transformers 5.23.0.
# ---------------------------------------------------------------------------------------------------------------
KEYS_IGNORED_ON_SAVE = entry("keys_ignored_on_save", "transformers", "5.23.0", ("5.23.0", "5.24.0", "5.25.0"))


def keys_ignored_on_save(model: Any) -> set[str]:
    """The state-dict names ``model.save_pretrained`` leaves out (entry ``keys_ignored_on_save``)."""
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def ignore_on_save(model: Any, names: set[str]) -> None:
    """Make ``model.save_pretrained`` leave ``names`` out too (entry ``keys_ignored_on_save``)."""
    model._keys_to_ignore_on_save = keys_ignored_on_save(model) | set(names)


# ---------------------------------------------------------------------------------------------------------------
# saved_weight_layout: core_model_loading.revert_weight_conversion(model, state_dict), which save_pretrained applies
#    to name the weights it writes (fused MoE experts become per-expert weights). Resume integrity checks a
#    checkpoint against it (trl_moe_replay/checkpointing/checkpoint_weights.py); the reload weight sync names vLLM's
#    checkpoint with it. Read from transformers 5.24.0.
# ---------------------------------------------------------------------------------------------------------------
SAVED_WEIGHT_LAYOUT = entry("saved_weight_layout", "transformers", "5.24.0", ("5.24.0", "5.25.0"))


def save_pretrained_weights(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` of ``model`` (or a part of it) under the names and layout ``save_pretrained`` writes (entry
    ``saved_weight_layout``)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)


def saved_weight_layout(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The names, shapes and dtypes ``save_pretrained`` writes for ``state_dict`` of ``model`` (its weights without
    tied duplicates), as meta tensors (entry ``saved_weight_layout``)."""
    return save_pretrained_weights(model, {name: tensor.to("meta") for name, tensor in state_dict.items()})


EXPERT_PARALLEL_FIELDS = frozenset({"ep_size", "ep_implementation", "dp_replicate_size", "fsdp_plan"})


def distributed_config_class() -> type | None:
    """transformers' ``DistributedConfig`` where it has the expert parallelism this package drives (the fields
    ``ep_size``, ``ep_implementation``, ``dp_replicate_size`` and ``fsdp_plan``: transformers 5.23 on), else None.

    transformers 5.16 has no ``transformers.distributed``; 5.17-5.22 have a ``DistributedConfig`` with ``ep_size`` but
    none of the rest (no ``EPImplementationInterface``, no ``ALL_FSDP_STYLES``). This one test decides both where
    expert parallelism is refused in one line (``parallel/expert_parallel.py``) and where the entries below
    (``sharded_at_load_resume``, ``parallel_plan_styles``, ``ep_implementations``) apply, so a transformers without
    it trains everything else."""
    import dataclasses

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return None
    names = (
        {f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig) else ()
    )
    return DistributedConfig if EXPERT_PARALLEL_FIELDS <= names else None


# ---------------------------------------------------------------------------------------------------------------
# sharded_at_load_resume: transformers' Trainer and a model sharded at load time (`from_pretrained(distributed_config=
#    ...)`, expert parallelism), read from transformers 5.24.0 (trainer.py).
#    Trainer.__init__ raises "Resuming is not supported for models sharded at load time" when
#    `self.is_distributed_loading_by_transformers and args.save_strategy != SaveStrategy.NO and not
#    args.save_only_model`, and reads args.save_only_model nowhere else in __init__ for such a model (its other uses
#    need DeepSpeed or accelerate's FSDP, which such a model is not). Trainer._save_checkpoint saves the optimizer,
#    scheduler, scaler and RNG states `if not self.args.save_only_model`, through _save_optimizer_and_scheduler
#    (overridden: trl_moe_replay/checkpointing/distributed_checkpoint.py saves the shards with torch's distributed
#    checkpoint), and _load_optimizer_and_scheduler reads them back (overridden likewise). So the refusal is lifted by
#    setting save_only_model for the duration of __init__ only (lift_sharded_resume_refusal).
#    transformers.distributed.checkpoint._redistribute_state_dict(state_dict, reference_state_dict): strided DTensor
#    shards to plain ones before a DCP save or load, and back (dcp_placements). Checked by signature here; the lift
#    itself is exercised by tests/parallel/test_expert_parallel.py (a save, a stop and an exact resume on an EP model).
# ---------------------------------------------------------------------------------------------------------------
SHARDED_AT_LOAD_RESUME = entry("sharded_at_load_resume", "transformers", "5.24.0")


@contextlib.contextmanager
def lift_sharded_resume_refusal(args: Any) -> Iterator[None]:
    """Around ``Trainer.__init__``, ``args.save_only_model`` as True when checkpoints are saved, then the user's value
    again (the optimizer state is saved and restored by our distributed checkpoint; entry ``sharded_at_load_resume``)."""
    saved = args.save_only_model
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
        args.save_only_model = True
    try:
        yield
    finally:
        args.save_only_model = saved


def dcp_placements(state_dict: dict, reference: dict | None = None) -> dict:
    """``state_dict`` with DTensors in strided shards (experts sharded over the expert-FSDP and EP dimensions)
    redistributed to plain shards, which torch's distributed checkpoint describes correctly; with ``reference``, back
    to the placements of ``reference``'s DTensors after a load. transformers' own workaround for its DCP saves (entry
    ``sharded_at_load_resume``)."""
    from transformers.distributed.checkpoint import _redistribute_state_dict

    return _redistribute_state_dict(state_dict, reference_state_dict=reference)


# ---------------------------------------------------------------------------------------------------------------
# parallel_plan_styles: the styles a DistributedConfig plan may name (expert_parallel.check_parallel_sizes).
#    transformers checks a plan's styles only once the model is built, inside from_pretrained on every rank
#    (PreTrainedModel._validate_parallel_plan): tp_plan and ep_plan name styles of
#    transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES (registered when tensor_parallel and expert_parallel
#    are imported; ep_plan's "moe_tp_experts" is refused there as a TP style), fsdp_plan one of
#    transformers.distributed.fsdp.ALL_FSDP_STYLES.
# ---------------------------------------------------------------------------------------------------------------
PARALLEL_PLAN_STYLES = entry("parallel_plan_styles", "transformers", "5.24.0", ("5.24.0", "5.25.0"))


def parallel_plan_styles() -> dict[str, frozenset[str]]:
    """``{"tp_plan": styles, "ep_plan": styles, "fsdp_plan": styles}`` the installed transformers can apply (entry
    ``parallel_plan_styles``)."""
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the EP styles)
    import transformers.distributed.tensor_parallel  # noqa: F401  (registers the TP styles)
    from transformers.distributed.fsdp import ALL_FSDP_STYLES
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    styles = frozenset(ALL_PARALLEL_STYLES.valid_keys())
    return {"tp_plan": styles, "ep_plan": styles - {"moe_tp_experts"}, "fsdp_plan": frozenset(ALL_FSDP_STYLES)}


# tp_sharded_parameters: what the tensor-parallel plan of a model type shards (trl_moe_replay/cli/plan.py's arithmetic).
#    The plan is the model's (PreTrainedModel.tp_plan, read on 5.25: the config's base_model_tp_plan, the model
#    class's own entries such as lm_head, and from 5.25 embed_tokens added as embedding_rowwise); a parameter takes
#    the style named for it or for its module (transformers.distributed.parallel_utils._get_parameter_plan), and a
#    style shards parameters when its class implements shard_param (ColwiseParallel, RowwiseParallel's weight,
#    EmbeddingParallel, the packed styles; not the replicated ones). In 5.25 the MoE models' plans leave the routed
#    experts out: at tp_size > 1 without EP every GPU of a TP group holds them whole. Same entry as the styles.
TP_SAMPLE_SIZES = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    moe_intermediate_size=16,
    vocab_size=128,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def tp_sharded_parameters(model_type: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """``(names, sharded)``: the parameter names of a small ``model_type`` model built on the meta device (layer
    numbers as ``*``; layer 0 a dense MLP layer where the type has them), and those its TP plan shards (entry
    ``parallel_plan_styles``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    parallel_plan_styles()  # registers the styles
    config = AutoConfig.for_model(model_type)
    for key, value in TP_SAMPLE_SIZES.items():
        if hasattr(config, key):
            setattr(config, key, value)
    for key in _EXPERT_COUNTS:
        if getattr(config, key, None):
            setattr(config, key, 4)
    if getattr(config, "shared_expert_intermediate_size", None):
        config.shared_expert_intermediate_size = 16
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = [0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = model.tp_plan

    def shards(name: str) -> bool:
        style = plan.get(name)
        if style is None and "." in name:
            style = plan.get(name.rsplit(".", 1)[0])
        return (
            style is not None and type(ALL_PARALLEL_STYLES[style]).shard_param is not TensorParallelLayer.shard_param
        )

    names = tuple(dict.fromkeys(replace_layer_number_by_wildcard(n) for n, _ in model.named_parameters()))
    return names, frozenset(n for n in names if shards(n))


# ---------------------------------------------------------------------------------------------------------------
# ep_implementations: the names DistributedConfig.ep_implementation may take (the registry
#    transformers.distributed.expert_parallel.EPImplementationInterface, a mapping), and how each trains. transformers
#    reads the name only inside from_pretrained, on every rank, once the model is built
#    (EpDispatchExpertsParallel.install_forward: "names no registered implementation"), and an implementation whose
#    class sets needs_shared_batch (all_reduce, deepgemm_megamoe) raises in its __init__ there unless every rank of the
#    expert group holds the same batch, i.e. the expert group is the tensor-parallel group (ep_size == tp_size).
#    deepgemm_megamoe's kernel has no backward ("runs at inference only"): a training forward through it cannot run.
#    All of it applies only when ep_size > 1 (expert parallelism applied at all).
# ---------------------------------------------------------------------------------------------------------------
EP_IMPLEMENTATIONS = entry("ep_implementations", "transformers", "5.24.0")
_EP_INFERENCE_ONLY = frozenset({"deepgemm_megamoe"})


def ep_implementations() -> dict[str, tuple[bool, bool]]:
    """``{name: (whether it needs ep_size == tp_size, whether it trains)}`` of the ``ep_implementation`` values the
    installed transformers runs (entry ``ep_implementations``)."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    return {
        name: (bool(getattr(implementation, "needs_shared_batch", False)), name not in _EP_INFERENCE_ONLY)
        for name, implementation in EPImplementationInterface().items()
    }


def _check_ep_implementations() -> list[Finding]:
    if distributed_config_class() is None:  # no expert parallelism to drive (5.16-5.22): refused in one line there
        return []
    try:
        known = ep_implementations()
    except (ImportError, AttributeError, TypeError) as exc:
        return [Finding(EP_IMPLEMENTATIONS, f"the EP implementation registry cannot be read ({exc})")]
    expected = {"auto": (False, True), "all_to_all": (False, True), "all_reduce": (True, True)}
    if any(known.get(name) != value for name, value in expected.items()):
        return [Finding(EP_IMPLEMENTATIONS, f"the EP implementations are {known}, not {expected} and more")]
    return []


def _check_parallel_plan_styles() -> list[Finding]:
    if distributed_config_class() is None:  # no expert parallelism to drive (5.16-5.22): refused in one line there
        return []
    try:
        styles = parallel_plan_styles()
    except (ImportError, AttributeError) as exc:
        return [Finding(PARALLEL_PLAN_STYLES, f"the plan style registries cannot be read ({exc})")]
    missing = {"ep_dispatch_experts", "grouped_gemm", "colwise"} - styles["tp_plan"]
    if missing or "free_full_weight" not in styles["fsdp_plan"]:
        return [Finding(PARALLEL_PLAN_STYLES, f"the plan styles lack {sorted(missing) or ['free_full_weight']}")]
    return []


def _check_sharded_at_load_resume() -> list[Finding]:
    if distributed_config_class() is None:  # no expert parallelism to drive (5.16-5.22): refused in one line there
        return []
    from transformers.distributed import checkpoint

    redistribute = getattr(checkpoint, "_redistribute_state_dict", None)
    have = tuple(inspect.signature(redistribute).parameters) if callable(redistribute) else None
    if have != ("state_dict", "reference_state_dict"):
        return [
            Finding(
                SHARDED_AT_LOAD_RESUME,
                "transformers.distributed.checkpoint._redistribute_state_dict"
                f"(state_dict, reference_state_dict) became {have}",
            )
        ]
    return []


def check_transformers(trainer_class: type | None = None) -> tuple[Finding, ...]:
    """The entries above against the installed transformers: the signatures of the private methods
    ``trainer_class`` (default ``transformers.Trainer``) inherits, and the names that must exist."""
    from transformers import PreTrainedModel, Trainer, core_model_loading

    findings = [
        finding
        for name, params in TRAINER_PRIVATE_METHODS.items()
        if (finding := method_finding(TRAINER_METHODS, trainer_class or Trainer, "Trainer", name, params))
    ]
    if "_keys_to_ignore_on_save" not in vars(PreTrainedModel):
        findings.append(Finding(KEYS_IGNORED_ON_SAVE, "PreTrainedModel._keys_to_ignore_on_save no longer exists"))
    revert = getattr(core_model_loading, "revert_weight_conversion", None)
    have = tuple(inspect.signature(revert).parameters) if callable(revert) else None
    if have != ("model", "state_dict"):
        findings.append(
            Finding(
                SAVED_WEIGHT_LAYOUT, f"core_model_loading.revert_weight_conversion(model, state_dict) became {have}"
            )
        )
    if hasattr(Trainer, "end") and (
        finding := method_finding(TRAINER_END, Trainer, "Trainer", "end", ("self",), exact=True)
    ):
        findings.append(finding)
    if finding := method_finding(
        RESUME_AT_MAX_STEPS,
        trainer_class or Trainer,
        "Trainer",
        "get_batch_samples",
        ("self", "epoch_iterator", "num_batches", "device"),
        exact=True,
    ):
        findings.append(finding)
    findings += _check_sharded_at_load_resume()
    findings += _check_parallel_plan_styles()
    findings += _check_ep_implementations()
    return tuple(findings)
