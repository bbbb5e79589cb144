"""Router families: which router classes we can replay, and how each one turns logits into gate weights.

Every supported transformers router returns ``(router_logits [N, E], gate_weights [N, K], expert_ids [N, K])``
for ``N`` flattened tokens. Replay keeps the logits and the router's own normalisation, and only swaps the
expert ids; so each family needs one *gate-weight function*: a line-by-line copy of the tail of the router's
``forward`` with ``torch.topk(...)`` replaced by ``.gather(1, ids)``. For the router's own ids it reproduces
the router's gate weights bit for bit, dtype included (``tests/test_families.py`` checks this for every row,
which guards against transformers changing a router's internals).

Adding a family is one ``RouterFamily`` row plus a tiny config in ``trl_moe_replay.testing``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GateWeightFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RouterFamily:
    """One row of the family table."""

    name: str
    """Human-readable family name, as shown in errors and the README table."""
    router_classes: tuple[str, ...]
    """Router class names (matched along the MRO, so FSDP2's ``FSDP<Class>`` subclasses match too)."""
    gate_weights: GateWeightFn
    """``(router, logits, ids) -> weights``: the router's own normalisation at the given ids."""
    hub_kernel: str | None = None
    """Name of a hub kernel that replaces the whole MoE block (and so bypasses the router) when the model
    runs with ``use_kernels=True``; such models are refused."""


def softmax_then_renormalise(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral: fp32 softmax over all experts, gather, always renormalise; weights stay fp32."""
    weights = F.softmax(logits.float(), dim=-1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def softmax_optional_renormalise(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen2/Qwen3-MoE, Qwen3-Next, OLMoE: fp32 softmax, gather, renormalise iff ``norm_topk_prob``,
    cast back to the logits dtype."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def sigmoid_scaled(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores *without* the correction bias (the bias only steers the choice),
    renormalised (+1e-20) iff ``norm_topk_prob``, times ``routed_scaling_factor``."""
    weights = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_over_selected_logits(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the k selected raw logits (bias included in the logits)."""
    selected = logits.gather(1, ids)
    return F.softmax(selected, dim=1, dtype=selected.dtype)


ROUTER_FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily("Mixtral", ("MixtralTopKRouter",), softmax_then_renormalise),
    RouterFamily("Qwen3-MoE", ("Qwen3MoeTopKRouter",), softmax_optional_renormalise),
    RouterFamily("OLMoE", ("OlmoeTopKRouter",), softmax_optional_renormalise),
    RouterFamily("Qwen2-MoE", ("Qwen2MoeTopKRouter",), softmax_optional_renormalise),
    RouterFamily("Qwen3-Next", ("Qwen3NextTopKRouter",), softmax_optional_renormalise),
    RouterFamily("DeepSeek-V3", ("DeepseekV3TopkRouter",), sigmoid_scaled),
    RouterFamily("GPT-OSS", ("GptOssTopKRouter",), softmax_over_selected_logits, hub_kernel="MegaBlocksMoeMLP"),
)

_FAMILY_BY_CLASS = {cls: family for family in ROUTER_FAMILIES for cls in family.router_classes}


def family_of(module: nn.Module) -> RouterFamily | None:
    """The family whose router class ``module`` is (walking the MRO), or ``None``."""
    for cls in type(module).__mro__:
        family = _FAMILY_BY_CLASS.get(cls.__name__)
        if family is not None:
            return family
    return None


def supported_family_names() -> list[str]:
    return [family.name for family in ROUTER_FAMILIES]
