"""What a run's model card says beyond TRL's: the routing mode (in the trainer's name and a tag) and the citations of
the methods the run used (R3, R2, PR2, GSPO, RSPO, MiniRL), after TRL's own (GRPO's DeepSeekMath). A mode's papers and
tag are its declaration's (``core/replay_modes.py``).

TRL's ``create_model_card`` writes the card; :func:`card_identity` gives it the name, citations and tags, and both
trainers pass them through the seam entry ``model_card_identity``. Authors are given as the papers list them in
``shared/research/papers.md`` (surnames), arXiv ids as published.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..upstream import model_card_identity
from .replay_modes import ReplayMode
from .routing_options import option


#: BibTeX of each paper a method comes from, keyed by method.
CITATIONS: dict[str, str] = {
    "r3": """@article{ma2025r3,
    title        = {{Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers}},
    author       = {Ma and Zhang and Zhao and Song and Wang and Sui and Luo},
    year         = 2025,
    eprint       = {arXiv:2510.11370},
}""",
    "gspo": """@article{zheng2025gspo,
    title        = {{Group Sequence Policy Optimization}},
    author       = {Zheng and others},
    year         = 2025,
    eprint       = {arXiv:2507.18071},
}""",
    "minirl": """@article{zheng2025minirl,
    title        = {{Stabilizing Reinforcement Learning with LLMs: Formulation and Practices}},
    author       = {Zheng and Dang and Yu and others},
    year         = 2025,
    eprint       = {arXiv:2512.01374},
}""",
    "rspo": """@article{zhang2025rspo,
    title        = {{Towards Stable and Effective Reinforcement Learning for Mixture-of-Experts}},
    author       = {Zhang and Wu and Huang and Jiang and Hao and Dong and Chi and Sui and Wei},
    year         = 2025,
    eprint       = {arXiv:2510.23027},
}""",
    # the method's name: its arXiv title was not available offline when this was written (research notes)
    "pr2": """@article{dong2026pr2,
    title        = {{Predictive Routing Replay (PR2)}},
    note         = {Title as the method is named; see arXiv:2606.00395 for the paper's own},
    author       = {Dong and Chen and Jia and Liu and Wu and Di and Wu and Liu and Liu and Barsoum and Metaxas and Wang},
    year         = 2026,
    eprint       = {arXiv:2606.00395},
}""",
}
_LOSS_PAPERS: dict[str | None, tuple[str, ...]] = {
    "gspo": ("gspo",),
    "rspo": ("rspo", "gspo"),
    "minirl": ("minirl",),
}


def methods_used(args: Any, mode: str) -> list[str]:
    """The papers (keys of :data:`CITATIONS`) behind ``args``'s routing mode and objective, in citation order."""
    keys = [*ReplayMode(mode).spec.papers, *_LOSS_PAPERS.get(getattr(args, "loss_type", None), ())]
    # a sync-trainer field (MoEReplayGRPOConfig): a config without it (the async trainer's; TRL's, whose loss types
    # never resolve it on) weights nothing. option() would need the sync config's module imported for its default,
    # which a run of the async trainer alone never does.
    if hasattr(args, "router_shift_weighting") and option(args, "router_shift_weighting"):
        keys.append("rspo")
    if getattr(args, "importance_sampling_level", None) == "sequence":
        keys.append("gspo")
    return list(dict.fromkeys(keys))


def card_identity(args: Any, mode: str) -> tuple[str, list[str], list[str]]:
    """``(qualifier of the trainer's name, citations, extra tags)`` for TRL's model card: the name carries the routing
    mode and the loss (``MoE Replay GRPO (routing_replay=r3, loss_type=dapo)``); the citations are each method's (TRL
    adds its own first)."""
    qualifier = f"(routing_replay={mode}, loss_type={getattr(args, 'loss_type', None)})"
    spec = ReplayMode(mode).spec
    bibtex = {**CITATIONS, **spec.bibtex}
    return qualifier, [bibtex[key] for key in methods_used(args, mode)], [spec.card_tag]


def write_model_card(
    trainer: Any,
    create: Callable[..., Any],
    model_name: str | None,
    dataset_name: str | None,
    tags: str | list[str] | None,
) -> Any:
    """Both trainers' ``create_model_card``: TRL's (``create``, the parent's bound method) with the routing mode in
    the trainer's name and a tag, and the citations of the methods used."""
    qualifier, citations, extra = card_identity(trainer.args, trainer.routing_replay)
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    with model_card_identity(trainer, qualifier, citations):
        return create(model_name=model_name, dataset_name=dataset_name, tags=[*tags, *extra])
