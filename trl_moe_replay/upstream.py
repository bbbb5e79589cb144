"""Everything this package relies on in TRL beyond its public API, in one place.

``MoEReplayGRPOTrainer`` subclasses ``trl.GRPOTrainer`` and overrides some of its private methods; a few behaviours
also depend on how TRL's code is written inside them. Each such dependency is one entry below, with the TRL file it
was read from (TRL 1.16.0 throughout, :data:`TRL_READ`), and :data:`VERIFIED_ON` lists the TRL versions each entry
was verified on (``check_trl`` clean and the test suite green). :func:`check_trl` verifies every entry against the
installed TRL (signatures, and where an entry depends on the order or form of TRL's code, that code) and the
trainer calls it when it is built: an upstream change fails loudly, naming the entry, instead of training silently
wrong. ``tests/test_upstream.py`` runs the same checks in CI.

vLLM's private names live in ``trl_moe_replay_vllm_plugin`` (the CPU capture plugin, a separate package that vLLM
loads in its own processes, meant to be proposed upstream as is); every other use of vLLM goes through TRL or vLLM's
public API.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import trl
from trl import GRPOTrainer

TRL_READ = "1.16.0"
"""The TRL version every entry below was read from."""

TRL_RANGE = ">=1.16.0,<1.17"
"""The TRL versions this package declares (pyproject.toml); a TRL inside it passes :func:`check_trl`."""

_ALL_ENTRIES = ("1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16")
VERIFIED_ON: dict[str, tuple[str, ...]] = {entry: ("1.16.0",) for entry in _ALL_ENTRIES}
"""TRL versions each entry was verified on. (TRL 1.15.0 fails entry 15 and its GRPO needs Triton; 1.14.2 fails
entry 1 as well: see docs/install.md. The transformers entries T1 and T2, in routing/transformers_seam.py, list the
transformers versions they were verified on.)
Run ``python scripts/check_trl_tree.py PATH`` against a TRL checkout before adding a version here."""


class UpstreamChangedError(RuntimeError):
    """The installed TRL no longer matches what this package relies on (see :func:`check_trl`)."""


# ---------------------------------------------------------------------------------------------------------------
# 1. Private GRPOTrainer methods the trainer overrides, with the parameters it relies on
#    (trl/trainer/grpo_trainer.py). An override forwards these by name, so a renamed or reordered parameter must
#    fail here rather than shift arguments.
# ---------------------------------------------------------------------------------------------------------------
OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations",
                              "has_tool_images"),
    "_generate": ("self", "prompts"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_get_per_token_logps_and_entropies": ("self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                           "batch_size", "compute_entropy", "compute_aux_loss"),
    "_compute_loss": ("self", "model", "inputs"),
    "get_gamma_weights": ("advantages", "log_ratio_per_token", "mask", "importance_sampling_ratio"),
    # PR2 checkpoints its predictors next to the Trainer's own files
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    # transformers.Trainer's: resume loads the weights through from_pretrained's conversion (transformers#48805)
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_best_model": ("self",),
    # transformers.Trainer's: PR2 clips its predictors by their own norm (trl_moe_replay/trainer/grpo_trainer.py)
    "_clip_grad_norm": ("self", "model"),
}

# Private attributes of GRPOTrainer the package reads or writes (set in GRPOTrainer.__init__):
#   _metrics[mode][name]: TRL's metric lists, averaged by GRPOTrainer.log (the way TRL trainers log);
#   _tokenizer: the tokenizer behind processing_class (pad token id); pad_to_multiple_of: TRL's padding multiple;
#   vllm_generation: TRL's VLLMGeneration (use_vllm=True).
PRIVATE_ATTRIBUTES = ("_metrics", "_tokenizer")


def trl_padded_width(lengths: Sequence[int], pad_to_multiple_of: int | None) -> int:
    """The width ``_generate_and_score_completions`` pads a batch of ``lengths`` to: ``trl.trainer.utils.pad``'s rule,
    the longest, rounded up to ``pad_to_multiple_of`` (the routes are aligned to it right after generation; the
    forwards compare, O(1)). Checked by behaviour against TRL's ``pad``."""
    width = max(lengths, default=0)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    return width


# ---------------------------------------------------------------------------------------------------------------
# 2. TRL's engine log-prob correction is keyed on `use_vllm`.
#    GRPOTrainer._generate_and_score_completions runs its old-logprob pass, computes the importance-sampling ratio
#    against the sampler's log-probs and logs sampling/* when `self.use_vllm and
#    self.vllm_importance_sampling_correction`; _compute_loss multiplies the loss by that ratio under the same
#    condition. On the transformers generation path our recorder supplies the sampler's log-probs exactly as vLLM
#    does, so `transformers_importance_sampling_correction` makes TRL apply the same correction by answering True
#    there: during scoring (after generation) and in the loss, never while generating.
# ---------------------------------------------------------------------------------------------------------------
_ENGINE_CONDITION = "self.use_vllm and self.vllm_importance_sampling_correction"


@contextlib.contextmanager
def engine_logprob_correction(trainer: GRPOTrainer, enabled: bool) -> Iterator[None]:
    """Within the context, TRL applies (``enabled``) or skips its engine log-prob correction on ``trainer``.

    Only the trainer's own ``_generate_and_score_completions`` and ``_compute_loss`` enter it; generation itself is
    run with ``enabled=False`` so TRL's ``_generate_single_turn`` takes the transformers path.
    """
    saved = trainer.use_vllm
    trainer.use_vllm = enabled
    try:
        yield
    finally:
        trainer.use_vllm = saved


# ---------------------------------------------------------------------------------------------------------------
# 3. Telling TRL's two scoring forwards apart.
#    _generate_and_score_completions calls _get_per_token_logps_and_entropies for the old policy with `self.model`,
#    and for the reference policy (beta != 0) with `self.ref_model`, or, for a PEFT model, with `self.model` inside
#    trl.trainer.utils.use_adapter(model, "ref" or None): the adapter named "ref" active, or all adapters disabled.
# ---------------------------------------------------------------------------------------------------------------
def is_reference_forward(trainer: GRPOTrainer, model: Any) -> bool:
    """Whether a scoring forward of ``model`` computes the reference policy's log-probs (else the old policy's)."""
    if trainer.ref_model is not None:
        return model is trainer.ref_model
    unwrapped = trainer.accelerator.unwrap_model(model)
    if not hasattr(unwrapped, "peft_config"):
        return False  # no PEFT, no ref model: beta == 0, there is no reference pass
    if "ref" in unwrapped.peft_config and unwrapped.active_adapter == "ref":
        return True
    return _adapters_disabled(unwrapped)


def _adapters_disabled(peft_model: Any) -> bool:
    """PEFT's ``disable_adapter()`` context: every tuner layer reports ``disable_adapters`` (a public property)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in peft_model.modules() if isinstance(module, BaseTunerLayer)]
    return bool(layers) and all(layer.disable_adapters for layer in layers)


# ---------------------------------------------------------------------------------------------------------------
# 4. The loss branch.
#    GRPOTrainer.__init__ copies args.loss_type to self.loss_type, and _compute_loss branches on self.loss_type.
#    Our loss names run on a TRL branch: gspo/rspo on "grpo" (with sequence-level ratios, as TRL's docs reproduce
#    GSPO), minirl on "vespo" (see 6).
# ---------------------------------------------------------------------------------------------------------------
def run_loss_on_trl_branch(trainer: GRPOTrainer, trl_loss_type: str) -> None:
    """Make ``_compute_loss`` take TRL's ``trl_loss_type`` branch (``args.loss_type`` keeps the user's name)."""
    trainer.loss_type = trl_loss_type


# ---------------------------------------------------------------------------------------------------------------
# 5. The router-shift weight γ reaches TRL's ratio through the old log-probs.
#    _compute_loss runs the training forward (_get_per_token_logps_and_entropies) *before* it reads
#    inputs["old_per_token_logps"], and forms every ratio from per_token_logps - old_per_token_logps. So old
#    log-probs shifted by -log γ, placed in the micro-batch during the forward, give γ·ratio to every loss type.
# ---------------------------------------------------------------------------------------------------------------
def set_old_logps_for_loss(inputs: dict, old_per_token_logps: Any) -> None:
    """Place the old log-probs TRL's ``_compute_loss`` will read after the training forward (entry 5)."""
    inputs["old_per_token_logps"] = old_per_token_logps


# ---------------------------------------------------------------------------------------------------------------
# 6. MiniRL on TRL's "vespo" branch.
#    _compute_loss's vespo branch is `per_token_loss = -phi_seq * advantages * per_token_logps` with
#    `phi_seq = self.get_gamma_weights(advantages=..., log_ratio_per_token=log_ratio, mask=...,
#    importance_sampling_ratio=..., ...)`, skips the engine importance-sampling factor (`loss_type != "vespo"`),
#    and normalises by the batch's loss-token count like dapo. MiniRL's per-token loss is exactly that form with
#    phi = sg[M_t · min(π_θ/μ, C)], so the trainer overrides get_gamma_weights (a static method called through
#    self) and TRL's code does the rest: forward, masks, KL, aggregation, aux loss, metrics.
# ---------------------------------------------------------------------------------------------------------------
MINIRL_TRL_BRANCH = "vespo"


# ---------------------------------------------------------------------------------------------------------------
# 7. vLLM server mode: the routes in TRL's client responses (trl/generation/vllm_client.py).
#    VLLMClient keeps its HTTP session in the public attribute `session` (a requests.Session) and posts every
#    request through it; VLLMClient.generate sends one POST /v1/completions and reads "choices" in completion
#    order. A requests response hook (a supported requests mechanism) sees each response.
# ---------------------------------------------------------------------------------------------------------------
def client_session(vllm_client: Any) -> Any:
    """The ``requests.Session`` TRL's ``VLLMClient`` sends its requests through."""
    return vllm_client.session


# ---------------------------------------------------------------------------------------------------------------
# 8. The vLLM classes TRL builds (trl/generation/vllm_generation.py).
#    VLLMGeneration._init_vllm builds, from module-global names, `VLLMClient(...)` then `init_communicator(...)`
#    (server mode, main process), or `LLM(...)` with a fixed argument list (no pass-through) and
#    distributed_executor_backend="external_launcher" (colocate); VLLMGeneration.generate calls
#    `self.llm.generate(...)` and keeps only token ids and log-probs from the returned RequestOutputs. To get
#    `enable_return_routed_experts=True` and the outputs (colocate), or a client without TRL's NCCL communicator
#    (server mode, weight sync by vLLM's reload), the classes are chosen at construction: the trainer builds TRL's
#    VLLMGeneration while those names refer to subclasses.
# ---------------------------------------------------------------------------------------------------------------
_VLLM_GENERATION_MODULE = "trl.generation.vllm_generation"


@contextlib.contextmanager
def vllm_generation_classes(**make_subclass: Callable[[type], type]) -> Iterator[None]:
    """While the trainer builds TRL's ``VLLMGeneration``, each module-global name given (``LLM``, ``VLLMClient``)
    is ``make_subclass(original)``. Without vLLM installed ``LLM`` does not exist; TRL then raises its own error."""
    module = importlib.import_module(_VLLM_GENERATION_MODULE)
    saved = {name: getattr(module, name, None) for name in make_subclass}
    for name, make in make_subclass.items():
        if saved[name] is not None:
            setattr(module, name, make(saved[name]))
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is not None:
                setattr(module, name, original)


# ---------------------------------------------------------------------------------------------------------------
# 9. Per-request fields of TRL's vLLM requests (trl/generation/vllm_generation.py).
#    VLLMGeneration.generate merges its `generation_kwargs` attribute (GRPOConfig.generation_kwargs) into every
#    request: the /v1/completions body (server mode, through VLLMClient.generate) or SamplingParams (colocate).
#    A later tool turn asks vLLM (`routed_experts_prompt_start`) not to resend the routes of the prefix it holds.
# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def vllm_request_fields(vllm_generation: Any, **fields: Any) -> Iterator[None]:
    """Within the context, TRL's vLLM requests also carry ``fields``."""
    saved = vllm_generation.generation_kwargs
    vllm_generation.generation_kwargs = {**saved, **fields}
    try:
        yield
    finally:
        vllm_generation.generation_kwargs = saved


# ---------------------------------------------------------------------------------------------------------------
# 10. Parameters vLLM's model does not have (PR2's predictors, registered in the trained model).
#    Both VLLMGeneration.sync_weights paths (server metadata and transfer, colocate load_weights) read the
#    parameters through the one iterator VLLMGeneration._iter_named_params (gathering each under DeepSpeed/FSDP,
#    mapping names to vLLM's); vLLM's load_weights rejects unknown names. The iterator is filtered on this
#    instance; every parameter is still walked, so the gathers stay collective.
# ---------------------------------------------------------------------------------------------------------------
def exclude_from_weight_sync(vllm_generation: Any, skip: Callable[[str], bool]) -> None:
    """Leave the parameters whose vLLM name satisfies ``skip`` out of TRL's weight sync to vLLM."""
    iterate = vllm_generation._iter_named_params

    def without_skipped():
        for name, param in iterate():
            if not skip(name):
                yield name, param

    vllm_generation._iter_named_params = without_skipped


# ---------------------------------------------------------------------------------------------------------------
# 12. When TRL syncs vLLM's weights, and how it reads them.
#    GRPOTrainer._generate_single_turn (vLLM) and _generate (rollout_func) call self.vllm_generation.sync_weights()
#    when `self.state.global_step != self._last_loaded_step`, then set _last_loaded_step: a sync the trainer does
#    first (vLLM's reload, `vllm_weight_sync="reload"`) and records there replaces TRL's. It reads the parameters as
#    TRL's sync would, through VLLMGeneration._iter_named_params (gathered under DeepSpeed/FSDP, PEFT merged, vLLM
#    names), and wakes sleeping colocated weights first as TRL does (`_llm_weights_sleeping`).
# ---------------------------------------------------------------------------------------------------------------
def vllm_weights_stale(trainer: GRPOTrainer) -> bool:
    """Whether TRL would sync vLLM's weights before the next generation."""
    return trainer.state.global_step != trainer._last_loaded_step


def mark_vllm_weights_synced(trainer: GRPOTrainer) -> None:
    """Record that vLLM holds the weights of the current step (TRL then skips its own sync)."""
    trainer._last_loaded_step = trainer.state.global_step


def trl_named_params(vllm_generation: Any) -> Iterator[tuple[str, Any]]:
    """The parameters TRL's sync would send, one at a time, gathered and named as it names them."""
    return vllm_generation._iter_named_params()


def wake_colocated_weights(vllm_generation: Any) -> None:
    """Before loading into a sleeping colocated engine (``vllm_enable_sleep_mode``), as TRL's sync does."""
    if vllm_generation.mode == "colocate" and vllm_generation.enable_sleep_mode:
        vllm_generation.llm.wake_up(tags=["weights"])
        vllm_generation._llm_weights_sleeping = False


# ---------------------------------------------------------------------------------------------------------------
# 13. TRL's VLLMClient as a plain HTTP client (trl/generation/vllm_client.py).
#    VLLMClient.__init__ refuses to build unless `is_vllm_available()` (its module-global name) answers True,
#    although generation through it is only HTTP (the weight-transfer communicator, which needs vLLM, is opened
#    separately). `trl-moe-replay audit --vllm_server_url` samples through it from a machine without vLLM.
# ---------------------------------------------------------------------------------------------------------------
def http_vllm_client(base_url: str, **kwargs: Any) -> Any:
    """TRL's ``VLLMClient`` for ``base_url``, built whether or not vLLM is installed on this machine."""
    from trl.generation import vllm_client

    saved = vllm_client.is_vllm_available
    vllm_client.is_vllm_available = lambda *args, **kw: True
    try:
        return vllm_client.VLLMClient(base_url=base_url, **kwargs)
    finally:
        vllm_client.is_vllm_available = saved


# ---------------------------------------------------------------------------------------------------------------
# 14. How TRL's tool loop renders a tool turn (trl/trainer/grpo_trainer.py), mirrored by the offline cold start.
#    trl_moe_replay.extras.math.cold_start teaches the tiny demo model tool calls with sequences built as TRL 1.16's
#    _tool_call_loop builds them at train time: `prompt + completion + _get_tool_suffix_ids(tool_messages)`, the
#    suffix cut from a dummy conversation after its last EOS, and a failing tool's result `{"error": str(e)}`.
#    (tests/test_tool_recipe.py checks a real trainer run against the cold start's sequences token for token.)
# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# 15. Public TRL APIs this package calls that a TRL still matching entries 1-14 may lack: public, but not in every
#    TRL release, so they are checked like the private ones (TRL 1.15.0 has neither).
#    VLLMClient.get_server_info() (trl/generation/vllm_client.py): `trl-moe-replay audit` and the fake vLLM server
#    read the server's configuration; parse_response(tokenizer, ids, prefix=..., tools=...)
#    (trl/chat_template_utils.py): the math cold start parses tool calls as TRL's tool loop does;
#    disable_gradient_checkpointing(model, gradient_checkpointing_kwargs) (trl/models/utils.py): the routing metrics'
#    own no-grad forward (MoEReplayGRPOTrainer._metrics_pass) runs like TRL's old-logprob pass.
# ---------------------------------------------------------------------------------------------------------------
PUBLIC_APIS: dict[str, tuple[str, tuple[str, ...]]] = {
    "VLLMClient.get_server_info": ("trl.generation.vllm_client", ("self",)),
    "parse_response": ("trl.chat_template_utils", ("tokenizer", "ids", "prefix", "tools")),
    "disable_gradient_checkpointing": ("trl.models.utils", ("model", "gradient_checkpointing_kwargs")),
}


def _check_public_apis() -> list[Finding]:
    findings = []
    for qualified, (module_name, params) in PUBLIC_APIS.items():
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            obj = None
        for part in qualified.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            findings.append(Finding("15", f"{module_name}.{qualified} does not exist"))
            continue
        have = tuple(inspect.signature(obj).parameters)
        missing = [p for p in params if p not in have]
        if missing:
            findings.append(Finding("15", f"{module_name}.{qualified}{have} lacks the parameter(s) {missing}"))
    return findings


# ---------------------------------------------------------------------------------------------------------------
# 11. transformers and torch private names (PR2's predictors as model parameters; trl_moe_replay/trainer/pr2.py and
#    grpo_trainer.py)
#    (Trainer._clip_grad_norm, overridden, is checked with entry 1's methods)
#    PreTrainedModel._keys_to_ignore_on_save: save_model() leaves the predictors out;
#    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names): DDP leaves them alone
#    (the trainer averages their gradients itself). Read from transformers 5.23.0 and torch 2.13.0.
#    Resume integrity (trl_moe_replay/trainer/checkpoint_weights.py): core_model_loading.revert_weight_conversion(
#    model, state_dict), what save_pretrained applies to name the weights it writes (saved_weight_layout below), read
#    from transformers 5.24.0; Trainer._load_best_model (overridden, checked with entry 1's methods).
# ---------------------------------------------------------------------------------------------------------------
TRANSFORMERS_READ = "5.23.0"


# ---------------------------------------------------------------------------------------------------------------
# T1, T2. transformers internals RouterReplay relies on (the decoder stack's KV cache keyword, each router's output
#    order) are entries of the transformers half of this seam, trl_moe_replay/routing/transformers_seam.py (the
#    routing package may not import TRL, so they live there); they fail by entry name the same way.
# ---------------------------------------------------------------------------------------------------------------


def check_transformers_and_torch() -> tuple[Finding, ...]:
    """Entry 11 against the installed transformers and torch."""
    import torch
    from transformers import PreTrainedModel

    findings = []
    if "_keys_to_ignore_on_save" not in vars(PreTrainedModel):
        findings.append(Finding("11", "PreTrainedModel._keys_to_ignore_on_save no longer exists"))
    if not callable(getattr(torch.nn.parallel.DistributedDataParallel,
                            "_set_params_and_buffers_to_ignore_for_model", None)):
        findings.append(Finding("11", "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model is gone"))
    from transformers import core_model_loading

    have = tuple(inspect.signature(core_model_loading.revert_weight_conversion).parameters)
    if have != ("model", "state_dict"):
        findings.append(Finding("11", f"core_model_loading.revert_weight_conversion(model, state_dict) became {have}"))
    return tuple(findings)


def saved_weight_layout(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Entry 11: the names, shapes and dtypes ``save_pretrained`` writes for ``state_dict`` of ``model`` (its
    weights without tied duplicates), as meta tensors: transformers' own reverse of its weight conversion (fused MoE
    experts become per-expert weights), which ``save_pretrained`` applies. Resume integrity checks a checkpoint
    against it (trl_moe_replay/trainer/checkpoint_weights.py)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {name: tensor.to("meta") for name, tensor in state_dict.items()})


# ---------------------------------------------------------------------------------------------------------------
# 16. TRL's experimental AsyncGRPOTrainer (trl/experimental/async_grpo/, read from TRL 1.16.0: TRL_READ), used by
#    MoEReplayAsyncGRPOTrainer (trl_moe_replay/async_grpo/async_grpo_trainer.py) and async_grpo/async_rollout_worker.py:
#    - async_rollout_worker: _AsyncRolloutLoop (subclassed: _post(path, payload, timeout, max_retries) returns the whole
#      response JSON, _generate_one(prompt, tool_dict, tools, group_id) returns the conversation's TrainingSequence rows
#      at index 2, _score_group(group) emits one RolloutSample per row of group.completions_sequences in order,
#      _retry(coro_factory, *, label, max_attempts), _counters/_rates, model_version); AsyncRolloutWorker._loop_cls,
#      ._process, ._failed_event, ._stop_event_mp (our stop() sets it itself), ._heartbeat_value,
#      ._model_version_value (mp.Values with their default RLock),
#      ._loop_kwargs (forwarded to the loop: max_request_attempts); RolloutSample (a slots dataclass, subclassed).
#    - async_grpo_trainer: the module globals AsyncRolloutWorker (built by __init__), TreeRow (built by the batchers),
#      get_peak_flops_per_device (called by __init__; it asks CUDA for the device name), RolloutQueueDataset,
#      FixedCountBatcher, TokenBudgetBatcher and DataCollatorForRollout (built by get_train_dataloader); RolloutQueueDataset.__iter__
#      yields right after its last `self.queue.get(`, and the dataset keeps .model_version_fn and .metrics (the
#      trainer's metric sink); compute_loss strips the collator's padding with
#      inputs["attention_mask"]; _sync_weight publishes the weights and bumps model_version.
#      AsyncGRPOTrainer._lora_sync: whether __init__ chose adapter-only vLLM sync (a PEFT model and a server started
#      with --enable-lora) instead of merged weights.
#    - packing: TreeRow.fits/add key the trie on (token, next token) (our RoutedTreeRow adds the route), pack() lays
#      nodes out in DFS pre-order; tree_attention looks the module global _flash_attn up at call time (FA3 through
#      kernels.get_kernel; replaced on CPU).
# ---------------------------------------------------------------------------------------------------------------
ASYNC_PACKAGE = "trl.experimental.async_grpo"


def _async_module(name: str) -> Any:
    return importlib.import_module(f"{ASYNC_PACKAGE}.{name}")


def async_worker_classes() -> tuple[type, type, type]:
    """``(_AsyncRolloutLoop, AsyncRolloutWorker, RolloutSample)`` of TRL's async rollout worker."""
    worker = _async_module("async_rollout_worker")
    return worker._AsyncRolloutLoop, worker.AsyncRolloutWorker, worker.RolloutSample


def async_tree_row_class() -> type:
    return _async_module("packing").TreeRow


@contextlib.contextmanager
def async_trainer_globals(**values: Any) -> Iterator[None]:
    """Within the context, the async trainer module's globals ``values`` (``AsyncRolloutWorker``, ``TreeRow``,
    ``get_peak_flops_per_device``) are replaced; restored on exit."""
    module = _async_module("async_grpo_trainer")
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def async_adapter_only_sync(trainer: Any) -> bool:
    """Whether TRL's async trainer syncs a LoRA adapter to vLLM as an adapter (``--enable-lora``), not merged."""
    return bool(getattr(trainer, "_lora_sync", False))


@contextlib.contextmanager
def tree_attention_kernel(kernel: Any) -> Iterator[None]:
    """Within the context, TRL's packed tree attention calls ``kernel.flash_attn_varlen_func`` instead of
    FlashAttention-3; TRL's kernel lookup is restored on exit."""
    packing = _async_module("packing")
    saved = packing._flash_attn
    packing._flash_attn = lambda: kernel
    try:
        yield
    finally:
        packing._flash_attn = saved


def check_async_trl() -> tuple[Finding, ...]:
    """Entry 15 against the installed TRL."""
    findings: list[Finding] = []

    def expect(condition: bool, problem: str) -> None:
        if not condition:
            findings.append(Finding("16", problem))

    worker = _async_module("async_rollout_worker")
    trainer = _async_module("async_grpo_trainer")
    packing = _async_module("packing")
    loop = worker._AsyncRolloutLoop
    signatures = {
        "_post": ("self", "path", "payload", "timeout", "max_retries"),
        "_generate_one": ("self", "prompt", "tool_dict", "tools", "group_id"),
        "_score_group": ("self", "group"),
        "_retry": ("self", "coro_factory", "label", "max_attempts"),
    }
    for name, params in signatures.items():
        have = tuple(inspect.signature(getattr(loop, name)).parameters) if hasattr(loop, name) else None
        expect(have == params, f"_AsyncRolloutLoop.{name}{params} became {have}")
    score = _code_only(_source(loop._score_group))
    expect("for seq in sequences:" in score and "samples.append(" in score,
           "_score_group no longer emits one RolloutSample per training row, in order")
    expect("return content if content else {}" in _code_only(_source(loop._post)),
           "_AsyncRolloutLoop._post no longer returns the whole response JSON")
    expect("return completion, completion_ids, sequences," in _code_only(_source(loop._generate_one)),
           "_AsyncRolloutLoop._generate_one no longer returns the conversation's training rows")
    expect(getattr(worker.AsyncRolloutWorker, "_loop_cls", None) is loop, "AsyncRolloutWorker._loop_cls is gone")
    expect("__slots__" in vars(worker.RolloutSample), "RolloutSample is no longer a slots dataclass")
    expect("self._stop_event_mp = ctx.Event()" in _code_only(_source(worker.AsyncRolloutWorker.__init__)),
           "AsyncRolloutWorker no longer keeps its stop event in _stop_event_mp")
    for name in ("AsyncRolloutWorker", "TreeRow", "get_peak_flops_per_device", "RolloutQueueDataset",
                 "FixedCountBatcher", "TokenBudgetBatcher", "DataCollatorForRollout"):
        expect(hasattr(trainer, name), f"async_grpo_trainer no longer has the module global {name}")
    loader = _code_only(_source(trainer.AsyncGRPOTrainer.get_train_dataloader))
    for built in ("RolloutQueueDataset(", "TokenBudgetBatcher(", "FixedCountBatcher(", "DataCollatorForRollout("):
        expect(built in loader, f"get_train_dataloader no longer builds {built[:-1]} by its module-global name")
    init = _code_only(_source(trainer.AsyncGRPOTrainer.__init__))
    expect("= AsyncRolloutWorker(" in init and "get_peak_flops_per_device(" in init,
           "AsyncGRPOTrainer.__init__ no longer builds AsyncRolloutWorker / calls get_peak_flops_per_device")
    for batcher in (trainer.FixedCountBatcher, trainer.TokenBudgetBatcher):
        expect("TreeRow()" in _code_only(_source(batcher.__iter__)), f"{batcher.__name__} no longer builds TreeRow()")
    dataset_init = _code_only(_source(trainer.RolloutQueueDataset.__init__))
    expect("self.model_version_fn = model_version_fn" in dataset_init and "self.metrics = metrics" in dataset_init,
           "RolloutQueueDataset no longer keeps model_version_fn and metrics")
    iterate = _code_only(_source(trainer.RolloutQueueDataset.__iter__))
    expect(iterate.count("self.queue.get(") == 1 and "yield {" in iterate,
           "RolloutQueueDataset.__iter__ no longer yields the sample it last took with self.queue.get()")
    loss = _code_only(_source(trainer.AsyncGRPOTrainer.compute_loss))
    expect('mask_bool = inputs["attention_mask"].bool()' in loss and 'inputs["input_ids"][mask_bool]' in loss,
           "compute_loss no longer strips the padding with inputs['attention_mask']")
    expect("self._lora_sync = lora_sync" in init and "if self._lora_sync:" in _code_only(
        _source(trainer.AsyncGRPOTrainer._sync_weight)), "AsyncGRPOTrainer no longer decides adapter-only sync in "
           "self._lora_sync")
    expect("self.model_version += 1" in _code_only(_source(trainer.AsyncGRPOTrainer._sync_weight_merged)),
           "_sync_weight_merged no longer bumps model_version")
    for name in ("fits", "add"):
        expect("zip(input_ids, [*input_ids[1:], None], strict=True)" in _code_only(_source(getattr(packing.TreeRow,
               name))), f"TreeRow.{name} no longer keys the trie on (token, next token)")
    expect("_flash_attn().flash_attn_varlen_func(" in _code_only(_source(packing.tree_attention)),
           "tree_attention no longer calls _flash_attn().flash_attn_varlen_func at call time")
    return tuple(findings)


def assert_async_trl_compatible() -> None:
    findings = check_async_trl()
    if findings:
        lines = "\n".join(f"  - {finding}" for finding in findings)
        raise UpstreamChangedError(
            f"trl_moe_replay's async trainer was written against TRL {TRL_READ}'s trl.experimental.async_grpo; the "
            f"installed TRL {trl.__version__} no longer matches it (trl_moe_replay/upstream.py, entry 16):\n{lines}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    entry: str
    problem: str

    def __str__(self) -> str:
        return f"[{self.entry}] {self.problem} (entry verified on TRL {', '.join(VERIFIED_ON.get(self.entry, ()))})"


def _source(obj: Any) -> str:
    return inspect.getsource(obj)


def _code_only(source: str) -> str:
    """Source without comment lines, so a comment that mentions a pattern does not satisfy a check."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))


@functools.lru_cache(maxsize=None)
def check_trl(trainer_class: type = GRPOTrainer) -> tuple[Finding, ...]:
    """Verify every entry above against the installed TRL; returns what no longer holds (empty: all good)."""
    findings: list[Finding] = []

    def expect(entry: str, condition: bool, problem: str) -> None:
        if not condition:
            findings.append(Finding(entry, problem))

    def code(entry: str, owner: Any, *path: str) -> str:
        """The source (comments left out) of owner.path, or "" with a finding when a TRL lacks it."""
        obj = owner
        for name in path:
            obj = getattr(obj, name, None)
        if obj is None:
            if owner is not None:  # else its module is missing, already reported
                findings.append(Finding(entry, f"{getattr(owner, '__name__', owner)}.{'.'.join(path)} does not exist"))
            return ""
        return _code_only(_source(obj))

    def module(entry: str, name: str) -> Any:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            findings.append(Finding(entry, f"cannot import {name}: {error}"))
            return None

    for name, params in OVERRIDDEN_METHODS.items():
        method = getattr(trainer_class, name, None)
        if method is None:
            findings.append(Finding("1", f"GRPOTrainer.{name} no longer exists"))
            continue
        have = tuple(inspect.signature(method).parameters)
        expect("1", have[: len(params)] == params, f"GRPOTrainer.{name}{params} became {name}{have}")
    expect("1", isinstance(inspect.getattr_static(trainer_class, "get_gamma_weights", None), staticmethod),
           "GRPOTrainer.get_gamma_weights is no longer a static method")
    from trl.trainer.utils import pad

    for lengths, multiple in (([3, 5], None), ([3, 5], 4), ([1], 8), ([0, 2], 2)):
        padded = pad([torch.ones(n) for n in lengths], padding_side="left", pad_to_multiple_of=multiple).shape[1]
        expect("1", padded == trl_padded_width(lengths, multiple),
               f"trl.trainer.utils.pad pads {lengths} (multiple {multiple}) to {padded}, not to "
               f"{trl_padded_width(lengths, multiple)} (trl_padded_width)")

    init = code("1", trainer_class, "__init__")
    for attribute in PRIVATE_ATTRIBUTES:
        expect("1", f"self.{attribute} =" in init, f"GRPOTrainer.__init__ no longer sets self.{attribute}")

    scoring = code("2", trainer_class, "_generate_and_score_completions")
    loss = code("2", trainer_class, "_compute_loss")
    expect("2", scoring.count(_ENGINE_CONDITION) >= 3,
           f"_generate_and_score_completions no longer keys its old-logprob pass, importance-sampling ratio and "
           f"metrics on `{_ENGINE_CONDITION}` (found {scoring.count(_ENGINE_CONDITION)} uses, expected >= 3)")
    expect("2", _ENGINE_CONDITION in loss, f"_compute_loss no longer applies the ratio under `{_ENGINE_CONDITION}`")
    generated_at, corrected_at = scoring.find("self._generate("), scoring.find(_ENGINE_CONDITION)
    expect("2", 0 <= generated_at < corrected_at,
           "_generate_and_score_completions no longer generates before it applies the engine correction")
    expect("2", "if self.use_vllm:" in code("2", trainer_class, "_generate_single_turn"),
           "_generate_single_turn no longer chooses vLLM by self.use_vllm")

    ref_calls = re.findall(r"_get_per_token_logps_and_entropies\(\s*self\.(\w+)", scoring)
    expect("3", ref_calls[:1] == ["model"] and "ref_model" in ref_calls,
           f"the scoring forwards are no longer (self.model: old, self.ref_model: reference); found {ref_calls}")
    expect("3", "use_adapter(" in scoring and '"ref"' in scoring,
           "the PEFT reference forward no longer runs inside use_adapter(model, 'ref' or None)")

    expect("4", "self.loss_type = args.loss_type" in init, "__init__ no longer copies args.loss_type to self.loss_type")
    for branch in ("grpo", MINIRL_TRL_BRANCH):
        expect("4", f'"{branch}"' in loss, f"_compute_loss has no {branch!r} branch any more")

    forward_at = loss.find("self._get_per_token_logps_and_entropies(")
    old_read_at = loss.find('inputs.get("old_per_token_logps")')
    expect("5", 0 <= forward_at < old_read_at,
           "_compute_loss no longer reads inputs['old_per_token_logps'] after the training forward")
    expect("5", "log_ratio = per_token_logps - old_per_token_logps" in loss,
           "_compute_loss no longer forms its ratio as per_token_logps - old_per_token_logps")

    vespo = loss[loss.find(f'self.loss_type == "{MINIRL_TRL_BRANCH}"'):]
    expect("6", "self.get_gamma_weights(" in vespo and "per_token_loss = -phi_seq * advantages * per_token_logps"
           in vespo, "the vespo branch is no longer -get_gamma_weights(...) * advantages * per_token_logps")
    expect("6", f'self.loss_type != "{MINIRL_TRL_BRANCH}"' in loss,
           "the vespo branch no longer skips the engine importance-sampling factor")
    expect("6", re.search(r'\["cispo", "dapo", "vespo"\]', loss) is not None,
           "vespo is no longer normalised by the loss-token count like dapo")

    vllm_client = module("7", "trl.generation.vllm_client")
    client_source = code("7", vllm_client, "VLLMClient")
    expect("7", "self.session = requests.Session()" in client_source, "VLLMClient no longer keeps self.session")
    client_init = code("13", vllm_client, "VLLMClient", "__init__")
    expect("13", "if not is_vllm_available():" in client_init and hasattr(vllm_client, "is_vllm_available"),
           "VLLMClient.__init__ no longer checks vLLM through its module's is_vllm_available")
    expect("7", "self.session.post(" in code("7", vllm_client, "VLLMClient", "_post"),
           "VLLMClient._post no longer posts through self.session")
    expect("7", '"/v1/completions"' in code("7", vllm_client, "VLLMClient", "generate").replace(
        "{self.base_url}", ""), "VLLMClient.generate no longer posts to /v1/completions")

    generation = module("8", _VLLM_GENERATION_MODULE)
    init_vllm = code("8", generation, "VLLMGeneration", "_init_vllm")
    expect("8", "= LLM(" in init_vllm, "VLLMGeneration._init_vllm no longer builds the module-global LLM")
    expect("8", "= VLLMClient(" in init_vllm and "self.vllm_client.init_communicator(" in init_vllm,
           "VLLMGeneration._init_vllm no longer builds the module-global VLLMClient and opens its communicator")
    for method in ("_generate_single_turn", "_generate"):
        body = code("12", trainer_class, method)
        expect("12", "self.state.global_step != self._last_loaded_step" in body
               and "self._last_loaded_step = self.state.global_step" in body,
               f"GRPOTrainer.{method} no longer syncs vLLM's weights by _last_loaded_step")
    expect("12", "self._llm_weights_sleeping = False" in code("12", generation, "VLLMGeneration", "sync_weights"),
           "VLLMGeneration.sync_weights no longer wakes sleeping colocated weights")
    vllm_generate = code("8", generation, "VLLMGeneration", "generate")
    expect("8", "self.llm.generate(" in vllm_generate, "VLLMGeneration.generate no longer calls self.llm.generate")
    suffix = code("14", trainer_class, "_get_tool_suffix_ids")
    expect("14", "dummy_messages" in suffix and "eos_positions[-1] + 1" in suffix,
           "GRPOTrainer._get_tool_suffix_ids no longer cuts a dummy conversation after its last EOS")
    expect("14", 'result = {"error": str(e)}' in code("14", trainer_class, "_tool_call_loop")
           and "prompt_ids[idx_with_tool] + completion_ids[idx_with_tool] + suffix_ids"
           in code("14", trainer_class, "_tool_call_loop"),
           "GRPOTrainer._tool_call_loop no longer builds prompt + completion + tool suffix, or reports errors as "
           '{"error": str(e)}')
    sync = code("12", generation, "VLLMGeneration", "sync_weights")
    expect("10", sync.count("self._iter_named_params()") >= 2,
           "VLLMGeneration.sync_weights no longer reads the parameters through self._iter_named_params()")
    expect("9", '"generation_kwargs": self.generation_kwargs' in vllm_generate
           and "generation_kwargs.update(self.generation_kwargs)" in vllm_generate,
           "VLLMGeneration.generate no longer merges self.generation_kwargs into its server and colocate requests")
    findings += _check_public_apis()
    return tuple(findings) + check_transformers_and_torch()


# ---------------------------------------------------------------------------------------------------------------
# Notices from upstream code that a user cannot act on, silenced by their exact text (nothing else is filtered):
# - TRL (trl/models/utils.py: unwrap_model_for_generation, disable_gradient_checkpointing) reads
#   `model.is_gradient_checkpointing`, which transformers deprecates (5.24: a FutureWarning at every generation).
# - accelerate's is_peft_model imports DeepSpeed where it is installed (TRL calls it in GRPOTrainer.__init__), and
#   DeepSpeed then logs "Setting accelerator to CPU" on a machine without a GPU, where the CPU is what trains.
# ---------------------------------------------------------------------------------------------------------------
_DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."


def _not_deepspeed_cpu_notice(record: Any) -> bool:
    return not str(record.msg).startswith(_DEEPSPEED_CPU_NOTICE)


def quiet_upstream_notices() -> None:
    """Silence the notices listed above, and only them (idempotent)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module="transformers.modeling_utils")
    deepspeed_logger = logging.getLogger("DeepSpeed")  # deepspeed.utils.logging's; created here if not yet
    if _not_deepspeed_cpu_notice not in deepspeed_logger.filters:
        deepspeed_logger.addFilter(_not_deepspeed_cpu_notice)


def assert_trl_compatible(trainer_class: type = GRPOTrainer) -> None:
    """Raise :class:`UpstreamChangedError` listing every entry the installed TRL breaks."""
    findings = check_trl(trainer_class)
    if findings:
        lines = "\n".join(f"  - {finding}" for finding in findings)
        raise UpstreamChangedError(
            f"trl_moe_replay supports TRL {TRL_RANGE} (read from {TRL_READ}); the installed TRL {trl.__version__} no "
            f"longer matches what it relies on (trl_moe_replay/upstream.py, by entry):\n{lines}\n"
            f"Install 'trl{TRL_RANGE}', or a trl_moe_replay release that supports TRL {trl.__version__}."
        )
