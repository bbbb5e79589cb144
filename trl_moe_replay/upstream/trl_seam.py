"""The TRL part of the seam: what ``MoEReplayGRPOTrainer`` relies on in ``trl.GRPOTrainer`` and TRL's vLLM classes
beyond their public API, each one named entry (TRL 1.16.0 throughout, :data:`TRL_READ`).

``MoEReplayGRPOTrainer`` subclasses ``trl.GRPOTrainer`` and overrides some of its private methods; a few behaviours
also depend on how TRL's code behaves inside them. :func:`check_trl` verifies every entry against the installed TRL,
by signature (``inspect.signature``) and, where an entry depends on the order or form of TRL's code, by a small
behavioural probe: TRL's own function run on a tiny input and a stand-in ``self``, and the effect the package relies
on observed. The trainer calls it when it is built, so an upstream change fails loudly, naming the entry, instead of
training silently wrong. ``tests/upstream/test_entries.py`` runs the same checks in CI, and shows each probe failing on a TRL
whose code behaves otherwise; what needs a real run (the tool loop's rendering, the vLLM client and request fields)
is checked here by signature and by the tests each entry names.

TRL's experimental async trainer has its own part, ``trl_async_seam.py``. vLLM's private names live in
``trl_moe_replay_vllm_plugin`` (the CPU capture plugin, a separate package that vLLM loads in its own processes);
every other use of vLLM goes through TRL or vLLM's public API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import trl
from trl import GRPOTrainer

# TRL utilities from modules `trl` does not export, re-exported to the package (entry trl_utilities below)
from trl.chat_template_utils import add_response_schema, parse_response, qwen3_template  # noqa: F401
from trl.extras.profiling import profiling_context  # noqa: F401
from trl.models.utils import disable_gradient_checkpointing  # noqa: F401
from trl.trainer.utils import nanmax, nanmin, pad  # noqa: F401

from ..errors import TrlMoeReplayError
from .entries import Entry, Finding, UpstreamChangedError, entry, installed_versions, method_finding
from .torch_seam import check_torch
from .transformers_seam import check_transformers


TRL_READ = "1.16.0"
"""The TRL version every entry below was read from."""

TRL_RANGE = ">=1.16.0,<1.17"
"""The TRL versions this package declares (pyproject.toml); a TRL inside it passes :func:`check_trl`."""

TRL_VERIFIED = ("1.16.0",)
"""TRL versions every entry was verified on. (TRL 1.15.0 fails ``trl_public_apis`` and its GRPO needs Triton;
1.14.2 fails ``grpo_private_methods`` as well: see docs/install.md.) Run ``python scripts/check_trl_tree.py PATH``
against a TRL checkout before adding a version here."""


def _trl_entry(name: str, inherited: tuple[str, ...] = ()) -> Entry:
    return entry(name, "trl", TRL_READ, TRL_VERIFIED, inherited)


# ---------------------------------------------------------------------------------------------------------------
# grpo_private_methods: private GRPOTrainer methods the trainer overrides, with the parameters it relies on
#    (trl/trainer/grpo_trainer.py). An override forwards these by name, so a renamed or reordered parameter must fail
#    here rather than shift arguments. (transformers.Trainer's own private methods, overridden too, are the
#    transformers part's entry `trainer_private_methods`.)
#    Private attributes of GRPOTrainer the trainers read (set in GRPOTrainer.__init__): _metrics[mode][name], TRL's
#    metric lists averaged by GRPOTrainer.log (the way TRL trainers log); _tokenizer, the tokenizer behind
#    processing_class (pad token id).
# ---------------------------------------------------------------------------------------------------------------
OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "_generate_single_turn": (
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ),
    "_generate": ("self", "prompts"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
    "_compute_loss": ("self", "model", "inputs"),
    "get_gamma_weights": ("advantages", "log_ratio_per_token", "mask", "importance_sampling_ratio"),
}
PRIVATE_ATTRIBUTES = ("_metrics", "_tokenizer")
GRPO_PRIVATE_METHODS = _trl_entry(
    "grpo_private_methods", inherited=(*[n for n in OVERRIDDEN_METHODS if n.startswith("_")], *PRIVATE_ATTRIBUTES)
)


# ---------------------------------------------------------------------------------------------------------------
# padded_width: GRPOTrainer._generate_and_score_completions pads the prompts (left) and the completions (right) with
#    trl.trainer.utils.pad(..., pad_to_multiple_of=self.pad_to_multiple_of): the longest, rounded up to the multiple.
#    The routes are aligned once, right after generation, at that width (core/route_flow.py); every forward then
#    compares the width it is fed with, O(1), so a TRL that pads otherwise fails there, loudly, never silently.
# ---------------------------------------------------------------------------------------------------------------
PADDED_WIDTH = _trl_entry("padded_width")


def trl_padded_width(lengths: Sequence[int], pad_to_multiple_of: int | None) -> int:
    """The width TRL's ``pad`` gives a batch of ``lengths``: the longest, rounded up to ``pad_to_multiple_of``
    (entry ``padded_width``)."""
    width = max(lengths, default=0)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    return width


# ---------------------------------------------------------------------------------------------------------------
# engine_logprob_correction: TRL's engine log-prob correction is keyed on `use_vllm`.
#    GRPOTrainer._generate_and_score_completions runs its old-logprob pass, computes the importance-sampling ratio
#    against the sampler's log-probs and logs sampling/* when `self.use_vllm and
#    self.vllm_importance_sampling_correction`, after it generated; _compute_loss multiplies the loss by that ratio
#    under the same condition; _generate_single_turn takes the vLLM path when `self.use_vllm`. On the transformers
#    generation path our recorder supplies the sampler's log-probs exactly as vLLM does, so
#    `transformers_importance_sampling_correction` makes TRL apply the same correction by answering True there:
#    during scoring (after generation) and in the loss, never while generating.
# ---------------------------------------------------------------------------------------------------------------
ENGINE_LOGPROB_CORRECTION = _trl_entry("engine_logprob_correction")


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
# reference_forward: telling TRL's two scoring forwards apart.
#    _generate_and_score_completions calls _get_per_token_logps_and_entropies for the old policy with `self.model`,
#    then for the reference policy (beta != 0) with `self.ref_model`, or, for a PEFT model, with `self.model` inside
#    trl.trainer.utils.use_adapter(model, "ref" or None): the adapter named "ref" active, or all adapters disabled.
# ---------------------------------------------------------------------------------------------------------------
REFERENCE_FORWARD = _trl_entry("reference_forward")


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
# loss_branch: GRPOTrainer.__init__ copies args.loss_type to self.loss_type, and _compute_loss branches on
#    self.loss_type. Our loss names run on a TRL branch: gspo/rspo on "grpo" (with sequence-level ratios, as TRL's docs
#    reproduce GSPO), minirl on "vespo" (entry `minirl_on_vespo`).
# ---------------------------------------------------------------------------------------------------------------
LOSS_BRANCH = _trl_entry("loss_branch")


def run_loss_on_trl_branch(trainer: GRPOTrainer, trl_loss_type: str) -> None:
    """Make ``_compute_loss`` take TRL's ``trl_loss_type`` branch (``args.loss_type`` keeps the user's name)."""
    trainer.loss_type = trl_loss_type


# ---------------------------------------------------------------------------------------------------------------
# old_logps_after_forward: the router-shift weight γ reaches TRL's ratio through the old log-probs.
#    _compute_loss runs the training forward (_get_per_token_logps_and_entropies) *before* it reads
#    inputs["old_per_token_logps"], and forms every ratio from per_token_logps - old_per_token_logps. So old
#    log-probs shifted by -log γ, placed in the micro-batch during the forward, give γ·ratio to every loss type.
# ---------------------------------------------------------------------------------------------------------------
OLD_LOGPS_AFTER_FORWARD = _trl_entry("old_logps_after_forward")


def set_old_logps_for_loss(inputs: dict, old_per_token_logps: Any) -> None:
    """Place the old log-probs TRL's ``_compute_loss`` will read after the training forward (entry
    ``old_logps_after_forward``)."""
    inputs["old_per_token_logps"] = old_per_token_logps


# ---------------------------------------------------------------------------------------------------------------
# minirl_on_vespo: MiniRL on TRL's "vespo" branch.
#    _compute_loss's vespo branch is `per_token_loss = -phi_seq * advantages * per_token_logps` with
#    `phi_seq = self.get_gamma_weights(advantages=..., log_ratio_per_token=log_ratio, mask=...,
#    importance_sampling_ratio=..., ...)`, skips the engine importance-sampling factor, and normalises by the batch's
#    loss-token count like dapo. MiniRL's per-token loss is exactly that form with phi = sg[M_t · min(π_θ/μ, C)], so
#    the trainer overrides get_gamma_weights (a static method called through self) and TRL's code does the rest:
#    forward, masks, KL, aggregation, aux loss, metrics.
# ---------------------------------------------------------------------------------------------------------------
MINIRL_ON_VESPO = _trl_entry("minirl_on_vespo")
MINIRL_TRL_BRANCH = "vespo"


# ---------------------------------------------------------------------------------------------------------------
# vllm_client_session: vLLM server mode, the routes in TRL's client responses (trl/generation/vllm_client.py).
#    VLLMClient keeps its HTTP session in the public attribute `session` (a requests.Session) and posts every
#    request through it; VLLMClient.generate sends one POST /v1/completions and reads "choices" in completion
#    order, parsing the body with `response.json()` (TRL's `_post`). A requests response hook (a supported requests
#    mechanism) sees each response before requests reads a non-streamed body, and may return a replacement response
#    (rollouts/route_stream.py reads the body as a stream and hands TRL one without the route payloads). (Behaviour
#    tested with the stand-in server: tests/rollouts/test_route_stream.py, tests/rollouts/test_vllm_routes.py.)
# ---------------------------------------------------------------------------------------------------------------
VLLM_CLIENT_SESSION = _trl_entry("vllm_client_session")


def client_session(vllm_client: Any) -> Any:
    """The ``requests.Session`` TRL's ``VLLMClient`` sends its requests through."""
    return vllm_client.session


# ---------------------------------------------------------------------------------------------------------------
# http_vllm_client: TRL's VLLMClient as a plain HTTP client (trl/generation/vllm_client.py).
#    VLLMClient.__init__ refuses to build unless `is_vllm_available()` (its module-global name) answers True,
#    although generation through it is only HTTP (the weight-transfer communicator, which needs vLLM, is opened
#    separately). `trl-moe-replay audit --vllm_server_url` samples through it from a machine without vLLM.
# ---------------------------------------------------------------------------------------------------------------
HTTP_VLLM_CLIENT = _trl_entry("http_vllm_client")


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
# vllm_generation_classes: the vLLM classes TRL builds (trl/generation/vllm_generation.py).
#    VLLMGeneration._init_vllm builds, from module-global names, `VLLMClient(...)` then `init_communicator(...)`
#    (server mode, main process), or `LLM(...)` with a fixed argument list (no pass-through) and
#    distributed_executor_backend="external_launcher" (colocate); VLLMGeneration.generate calls
#    `self.llm.generate(...)` and keeps only token ids and log-probs from the returned RequestOutputs. To get
#    `enable_return_routed_experts=True` and the outputs (colocate), or a client without TRL's NCCL communicator
#    (server mode, weight sync by vLLM's reload), the classes are chosen at construction: the trainer builds TRL's
#    VLLMGeneration while those names refer to subclasses. (Behaviour tested: tests/rollouts/test_vllm_routes.py.)
# ---------------------------------------------------------------------------------------------------------------
VLLM_GENERATION_CLASSES = _trl_entry("vllm_generation_classes")
_VLLM_GENERATION_MODULE = "trl.generation.vllm_generation"


@contextlib.contextmanager
def vllm_generation_classes(**make_subclass: Callable[[type], type]) -> Iterator[None]:
    """While the trainer builds TRL's ``VLLMGeneration``, each module-global name given (``LLM``, ``VLLMClient``)
    is ``make_subclass(original)``. Without vLLM installed ``LLM`` does not exist; TRL then raises its own error."""
    module = importlib.import_module(_VLLM_GENERATION_MODULE)
    saved = {name: getattr(module, name, None) for name in make_subclass}
    for name, make in make_subclass.items():
        if (original := saved[name]) is not None:
            setattr(module, name, make(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is not None:
                setattr(module, name, original)


def vllm_sampling_params_class() -> type:
    """The ``SamplingParams`` class TRL's colocate mode builds its requests with (the module global of
    ``trl/generation/vllm_generation.py``: vLLM's, or whatever a test installed there), so that a request of ours to
    the colocated engine is built the way TRL builds its own."""
    return importlib.import_module(_VLLM_GENERATION_MODULE).SamplingParams


# ---------------------------------------------------------------------------------------------------------------
# vllm_request_fields: per-request fields of TRL's vLLM requests (trl/generation/vllm_generation.py).
#    VLLMGeneration.generate merges its `generation_kwargs` attribute (GRPOConfig.generation_kwargs) into every
#    request: the /v1/completions body (server mode, through VLLMClient.generate) or SamplingParams (colocate).
#    A later tool turn asks vLLM (`routed_experts_prompt_start`) not to resend the routes of the prefix it holds.
#    (Behaviour tested: tests/rollouts/test_turns_tools.py and tests/rollouts/test_turns.py.)
# ---------------------------------------------------------------------------------------------------------------
VLLM_REQUEST_FIELDS = _trl_entry("vllm_request_fields")


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
# weight_sync_params: parameters vLLM's model does not have (PR2's predictors, registered in the trained model).
#    Both VLLMGeneration.sync_weights paths (server metadata and transfer, colocate load_weights) read the
#    parameters through the one iterator VLLMGeneration._iter_named_params (gathering each under DeepSpeed/FSDP,
#    mapping names to vLLM's); vLLM's load_weights rejects unknown names. The iterator is filtered on this
#    instance; every parameter is still walked, so the gathers stay collective.
# ---------------------------------------------------------------------------------------------------------------
WEIGHT_SYNC_PARAMS = _trl_entry("weight_sync_params")


def exclude_from_weight_sync(vllm_generation: Any, skip: Callable[[str], bool]) -> None:
    """Leave the parameters whose vLLM name satisfies ``skip`` out of TRL's weight sync to vLLM."""
    iterate = vllm_generation._iter_named_params

    def without_skipped():
        for name, param in iterate():
            if not skip(name):
                yield name, param

    vllm_generation._iter_named_params = without_skipped


def map_weight_sync_tensors(vllm_generation: Any, convert: Callable[[Any], Any]) -> None:
    """Every tensor TRL's weight sync reads (this instance's iterator) passed through ``convert``: a model sharded at
    load time (expert parallelism) holds DTensor shards, which ``convert`` gathers to full tensors (a collective:
    every rank walks the iterator, as TRL's sync already makes them do)."""
    iterate = vllm_generation._iter_named_params

    def converted():
        for name, param in iterate():
            yield name, convert(param)

    vllm_generation._iter_named_params = converted


def trl_named_params(vllm_generation: Any) -> Iterator[tuple[str, Any]]:
    """The parameters TRL's sync would send, one at a time, gathered and named as it names them."""
    return vllm_generation._iter_named_params()


# ---------------------------------------------------------------------------------------------------------------
# vllm_sync_trigger: when TRL syncs vLLM's weights, and how it wakes them.
#    GRPOTrainer._generate_single_turn (vLLM) and _generate (rollout_func) call self.vllm_generation.sync_weights()
#    when `self.state.global_step != self._last_loaded_step`, then set _last_loaded_step: a sync the trainer does
#    first (vLLM's reload, `vllm_weight_sync="reload"`) and records there replaces TRL's. It reads the parameters as
#    TRL's sync would (entry `weight_sync_params`), and wakes sleeping colocated weights first as TRL does
#    (`_llm_weights_sleeping`).
# ---------------------------------------------------------------------------------------------------------------
VLLM_SYNC_TRIGGER = _trl_entry("vllm_sync_trigger")


def vllm_weights_stale(trainer: GRPOTrainer) -> bool:
    """Whether TRL would sync vLLM's weights before the next generation."""
    return trainer.state.global_step != trainer._last_loaded_step


def mark_vllm_weights_synced(trainer: GRPOTrainer) -> None:
    """Record that vLLM holds the weights of the current step (TRL then skips its own sync)."""
    trainer._last_loaded_step = trainer.state.global_step


def wake_colocated_weights(vllm_generation: Any) -> None:
    """Before loading into a sleeping colocated engine (``vllm_enable_sleep_mode``), as TRL's sync does."""
    if vllm_generation.mode == "colocate" and vllm_generation.enable_sleep_mode:
        vllm_generation.llm.wake_up(tags=["weights"])
        vllm_generation._llm_weights_sleeping = False


# ---------------------------------------------------------------------------------------------------------------
# tool_turn_rendering: how TRL's tool loop renders a tool turn (trl/trainer/grpo_trainer.py), mirrored by the
#    offline cold start. trl_moe_replay.extras.math.cold_start teaches the tiny demo model tool calls with sequences
#    built as TRL 1.16's _tool_call_loop builds them at train time: `prompt + completion +
#    _get_tool_suffix_ids(tool_messages)`, the suffix cut from a dummy conversation after its last EOS, and a failing
#    tool's result `{"error": str(e)}`. Checked here by signature; tests/extras/math/test_tools.py checks a real trainer run
#    against the cold start's sequences token for token (the behavioural probe).
# ---------------------------------------------------------------------------------------------------------------
TOOL_TURN_RENDERING = _trl_entry("tool_turn_rendering")
TOOL_LOOP_METHODS: dict[str, tuple[str, ...]] = {
    "_get_tool_suffix_ids": ("self", "tool_messages"),
    "_tool_call_loop": (
        "self",
        "prompts",
        "prompt_ids",
        "completion_ids",
        "completions",
        "logprobs",
        "images",
        "multimodal_fields",
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# tool_loop_samples: which samples a later tool turn belongs to. GRPOTrainer._tool_call_loop (the loop of `tools`
#    and of `environment_factory`) calls self._generate_single_turn(prompt_completion_tool_ids, ...) with one prompt
#    per sample still calling tools, in the order of its local list `idxs_with_tool` (indices into the generation
#    batch, the samples whose tool result would not fit already dropped), and passes only the token ids. Two samples
#    of one group that wrote the same tool call have the same sequence so far, so the tokens cannot say which one a
#    turn continues; the loop's list can, and this reads it from the loop's frame (the only place TRL holds it).
#    Probe: TRL's loop on three samples whose first one's tool result does not fit.
# ---------------------------------------------------------------------------------------------------------------
TOOL_LOOP_SAMPLES = _trl_entry("tool_loop_samples")
_TOOL_LOOP_LIST = "idxs_with_tool"
_FRAMES_TO_TOOL_LOOP = 8  # our override, a user's override of it, decorators: the loop is a few frames up at most


def tool_loop_samples(count: int, trainer_class: type[GRPOTrainer] = GRPOTrainer) -> list[int] | None:
    """The samples (indices into the generation batch, increasing) that the ``count`` prompts of the generation turn
    in progress continue, as ``trainer_class._tool_call_loop`` holds them (entry ``tool_loop_samples``); ``None`` when
    the call does not come from that loop (the batch's first turn, a user's own loop) or its list does not fit."""
    code = getattr(inspect.unwrap(trainer_class._tool_call_loop), "__code__", None)
    frame = inspect.currentframe()
    try:
        for _ in range(_FRAMES_TO_TOOL_LOOP):
            frame = frame.f_back if frame is not None else None
            if frame is None or frame.f_code is code:
                break
        if frame is None or frame.f_code is not code:
            return None
        samples = frame.f_locals.get(_TOOL_LOOP_LIST)
    finally:
        del frame  # no reference cycle through the caller's frames
    if (
        not isinstance(samples, list)
        or len(samples) != count
        or not all(type(sample) is int and sample >= 0 for sample in samples)
    ):
        return None
    if any(later <= earlier for earlier, later in zip(samples, samples[1:], strict=False)):
        return None
    return list(samples)


# ---------------------------------------------------------------------------------------------------------------
# model_card_identity: TRL's create_model_card (trl/trainer/base_trainer.py, every TRL trainer's) names the trainer
#    from `self._name` and cites `self._paper["citation"]` (GRPOTrainer's: DeepSeekMath), both class attributes. The
#    model card records the routing mode and cites the methods a run used (core/model_card.py) by giving the
#    trainer instance its own two for the duration of the call.
# ---------------------------------------------------------------------------------------------------------------
MODEL_CARD_IDENTITY = _trl_entry("model_card_identity", inherited=("_name", "_paper"))


@contextlib.contextmanager
def model_card_identity(trainer: Any, qualifier: str, citations: Sequence[str]) -> Iterator[None]:
    """Within the context, TRL's ``create_model_card`` names ``trainer`` by its class's name and ``qualifier``, and
    cites, after the class's own paper, each of ``citations`` (BibTeX entries)."""
    cls = type(trainer)
    cited = "\n\n".join([c for c in (cls._paper.get("citation"), *citations) if c])
    trainer._name, trainer._paper = f"{cls._name} {qualifier}", {**cls._paper, "citation": cited}
    try:
        yield
    finally:
        del trainer._name, trainer._paper  # the class's own again


def _model_card_identity_finding(trainer_class: type) -> Finding | None:
    paper = inspect.getattr_static(trainer_class, "_paper", None)
    if not isinstance(inspect.getattr_static(trainer_class, "_name", None), str) or not (
        isinstance(paper, dict) and "citation" in paper
    ):
        return Finding(
            MODEL_CARD_IDENTITY,
            "GRPOTrainer no longer has the class attributes _name (str) and _paper "
            "(a dict with a 'citation') that create_model_card reads",
        )
    return method_finding(
        MODEL_CARD_IDENTITY,
        trainer_class,
        "GRPOTrainer",
        "create_model_card",
        ("self", "model_name", "dataset_name", "tags"),
    )


# ---------------------------------------------------------------------------------------------------------------
# trl_public_apis: public TRL APIs this package calls that a TRL still matching every other entry may lack: public,
#    but not in every TRL release, so they are checked like the private ones (TRL 1.15.0 has neither of the first two).
#    VLLMClient.get_server_info() (trl/generation/vllm_client.py): `trl-moe-replay audit` and the fake vLLM server
#    read the server's configuration; parse_response(tokenizer, ids, prefix=..., tools=...)
#    (trl/chat_template_utils.py): the math cold start parses tool calls as TRL's tool loop does;
#    disable_gradient_checkpointing(model, gradient_checkpointing_kwargs) (trl/models/utils.py): the routing metrics'
#    own no-grad forward (MoEReplayGRPOTrainer._metrics_pass) runs like TRL's old-logprob pass.
# ---------------------------------------------------------------------------------------------------------------
TRL_PUBLIC_APIS = _trl_entry("trl_public_apis")
PUBLIC_APIS: dict[str, tuple[str, tuple[str, ...]]] = {
    "VLLMClient.get_server_info": ("trl.generation.vllm_client", ("self",)),
    "parse_response": ("trl.chat_template_utils", ("tokenizer", "ids", "prefix", "tools")),
    "disable_gradient_checkpointing": ("trl.models.utils", ("model", "gradient_checkpointing_kwargs")),
}

# ---------------------------------------------------------------------------------------------------------------
# trl_utilities: TRL functions the package calls from modules `trl` does not export, imported here and only here
#    (tests/cross_cutting/test_layout.py), so that a TRL which moves or changes one fails this check by name: pad
#    (trl/trainer/utils.py; checked and probed by entry padded_width), nanmin(tensor)/nanmax(tensor)
#    (trl/trainer/utils.py: the minimum/maximum ignoring NaN, NaN when every value is; the sync trainer logs its clip
#    ratios with them as TRL does), profiling_context(trainer, name) (trl/extras/profiling.py: times the block into
#    the trainer's logs), add_response_schema(processing_class) and qwen3_template (trl/chat_template_utils.py: the
#    tool-calling tokenizer of the math cold start and of trl_moe_replay.testing). disable_gradient_checkpointing and
#    parse_response are entry trl_public_apis.
# ---------------------------------------------------------------------------------------------------------------
TRL_UTILITIES = _trl_entry("trl_utilities")
UTILITIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "nanmin": ("trl.trainer.utils", ("tensor",)),
    "nanmax": ("trl.trainer.utils", ("tensor",)),
    "profiling_context": ("trl.extras.profiling", ("trainer", "name")),
    "add_response_schema": ("trl.chat_template_utils", ("processing_class",)),
}

# Module globals of TRL the seam reads or replaces, by entry (checked to exist; their behaviour is probed below).
MODULE_GLOBALS: dict[Entry, tuple[str, tuple[str, ...]]] = {
    PADDED_WIDTH: ("trl.trainer.utils", ("pad",)),
    HTTP_VLLM_CLIENT: ("trl.generation.vllm_client", ("is_vllm_available", "VLLMClient")),
    VLLM_GENERATION_CLASSES: (_VLLM_GENERATION_MODULE, ("VLLMClient", "VLLMGeneration")),
    TRL_UTILITIES: ("trl.chat_template_utils", ("qwen3_template",)),
}
# Signatures of the TRL functions the seam calls or whose behaviour it relies on, by entry.
SIGNATURES: dict[Entry, dict[str, tuple[str, tuple[str, ...]]]] = {
    VLLM_CLIENT_SESSION: {
        "VLLMClient._post": ("trl.generation.vllm_client", ("self", "url")),
        "VLLMClient.generate": ("trl.generation.vllm_client", ("self", "prompts", "features", "n")),
    },
    HTTP_VLLM_CLIENT: {"VLLMClient.__init__": ("trl.generation.vllm_client", ("self", "base_url"))},
    VLLM_GENERATION_CLASSES: {
        "VLLMGeneration._init_vllm": (_VLLM_GENERATION_MODULE, ("self",)),
        "VLLMGeneration.generate": (_VLLM_GENERATION_MODULE, ("self", "prompts", "images", "num_generations")),
    },
    VLLM_REQUEST_FIELDS: {"VLLMGeneration.generate": (_VLLM_GENERATION_MODULE, ("self", "prompts"))},
    WEIGHT_SYNC_PARAMS: {
        "VLLMGeneration.sync_weights": (_VLLM_GENERATION_MODULE, ("self",)),
        "VLLMGeneration._iter_named_params": (_VLLM_GENERATION_MODULE, ("self",)),
    },
    REFERENCE_FORWARD: {"use_adapter": ("trl.trainer.utils", ("model", "adapter_name"))},
    TRL_PUBLIC_APIS: PUBLIC_APIS,
    TRL_UTILITIES: UTILITIES,
}


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------
@functools.cache
def check_trl(trainer_class: type = GRPOTrainer) -> tuple[Finding, ...]:
    """Verify every entry against the installed TRL (and the torch and transformers parts); returns what no longer
    holds (empty: all good). ``trainer_class`` is the GRPOTrainer whose methods are checked (tests pass a changed
    one)."""
    findings: list[Finding] = []
    for name, params in {**OVERRIDDEN_METHODS, **TOOL_LOOP_METHODS}.items():
        declared = GRPO_PRIVATE_METHODS if name in OVERRIDDEN_METHODS else TOOL_TURN_RENDERING
        if finding := method_finding(declared, trainer_class, "GRPOTrainer", name, params):
            findings.append(finding)
    if finding := _model_card_identity_finding(trainer_class):
        findings.append(finding)
    if not isinstance(inspect.getattr_static(trainer_class, "get_gamma_weights", None), staticmethod):
        findings.append(Finding(MINIRL_ON_VESPO, "GRPOTrainer.get_gamma_weights is no longer a static method"))
    for declared, (module_name, names) in MODULE_GLOBALS.items():
        module = _import(module_name)
        for name in names:
            if getattr(module, name, None) is None:
                findings.append(Finding(declared, f"{module_name}.{name} does not exist"))
    for declared, signatures in SIGNATURES.items():
        for qualified, (module_name, params) in signatures.items():
            obj: Any = _import(module_name)
            for part in qualified.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                findings.append(Finding(declared, f"{module_name}.{qualified} does not exist"))
                continue
            have = tuple(inspect.signature(obj).parameters)
            missing = [p for p in params if p not in have]
            if missing:
                findings.append(Finding(declared, f"{module_name}.{qualified}{have} lacks the parameter(s) {missing}"))
    if not findings:  # the probes call TRL's methods: only once they exist with the parameters they are called with
        for declared, probe in _PROBES:
            try:
                problem = probe(trainer_class)
            except Exception as error:  # TRL's code now reads or does something the probe's stand-in lacks
                problem = f"the probe of TRL's code failed ({type(error).__name__}: {error}); re-read the entry"
            if problem:
                findings.append(Finding(declared, problem))
    return tuple(findings) + check_transformers(trainer_class) + check_torch()


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Behavioural probes: each runs TRL's own function on a tiny input with a stand-in `self` and returns what no longer
# holds (None: the behaviour the entry relies on is there).
# ---------------------------------------------------------------------------------------------------------------
class _ProbeStop(TrlMoeReplayError):
    """Raised by a probe's stand-in once it has seen what it looks for."""


class _Accelerator:
    """One process on the CPU, as TRL's code calls accelerate."""

    device = torch.device("cpu")
    num_processes, process_index, is_main_process, sync_gradients = 1, 0, True, True

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def unwrap_model(self, model):
        return model


def _stand_in_trainer(**attributes: Any) -> Any:
    """A GRPOTrainer's state as TRL's methods read it, with GRPOConfig's defaults as ``args`` (a SimpleNamespace,
    typed Any: it stands in for the trainer where TRL's methods take one)."""
    config = trl.GRPOConfig
    args = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    args.update(steps_per_generation=1, gradient_accumulation_steps=1, report_to=[], delta=None)
    base = dict(
        args=SimpleNamespace(**args),
        accelerator=_Accelerator(),
        state=SimpleNamespace(global_step=0),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        _metrics=defaultdict(lambda: defaultdict(list)),
        loss_type="grpo",
        beta=0.0,
        epsilon_low=0.2,
        epsilon_high=0.2,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=True,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=2,
    )
    base.update(attributes)
    return SimpleNamespace(**base)


def _run_loss(
    trainer_class: Any, forward_logps: float, on_forward: Callable[[dict], None] | None = None, **attributes: Any
) -> tuple[float, SimpleNamespace]:
    """TRL's ``_compute_loss`` on one sequence of two completion tokens with advantage 1, whose training forward
    returns ``forward_logps`` everywhere (and runs ``on_forward(inputs)``)."""
    inputs = {
        "prompt_ids": torch.ones(1, 1, dtype=torch.long),
        "prompt_mask": torch.ones(1, 1, dtype=torch.long),
        "completion_ids": torch.ones(1, 2, dtype=torch.long),
        "completion_mask": torch.ones(1, 2, dtype=torch.long),
        "advantages": torch.ones(1),
        "num_items_in_batch": torch.tensor(4.0),
        **attributes.pop("inputs", {}),
    }

    def forward(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        if on_forward is not None:
            on_forward(inputs)
        return torch.full((1, logits_to_keep), forward_logps), torch.zeros(1, logits_to_keep), None

    trainer = _stand_in_trainer(_get_per_token_logps_and_entropies=forward, **attributes)
    return float(trainer_class._compute_loss(trainer, trainer.model, inputs)), trainer


def _probe_old_logps_after_forward(trainer_class: type) -> str | None:
    gamma = 1.1
    shift = torch.full((1, 2), -math.log(gamma))
    loss, _ = _run_loss(trainer_class, 0.0, on_forward=lambda inputs: set_old_logps_for_loss(inputs, shift))
    if not math.isclose(loss, -gamma, rel_tol=1e-5):
        return (
            f"_compute_loss no longer forms its ratio from the old log-probs placed in the micro-batch during the "
            f"training forward (per_token_logps - old_per_token_logps, read after the forward): a ratio of "
            f"{gamma} gave the grpo loss {loss:.4f}, expected {-gamma}"
        )
    return None


def _probe_loss_branch(trainer_class: type) -> str | None:
    args_loss = "a-loss-trl-does-not-know"
    trainer = _stand_in_trainer()
    trainer.args.loss_type = args_loss
    loss, _ = _run_loss(trainer_class, 0.0, loss_type="grpo", args=trainer.args)
    if not math.isclose(loss, -1.0, rel_tol=1e-6):
        return f"_compute_loss no longer takes the branch self.loss_type names ('grpo' gave {loss}, expected -1.0)"
    return None


def _probe_engine_correction_in_loss(trainer_class: type) -> str | None:
    ratio = {"importance_sampling_ratio": torch.full((1, 2), 2.0)}
    corrected, _ = _run_loss(trainer_class, 0.0, use_vllm=True, inputs=dict(ratio))
    skipped, _ = _run_loss(trainer_class, 0.0, use_vllm=False, inputs=dict(ratio))
    if not (math.isclose(corrected, -2.0, rel_tol=1e-6) and math.isclose(skipped, -1.0, rel_tol=1e-6)):
        return (
            f"_compute_loss no longer applies the engine importance-sampling ratio exactly when self.use_vllm "
            f"(ratio 2: loss {corrected} with use_vllm, {skipped} without; expected -2.0 and -1.0)"
        )
    return None


def _probe_minirl_on_vespo(trainer_class: type) -> str | None:
    seen = {}

    def gamma_weights(**kwargs):
        seen.update(kwargs)
        return torch.full((1, 1), 0.5)

    loss, _ = _run_loss(
        trainer_class,
        -2.0,
        loss_type=MINIRL_TRL_BRANCH,
        use_vllm=True,
        get_gamma_weights=gamma_weights,
        inputs={"old_per_token_logps": torch.full((1, 2), -2.0), "importance_sampling_ratio": torch.full((1, 2), 3.0)},
    )
    # -phi * A * logps = -0.5 * 1 * -2 = 1 per token; 2 tokens over num_items_in_batch 4; no engine factor
    expected = 0.5
    wanted = {"advantages", "log_ratio_per_token", "mask", "importance_sampling_ratio"}
    if not math.isclose(loss, expected, rel_tol=1e-6) or not wanted <= set(seen):
        return (
            f"the vespo branch is no longer -get_gamma_weights(advantages=, log_ratio_per_token=, mask=, "
            f"importance_sampling_ratio=) * advantages * per_token_logps, summed over the batch's loss tokens "
            f"without the engine factor (loss {loss}, expected {expected}; get_gamma_weights got {sorted(seen)})"
        )
    return None


def _probe_padded_width(trainer_class: type) -> str | None:
    trl_pad = _import("trl.trainer.utils").pad
    for lengths, multiple in (([3, 5], None), ([3, 5], 4), ([1], 8), ([0, 2], 2)):
        for side in ("left", "right"):
            padded = trl_pad([torch.ones(n) for n in lengths], padding_side=side, pad_to_multiple_of=multiple).shape[1]
            if padded != trl_padded_width(lengths, multiple):
                return (
                    f"trl.trainer.utils.pad pads {lengths} ({side}, multiple {multiple}) to {padded}, not to "
                    f"{trl_padded_width(lengths, multiple)} (trl_padded_width)"
                )
    return None


def _score(
    trainer_class: Any, *, use_vllm: bool, ref_model: Any = None, beta: float = 0.0, peft_model: Any = None
) -> tuple[list, dict, SimpleNamespace]:
    """TRL's ``_generate_and_score_completions`` on two one-token completions; returns the events (generation and
    each scoring forward's model, in order), the output and the stand-in trainer."""
    events = []

    def generate(prompts):
        events.append("generate")
        return [[1], [1]], [[2], [2]], None, ["a", "b"], [[-1.0], [-1.0]], {}, None, [None, None]

    def forward(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        events.append(model)
        return torch.full((input_ids.shape[0], logits_to_keep), -1.0), None, None

    model = peft_model or SimpleNamespace(training=True, is_gradient_checkpointing=False)
    trainer = _stand_in_trainer(
        model=model,
        use_vllm=use_vllm,
        ref_model=ref_model,
        beta=beta,
        environment_factories=None,
        tools=None,
        environments=None,
        _generate=generate,
        _get_per_token_logps_and_entropies=forward,
        _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        _is_vlm=False,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=10.0,
        _calculate_rewards=lambda *a: torch.tensor([[1.0], [0.0]]),
        num_generations=2,
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.ones(1),
        scale_rewards="group",
        reward_func_names=["probe"],
        log_multimodal=False,
        _pending_extra_logs={},
        _pending_metrics={},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
            "images": [],
        },
    )
    trainer.args.per_device_train_batch_size = 2
    output = trainer_class._generate_and_score_completions(trainer, [{"prompt": "p"}, {"prompt": "q"}])
    return events, output, trainer


def _probe_engine_correction_in_scoring(trainer_class: type) -> str | None:
    events, output, trainer = _score(trainer_class, use_vllm=True)
    if (
        events != ["generate", trainer.model]
        or "importance_sampling_ratio" not in output
        or not any(name.startswith("sampling/") for name in trainer._metrics["train"])
    ):
        return (
            "_generate_and_score_completions no longer generates, then runs its old-logprob pass, computes the "
            "importance-sampling ratio and logs sampling/* when use_vllm and vllm_importance_sampling_correction"
        )
    events, output, trainer = _score(trainer_class, use_vllm=False)
    if (
        events != ["generate"]
        or "importance_sampling_ratio" in output
        or any(name.startswith("sampling/") for name in trainer._metrics["train"])
    ):
        return "_generate_and_score_completions now applies the engine correction without use_vllm"
    return None


def _probe_reference_forward(trainer_class: type) -> str | None:
    ref_model = SimpleNamespace(training=False)
    events, _, trainer = _score(trainer_class, use_vllm=True, ref_model=ref_model, beta=0.1)
    if events != ["generate", trainer.model, ref_model]:
        return (
            "the scoring forwards are no longer the old policy with self.model, then the reference policy with "
            f"self.ref_model (saw {events})"
        )
    adapters = []

    class PeftModel(SimpleNamespace):
        @contextlib.contextmanager
        def disable_adapter(self):
            adapters.append("disabled")
            yield
            adapters.append("enabled")

    model = PeftModel(training=True, is_gradient_checkpointing=False, peft_config={"default": None})
    events, _, _ = _score(trainer_class, use_vllm=True, beta=0.1, peft_model=model)
    forwards = [event is model for event in events[1:]]
    if forwards != [True, True] or adapters != ["disabled", "enabled"]:
        return (
            "the PEFT reference forward no longer runs self.model inside use_adapter(model, None) (all "
            f"adapters disabled) after the old-policy forward (adapter calls {adapters}, forwards of self.model "
            f"{forwards})"
        )
    return None


def _probe_vllm_sync_trigger(trainer_class: Any) -> str | None:
    synced = []

    def generate(**kwargs):
        raise _ProbeStop

    generation = SimpleNamespace(sync_weights=lambda: synced.append(True), generate=generate)
    for last_loaded, expected in ((0, [True]), (1, [])):
        synced.clear()
        trainer = _stand_in_trainer(
            use_vllm=True,
            vllm_generation=generation,
            _last_loaded_step=last_loaded,
            state=SimpleNamespace(global_step=1),
        )
        with contextlib.suppress(_ProbeStop):
            trainer_class._generate_single_turn(trainer, [[1]], None, None, 1)
        if synced != expected or trainer._last_loaded_step != 1 or vllm_weights_stale(trainer):
            return (
                "GRPOTrainer._generate_single_turn no longer takes the vLLM path under use_vllm and syncs the "
                "weights exactly when state.global_step != _last_loaded_step, then records the step"
            )
    return None


def _probe_weight_sync_params(trainer_class: type) -> str | None:
    from trl.generation.vllm_generation import VLLMGeneration

    loaded: list[str] = []
    sent: list[str] = []
    woken: list = []
    model = SimpleNamespace(load_weights=lambda weights: loaded.extend(name for name, _ in weights))
    llm = SimpleNamespace(
        wake_up=lambda tags: woken.append(tags),
        reset_prefix_cache=lambda: None,
        llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
        ),
    )
    client = SimpleNamespace(
        update_named_params=lambda metadata, params: sent.extend(name for name, _ in params),
        reset_prefix_cache=lambda: None,
    )
    for mode in ("colocate", "server"):
        params = [("kept", torch.ones(1)), ("left", torch.ones(1))]
        # stands in for a VLLMGeneration
        generation: Any = SimpleNamespace(
            mode=mode,
            enable_sleep_mode=True,
            llm=llm,
            vllm_client=client,
            accelerator=_Accelerator(),
            _weight_metadata=None,
            _llm_weights_sleeping=True,
            _iter_named_params=lambda params=params: iter(params),
        )
        exclude_from_weight_sync(generation, lambda name: name == "left")
        VLLMGeneration.sync_weights(generation)
    if loaded != ["kept"] or sent != ["kept"]:
        return (
            "VLLMGeneration.sync_weights no longer reads the parameters it sends through "
            f"self._iter_named_params() in both modes (colocate loaded {loaded}, server sent {sent})"
        )
    if not woken or "_llm_weights_sleeping" not in vars(generation):
        return "VLLMGeneration.sync_weights no longer wakes sleeping colocated weights (_llm_weights_sleeping)"
    return None


def _probe_nan_extrema(trainer_class: type) -> str | None:
    utils = _import("trl.trainer.utils")
    values, all_nan = torch.tensor([float("nan"), 2.0, -1.0]), torch.full((2,), float("nan"))
    got = (
        utils.nanmin(values).item(),
        utils.nanmax(values).item(),
        utils.nanmin(all_nan).item(),
        utils.nanmax(all_nan).item(),
    )
    if got[:2] != (-1.0, 2.0) or not all(math.isnan(v) for v in got[2:]):
        return (
            f"trl.trainer.utils.nanmin/nanmax of [nan, 2, -1] and [nan, nan] give {got}, not -1, 2 (NaN ignored) "
            "and NaN, NaN"
        )
    return None


def _probe_tool_loop_samples(trainer_class: Any) -> str | None:
    """TRL's tool loop on three samples that each call a tool; the first result is too long to fit the completion
    budget (TRL drops it, the sample ends), so the turn after the tools continues samples 1 and 2."""
    seen: list[tuple[list[int] | None, list[list[int]]]] = []

    def generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen.append((tool_loop_samples(len(prompt_ids), trainer_class), [list(ids) for ids in prompt_ids]))
        return [[] for _ in prompt_ids], None  # nothing generated: no further tool call, the loop ends

    def tool(n: int) -> str:
        return "x" * n

    def call(n: int) -> list[dict]:
        return [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "tool", "arguments": {"n": n}}}],
            }
        ]

    trainer = _stand_in_trainer(
        _generate_single_turn=generate_turn,
        _get_tool_suffix_ids=lambda messages: [9] * len(messages[-1]["content"]),
        _sync_tool_dicts=[{"tool": tool}] * 3,
        _async_tool_dicts=[{}] * 3,
        max_tool_calling_iterations=2,
        max_completion_length=4,
        vllm_mode="server",
        _is_vlm=False,
        tools=[tool],
        environment_factories=None,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100)),
    )
    prompt_ids, completion_ids = [[1], [1], [2]], [[5], [5], [6]]
    trainer_class._tool_call_loop(
        trainer,
        [[{"role": "user", "content": "q"}] for _ in range(3)],
        prompt_ids,
        completion_ids,
        [call(9), call(1), call(2)],
        None,
        None,
        {},
    )
    expected = [[1, 5, 9], [2, 6, 9, 9]]
    if seen != [([1, 2], expected)]:
        return (
            f"_tool_call_loop no longer asks _generate_single_turn for the samples in its list idxs_with_tool "
            f"(after dropping those whose tool result does not fit): saw (samples, prompts) {seen}, expected "
            f"{[([1, 2], expected)]}"
        )
    return None


_PROBES: tuple[tuple[Entry, Callable[[type], str | None]], ...] = (
    (OLD_LOGPS_AFTER_FORWARD, _probe_old_logps_after_forward),
    (LOSS_BRANCH, _probe_loss_branch),
    (ENGINE_LOGPROB_CORRECTION, _probe_engine_correction_in_loss),
    (ENGINE_LOGPROB_CORRECTION, _probe_engine_correction_in_scoring),
    (MINIRL_ON_VESPO, _probe_minirl_on_vespo),
    (PADDED_WIDTH, _probe_padded_width),
    (TRL_UTILITIES, _probe_nan_extrema),
    (REFERENCE_FORWARD, _probe_reference_forward),
    (VLLM_SYNC_TRIGGER, _probe_vllm_sync_trigger),
    (WEIGHT_SYNC_PARAMS, _probe_weight_sync_params),
    (TOOL_LOOP_SAMPLES, _probe_tool_loop_samples),
)


def assert_trl_compatible(trainer_class: type = GRPOTrainer) -> None:
    """Raise :class:`UpstreamChangedError` listing every entry the installed TRL breaks."""
    findings = check_trl(trainer_class)
    if findings:
        lines = "\n".join(f"  - {finding}" for finding in findings)
        if {finding.entry.library for finding in findings} == {"trl"}:
            remedy = f"Install 'trl{TRL_RANGE}', or a trl_moe_replay release that supports TRL {trl.__version__}."
        else:  # a transformers or torch entry: the version it was verified on, named in its line
            remedy = (
                "Install a version each entry above was verified on, or a trl_moe_replay release that supports yours."
            )
        raise UpstreamChangedError(
            f"trl_moe_replay supports TRL {TRL_RANGE} (read from {TRL_READ}); the installed {installed_versions(findings)} "
            f"no longer matches what it relies on (trl_moe_replay/upstream/, by entry):\n{lines}\n{remedy}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Notices from upstream code that a user cannot act on, silenced by their exact text (nothing else is filtered):
# - TRL (trl/models/utils.py: unwrap_model_for_generation, disable_gradient_checkpointing) reads
#   `model.is_gradient_checkpointing`, which transformers deprecates (5.24: a FutureWarning at every generation).
# - accelerate's is_peft_model imports DeepSpeed where it is installed (TRL calls it in GRPOTrainer.__init__), and
#   DeepSpeed then logs "Setting accelerator to CPU" on a machine without a GPU, where the CPU is what trains.
# ---------------------------------------------------------------------------------------------------------------
_DEEPSPEED_CPU_NOTICE = (
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
)


def _not_deepspeed_cpu_notice(record: Any) -> bool:
    return not str(record.msg).startswith(_DEEPSPEED_CPU_NOTICE)


def quiet_upstream_notices() -> None:
    """Silence the notices listed above, and only them (idempotent)."""
    import logging
    import warnings

    warnings.filterwarnings(
        "ignore",
        message="`is_gradient_checkpointing` is deprecated",
        category=FutureWarning,
        module="transformers.modeling_utils",
    )
    deepspeed_logger = logging.getLogger("DeepSpeed")  # deepspeed.utils.logging's; created here if not yet
    if _not_deepspeed_cpu_notice not in deepspeed_logger.filters:
        deepspeed_logger.addFilter(_not_deepspeed_cpu_notice)
