"""Everything this package relies on in TRL beyond its public API, in one place.

``MoEReplayGRPOTrainer`` subclasses ``trl.GRPOTrainer`` and overrides some of its private methods; a few behaviours
also depend on how TRL's code is written inside them. Each such dependency is one entry below, with the TRL file it
was read from (TRL 1.16.0 throughout, :data:`TRL_READ`). :func:`check_trl` verifies every entry against the
installed TRL (signatures, and where an entry depends on the order or form of TRL's code, that code) and the
trainer calls it when it is built: an upstream change fails loudly, naming the entry, instead of training silently
wrong. ``tests/test_upstream.py`` runs the same checks in CI.

vLLM's private names live in ``trl_moe_replay.generation.vllm_cpu_capture`` (the CPU capture plugin, which is
meant to be proposed upstream as is); every other use of vLLM goes through TRL or vLLM's public API.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import trl
from trl import GRPOTrainer

TRL_READ = "1.16.0"
"""The TRL version every entry below was read from."""


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
}

# Private attributes of GRPOTrainer the package reads or writes (set in GRPOTrainer.__init__):
#   _metrics[mode][name]: TRL's metric lists, averaged by GRPOTrainer.log (the way TRL trainers log);
#   _tokenizer: the tokenizer behind processing_class (pad token id); pad_to_multiple_of: TRL's padding multiple;
#   vllm_generation: TRL's VLLMGeneration (use_vllm=True).
PRIVATE_ATTRIBUTES = ("_metrics", "_tokenizer")


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
# 8. vLLM colocate mode: the LLM TRL builds (trl/generation/vllm_generation.py).
#    VLLMGeneration._init_vllm builds `LLM(...)` from the module-global name `LLM` with a fixed argument list (no
#    pass-through), with distributed_executor_backend="external_launcher"; VLLMGeneration.generate calls
#    `self.llm.generate(...)` and keeps only token ids and log-probs from the returned RequestOutputs. To get
#    `enable_return_routed_experts=True` and the outputs, the LLM class is chosen at construction: the trainer
#    builds TRL's VLLMGeneration while that name refers to a subclass (`llm_class`).
# ---------------------------------------------------------------------------------------------------------------
_VLLM_GENERATION_MODULE = "trl.generation.vllm_generation"


@contextlib.contextmanager
def colocated_llm_class(make_subclass: Callable[[type], type]) -> Iterator[None]:
    """While the trainer builds TRL's ``VLLMGeneration``, its ``LLM`` is ``make_subclass(vllm.LLM)``.

    Without vLLM installed the name does not exist; TRL then raises its own ImportError, unchanged.
    """
    module = importlib.import_module(_VLLM_GENERATION_MODULE)
    original = getattr(module, "LLM", None)
    if original is None:
        yield
        return
    module.LLM = make_subclass(original)
    try:
        yield
    finally:
        module.LLM = original


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
# Checks
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    entry: str
    problem: str

    def __str__(self) -> str:
        return f"[{self.entry}] {self.problem}"


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

    for name, params in OVERRIDDEN_METHODS.items():
        method = getattr(trainer_class, name, None)
        if method is None:
            findings.append(Finding("1", f"GRPOTrainer.{name} no longer exists"))
            continue
        have = tuple(inspect.signature(method).parameters)
        expect("1", have[: len(params)] == params, f"GRPOTrainer.{name}{params} became {name}{have}")
    expect("1", isinstance(inspect.getattr_static(trainer_class, "get_gamma_weights"), staticmethod),
           "GRPOTrainer.get_gamma_weights is no longer a static method")

    init = _code_only(_source(trainer_class.__init__))
    for attribute in PRIVATE_ATTRIBUTES:
        expect("1", f"self.{attribute} =" in init, f"GRPOTrainer.__init__ no longer sets self.{attribute}")

    scoring = _code_only(_source(trainer_class._generate_and_score_completions))
    loss = _code_only(_source(trainer_class._compute_loss))
    expect("2", scoring.count(_ENGINE_CONDITION) >= 3,
           f"_generate_and_score_completions no longer keys its old-logprob pass, importance-sampling ratio and "
           f"metrics on `{_ENGINE_CONDITION}` (found {scoring.count(_ENGINE_CONDITION)} uses, expected >= 3)")
    expect("2", _ENGINE_CONDITION in loss, f"_compute_loss no longer applies the ratio under `{_ENGINE_CONDITION}`")
    generated_at, corrected_at = scoring.find("self._generate("), scoring.find(_ENGINE_CONDITION)
    expect("2", 0 <= generated_at < corrected_at,
           "_generate_and_score_completions no longer generates before it applies the engine correction")
    expect("2", "if self.use_vllm:" in _code_only(_source(trainer_class._generate_single_turn)),
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

    from trl.generation import vllm_client

    client_source = _code_only(_source(vllm_client.VLLMClient))
    expect("7", "self.session = requests.Session()" in client_source, "VLLMClient no longer keeps self.session")
    expect("7", "self.session.post(" in _code_only(_source(vllm_client.VLLMClient._post)),
           "VLLMClient._post no longer posts through self.session")
    expect("7", '"/v1/completions"' in _code_only(_source(vllm_client.VLLMClient.generate)).replace(
        "{self.base_url}", ""), "VLLMClient.generate no longer posts to /v1/completions")

    generation = importlib.import_module(_VLLM_GENERATION_MODULE)
    init_vllm = _code_only(_source(generation.VLLMGeneration._init_vllm))
    expect("8", "= LLM(" in init_vllm, "VLLMGeneration._init_vllm no longer builds the module-global LLM")
    vllm_generate = _code_only(_source(generation.VLLMGeneration.generate))
    expect("8", "self.llm.generate(" in vllm_generate, "VLLMGeneration.generate no longer calls self.llm.generate")
    expect("9", '"generation_kwargs": self.generation_kwargs' in vllm_generate
           and "generation_kwargs.update(self.generation_kwargs)" in vllm_generate,
           "VLLMGeneration.generate no longer merges self.generation_kwargs into its server and colocate requests")
    return tuple(findings)


def assert_trl_compatible(trainer_class: type = GRPOTrainer) -> None:
    """Raise :class:`UpstreamChangedError` listing every entry the installed TRL breaks."""
    findings = check_trl(trainer_class)
    if findings:
        lines = "\n".join(f"  - {finding}" for finding in findings)
        raise UpstreamChangedError(
            f"trl_moe_replay was written against TRL {TRL_READ}; the installed TRL {trl.__version__} no longer "
            f"matches what it relies on (trl_moe_replay/upstream.py, by entry):\n{lines}\n"
            f"Install trl=={TRL_READ}, or a trl_moe_replay release that supports TRL {trl.__version__}."
        )
