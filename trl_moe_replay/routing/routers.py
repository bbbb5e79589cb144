"""Router families: which router classes we can replay, and how each one turns logits into gate weights.

Every supported transformers router returns ``(router_logits [N, E], gate_weights [N, K], expert_ids [N, K])``
for ``N`` flattened tokens. Replay keeps the logits and the router's own normalisation, and only swaps the
expert ids; so each family needs one *gate-weight function*: a line-by-line copy of the tail of the router's
``forward`` with ``torch.topk(...)`` replaced by ``.gather(1, ids)``. For the router's own ids it reproduces
the router's gate weights bit for bit, dtype included (``tests/routing/test_routers.py`` checks this for every row,
which guards against transformers changing a router's internals).

Adding a family is one ``RouterFamily`` row plus a tiny config in ``trl_moe_replay.testing``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch import nn

from ..upstream import transformers_seam
from .errors import TransformersTooOldError


# A family's router module: read by duck typing (each family names its own attributes: norm_topk_prob,
# routed_scaling_factor, score_fn, ...), which nn.Module's typed __getattr__ (Tensor | Module) cannot express
Router = Any
GateWeightFn = Callable[[Router, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RouterFamily:
    """One row of the family table."""

    name: str
    """Human-readable family name, as shown in errors and the README table."""
    router_classes: tuple[str, ...]
    """Router class names (matched along the MRO, so FSDP2's ``FSDP<Class>`` subclasses match too)."""
    gate_weights: GateWeightFn
    """``(router, logits, ids) -> weights``: the router's own normalisation at the given ids."""
    model_types: tuple[str, ...] = ()
    """transformers ``model_type`` strings of the family's models (text config), for the version refusal."""
    min_transformers: str = "5.16.1"
    """The first transformers with this family's router class (the declared floor for the older families). On an
    older transformers the model trains without a replayable router, so the trainer refuses it, naming this."""
    hub_kernel: str | None = None
    """Name of a hub kernel that replaces the whole MoE block (and so bypasses the router) or the router's own
    forward (whose weights then need not match the gate-weight function) when the model runs with
    ``use_kernels=True``. A model whose router or block a Hub kernel did replace is refused; where the installed
    ``kernels`` cannot say which layers it replaced, every model of such a family that runs with ``use_kernels=True``
    is (seam entry ``hub_kernels``)."""


def softmax_then_renormalise(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: fp32 softmax over all experts, gather, always renormalise; weights stay fp32."""
    weights = F.softmax(logits.float(), dim=-1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def softmax_optional_renormalise(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen2/Qwen3-MoE, Qwen3-Next, OLMoE, FlexOlmo, Mellum, Qwen4-Exp: fp32 softmax, gather, renormalise iff
    ``norm_topk_prob``, cast back to the logits dtype."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def sigmoid_scaled(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 and its copies (DeepSeek-V3.2, dots.llm1, dots3-note, GLM-4-MoE(-Lite), GLM-MoE-DSA, EXAONE-MoE,
    MiMo-V2-Flash, Nemotron-H, A.X-K1/K2, Bailing-Hybrid, HY-V4, Kimi-Linear, Solar-Open): sigmoid of the fp32
    logits *without* the correction bias (the bias and the group mask only steer the choice), renormalised
    (+1e-20) iff ``norm_topk_prob``, times ``routed_scaling_factor``."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_over_selected_logits(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS, Aria: softmax over the k selected raw logits in their dtype (GPT-OSS's bias is included in the
    logits; Aria's ``F.softmax`` without ``dtype`` is the same op)."""
    selected = logits.gather(1, ids)
    return F.softmax(selected, dim=1, dtype=selected.dtype)


def _router_input_dtype(router: Router) -> torch.dtype:
    """The dtype of the hidden states the router was called with, for routers that cast their weights to it
    (``.to(hidden_states.dtype)``), which a gate-weight function does not see.

    Outside autocast their ``F.linear(hidden_states, self.weight)`` only runs when both share a dtype. Under
    autocast the router is fed from a norm that returns the residual stream's dtype, i.e. the parameter dtype
    (checked: CPU bf16 autocast of an fp32 model replays bit for bit). None of these routers' weights is in its
    model's ``_keep_in_fp32_modules``, so a bf16 checkpoint has a bf16 router weight. A router whose weight is kept
    in fp32 while its input is bf16 (Ernie-4.5-MoE) would break this, which is why that family is not in the table.
    """
    return router.weight.dtype


def softmax_scaled(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2: fp32 softmax over all experts (the logits are fp32), gather, never renormalised, times
    ``routed_scaling_factor``. ``group_limited_greedy`` zeroes the other groups' scores before the top-k, which
    only steers the choice as long as ``top_k <= topk_group * n_experts / n_group`` (true of every config)."""
    weights = logits.softmax(dim=-1, dtype=torch.float32).gather(1, ids)
    return weights * router.routed_scaling_factor


def softmax_renormalise_cast(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3.5-MoE: the Qwen3-MoE tail with renormalisation always on (the router has no ``norm_topk_prob``)."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def softmax_then_cast_to_input(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Jamba: fp32 softmax over all experts, gather, never renormalised, cast to the router input's dtype."""
    weights = F.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    return weights.to(_router_input_dtype(router))


def softmax_over_selected_logits_cast_to_input(
    router: Router, logits: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """GraniteMoe (and its -Shared, -Hybrid, -SWA variants): softmax over the k selected fp32 logits, cast to the
    router input's dtype."""
    selected = logits.gather(1, ids)
    return torch.softmax(selected, dim=-1).type(_router_input_dtype(router))


def cohere2_moe_selected_logits(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cohere2-MoE: on the k selected logits, either an fp32 softmax (``expert_selection_fn="softmax"``) or a
    sigmoid renormalised iff ``norm_topk_prob`` (``"sigmoid"``); cast to the router input's dtype."""
    selected = logits.gather(1, ids)
    if router.expert_selection_fn == "softmax":
        weights = F.softmax(selected, dim=1, dtype=torch.float)
    elif router.expert_selection_fn == "sigmoid":
        weights = F.sigmoid(selected)
        if router.norm_topk_prob:
            weights = weights / torch.sum(weights, dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown expert_selection_fn {router.expert_selection_fn!r}")
    return weights.to(_router_input_dtype(router))


def lfm2_moe_sigmoid(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """LFM2-MoE: sigmoid in the logits dtype (the expert bias only steers the choice), renormalised (+1e-6) iff
    ``norm_topk_prob``, times ``routed_scaling_factor``."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * router.routed_scaling_factor


def sigmoid_renormalise(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MiniMax-M3-VL (text): fp32 sigmoid (the correction bias only steers the choice), gather, always renormalised
    (no epsilon); weights stay fp32. The block's ``routed_scaling_factor`` is applied after the experts."""
    weights = F.sigmoid(logits.float()).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def sigmoid_renormalise_cast_to_input(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Laguna: sigmoid of the fp32 (optionally soft-capped: the returned logits are the capped ones) logits, the
    bias only steers the choice, always renormalised (no epsilon), cast to the router input's dtype. The block's
    ``routed_scaling_factor`` is applied after the experts."""
    weights = torch.sigmoid(logits).gather(-1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(_router_input_dtype(router))


def sigmoid_optional_renormalise(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Flint: sigmoid of all fp32 logits, gather, renormalised (no epsilon) iff ``norm_topk_prob``; weights stay
    fp32."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def sigmoid_of_selected_logits_optional_renormalise(
    router: Router, logits: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Kolibri1: gather the fp32 logits, *then* sigmoid (the bias only steers the choice), renormalised (no
    epsilon) iff ``norm_topk_prob``; weights stay fp32. The order matters: a CPU sigmoid over ``[N, E]`` and over
    ``[N, K]`` can differ in the last bit, so this is not Flint's function."""
    weights = logits.gather(1, ids).sigmoid()
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def sigmoid_optional_renormalise_eps(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Beam: the DeepSeek-V3 tail without the scaling (the block applies ``routed_scaling_factor`` after the
    experts): fp32 sigmoid, gather, renormalised (+1e-20) iff ``norm_topk_prob``."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights


def scored_renormalise_scaled(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4: the router's ``score_fn`` (``scoring_func``: sqrtsoftplus, sigmoid, ...) on the logits in their
    dtype (the bias only steers the choice), gather, always renormalised (+1e-20), times ``routed_scaling_factor``.
    Hash-routed layers (``mlp_layer_types="hash_moe"``, ``DeepseekV4HashRouter``: experts from the token id) are
    not routers of this family and are left alone."""
    weights = router.score_fn(logits).gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


ROUTER_FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily("Mixtral", ("MixtralTopKRouter",), softmax_then_renormalise),
    RouterFamily("Qwen3-MoE", ("Qwen3MoeTopKRouter",), softmax_optional_renormalise),
    RouterFamily("OLMoE", ("OlmoeTopKRouter",), softmax_optional_renormalise),
    RouterFamily("Qwen2-MoE", ("Qwen2MoeTopKRouter",), softmax_optional_renormalise),
    RouterFamily("Qwen3-Next", ("Qwen3NextTopKRouter",), softmax_optional_renormalise),
    RouterFamily("DeepSeek-V3", ("DeepseekV3TopkRouter",), sigmoid_scaled),
    RouterFamily("GPT-OSS", ("GptOssTopKRouter",), softmax_over_selected_logits, hub_kernel="MegaBlocksMoeMLP"),
    # Same router code as one of the families above.
    RouterFamily("FlexOlmo", ("FlexOlmoTopKRouter",), softmax_optional_renormalise),
    RouterFamily("Mellum", ("MellumTopKRouter",), softmax_optional_renormalise),
    RouterFamily("Qwen4-Exp", ("Qwen4ExpTextTopKRouter",), softmax_optional_renormalise),
    RouterFamily(
        "Aria",
        ("AriaTextTopKRouter",),
        softmax_over_selected_logits,
        model_types=("aria_text",),
        min_transformers="5.18.0",
    ),
    RouterFamily("dots.llm1", ("Dots1TopkRouter",), sigmoid_scaled),
    RouterFamily(
        "dots3-note",
        ("Dots3NoteTextTopkRouter",),
        sigmoid_scaled,
        model_types=("dots3_note_text",),
        min_transformers="5.23.0",
    ),
    RouterFamily("GLM-4-MoE", ("Glm4MoeTopkRouter",), sigmoid_scaled),
    RouterFamily("GLM-4-MoE-Lite", ("Glm4MoeLiteTopkRouter",), sigmoid_scaled),
    RouterFamily("GLM-MoE-DSA", ("GlmMoeDsaTopkRouter",), sigmoid_scaled),
    RouterFamily("DeepSeek-V3.2", ("DeepseekV32TopkRouter",), sigmoid_scaled),
    RouterFamily("EXAONE-MoE", ("ExaoneMoeTopkRouter",), sigmoid_scaled),
    RouterFamily("MiMo-V2-Flash", ("MiMoV2FlashTopkRouter",), sigmoid_scaled),
    RouterFamily("Nemotron-H", ("NemotronHTopkRouter",), sigmoid_scaled),
    RouterFamily("A.X-K1", ("AXK1TopkRouter",), sigmoid_scaled),
    RouterFamily("A.X-K2", ("AXK2TopkRouter",), sigmoid_scaled),
    RouterFamily(
        "Bailing-Hybrid",
        ("BailingHybridTopkRouter",),
        sigmoid_scaled,
        model_types=("bailing_hybrid",),
        min_transformers="5.20.0",
    ),
    RouterFamily("HY-V4", ("HYV4TopkRouter",), sigmoid_scaled, model_types=("hy_v4",), min_transformers="5.17.0"),
    RouterFamily(
        "Kimi-Linear",
        ("KimiLinearTopkRouter",),
        sigmoid_scaled,
        model_types=("kimi_linear",),
        min_transformers="5.17.0",
    ),
    RouterFamily("Solar-Open", ("SolarOpenTopkRouter",), sigmoid_scaled),
    # Own gate-weight function.
    RouterFamily("DeepSeek-V2", ("DeepseekV2TopkRouter",), softmax_scaled),
    RouterFamily("Qwen3.5-MoE", ("Qwen3_5MoeTopKRouter",), softmax_renormalise_cast, hub_kernel="SoftmaxTopKRouter"),
    RouterFamily(
        "Jamba", ("JambaTopKRouter",), softmax_then_cast_to_input, model_types=("jamba",), min_transformers="5.21.0"
    ),
    RouterFamily(
        "GraniteMoe",
        (
            "GraniteMoeTopKRouter",
            "GraniteMoeSharedTopKRouter",
            "GraniteMoeHybridTopKRouter",
            "GraniteMoeSWATopKRouter",
        ),
        softmax_over_selected_logits_cast_to_input,
    ),
    RouterFamily("Cohere2-MoE", ("Cohere2MoeTopKRouter",), cohere2_moe_selected_logits),
    RouterFamily("LFM2-MoE", ("Lfm2MoeTopKRouter",), lfm2_moe_sigmoid),
    RouterFamily("MiniMax-M3-VL", ("MiniMaxM3VLTopKRouter",), sigmoid_renormalise),
    RouterFamily("Laguna", ("LagunaTopKRouter",), sigmoid_renormalise_cast_to_input, hub_kernel="SoftmaxTopKRouter"),
    RouterFamily(
        "Flint", ("FlintTopKRouter",), sigmoid_optional_renormalise, model_types=("flint",), min_transformers="5.21.0"
    ),
    RouterFamily(
        "Kolibri1",
        ("Kolibri1TopKRouter",),
        sigmoid_of_selected_logits_optional_renormalise,
        model_types=("kolibri1",),
        min_transformers="5.20.0",
    ),
    RouterFamily(
        "Beam", ("BeamTopKRouter",), sigmoid_optional_renormalise_eps, model_types=("beam",), min_transformers="5.21.0"
    ),
    RouterFamily("DeepSeek-V4", ("DeepseekV4TopKRouter",), scored_renormalise_scaled),
)

_FAMILY_BY_MODEL_TYPE = {model_type: family for family in ROUTER_FAMILIES for model_type in family.model_types}
_FAMILY_BY_CLASS = {cls: family for family in ROUTER_FAMILIES for cls in family.router_classes}


def family_of(module: nn.Module) -> RouterFamily | None:
    """The family whose router class ``module`` is (walking the MRO), or ``None``."""
    for cls in type(module).__mro__:
        family = _FAMILY_BY_CLASS.get(cls.__name__)
        if family is not None:
            return family
    return None


def min_transformers_for(model_type: str) -> str | None:
    """The first transformers whose ``model_type`` models have a replayable router, for the families that arrived
    after the declared floor; ``None`` for the others."""
    family = _FAMILY_BY_MODEL_TYPE.get(model_type)
    return family.min_transformers if family is not None else None


def supported_family_names() -> list[str]:
    return [family.name for family in ROUTER_FAMILIES]


def refuse_if_transformers_too_old(config, families: set[RouterFamily]) -> None:
    """Raise :class:`TransformersTooOldError` when the installed transformers predates the router class of
    ``config``'s family, or of one of ``families`` (found in the model). Jamba before 5.21 and Aria before 5.18,
    for instance, exist but route inside their MoE block, with nothing to replay."""
    installed = transformers_seam.transformers_version()
    model_type = getattr(config, "model_type", None)
    by_type = _FAMILY_BY_MODEL_TYPE.get(model_type) if model_type is not None else None
    for family in sorted(families | ({by_type} if by_type else set()), key=lambda f: f.name):
        if Version(installed) < Version(family.min_transformers):
            raise TransformersTooOldError(
                f"{family.name} models need transformers >= {family.min_transformers} for routing replay (its "
                f"router class {family.router_classes[0]} arrived there); transformers {installed} "
                f"is installed. Upgrade transformers (pip install 'transformers>={family.min_transformers}'), or "
                'train with routing_replay="none".'
            )
