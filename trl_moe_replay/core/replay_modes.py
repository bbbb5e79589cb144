"""The replay modes, each one declaration: the registry every mode-dependent part of the package reads.

A mode (:class:`ModeSpec`) says where its routes come from (:class:`RouteSource`), which forwards replay them, which
trainers take it (and why another refuses it), the defaults it changes (through ``replays``: the routing metrics, the
transformers-path correction, the strict launch and lock checks), its model-card papers, whether ``trl-moe-replay
audit`` measures it, and its row of the mode table in docs/usage.md (``tests/core/test_replay_modes.py`` keeps that
table equal to :func:`docs_table`). ``routing_replay`` is a :class:`ReplayMode`, a ``str`` naming a registered mode:
``"r3"`` in Python, YAML and the command line all work, ``== "r3"`` holds and ``to_dict()``/JSON write the string.

Add a mode with :func:`register_mode` (docs/maintaining.md, "Add a replay mode"); what changes which experts a token
uses is a rule of the public replay rule in ``routing/replay_rule.py``, not a mode.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


class TrainerKind(enum.StrEnum):
    """Which trainer a rule is resolved for: TRL's ``GRPOTrainer`` or its ``AsyncGRPOTrainer``."""

    SYNC = "sync"
    ASYNC = "async"


class RouteSource(enum.Enum):
    """Where the routes a mode replays come from."""

    ENGINE = "the inference engine's routes of the rollout"
    OLD_PASS = "the old policy's routes, recorded in the trainer's old-logprob pass"
    PREDICTED = "routes predicted from the old router logits and a learned bias"


#: Why TRL's async trainer refuses a mode whose routes come from an old-policy forward.
NO_OLD_PASS_IN_ASYNC = (
    "replays the routes of an old-policy forward, and TRL's AsyncGRPOTrainer runs none (the sampler's log-probs are "
    "the old ones; the only forward is the training one, which R2 would replay onto itself). Use 'r3' (the engine's "
    "routes) or 'none'."
)


@dataclass(frozen=True)
class ModeSpec:
    """One replay mode, declared once."""

    name: str
    """The ``routing_replay`` value."""
    source: RouteSource | None
    """Where the replayed routes come from (None: nothing replayed, plain TRL)."""
    routes_text: str
    """The docs table's "routes replayed in the old-logprob, reference and training forwards" cell."""
    backends_text: str
    """The docs table's "generation backends" cell."""
    trainers: frozenset[TrainerKind] = frozenset({TrainerKind.SYNC, TrainerKind.ASYNC})
    """The trainers that take it."""
    refusal: str = NO_OLD_PASS_IN_ASYNC
    """Why a trainer outside ``trainers`` refuses it (after ``routing_replay=<mode>``)."""
    papers: tuple[str, ...] = ()
    """Citation keys for the model card (``core/model_card.py``'s ``CITATIONS``, or ``bibtex`` below)."""
    bibtex: Mapping[str, str] = field(default_factory=dict)
    """BibTeX of papers the card cites that ``CITATIONS`` lacks, by key."""
    audited: bool = False
    """Whether ``trl-moe-replay audit`` measures a trainer pass under it (modes replaying the engine's routes, and
    ``none``)."""
    default: bool = False
    """The default ``routing_replay`` (the docs table says so)."""

    @property
    def replays(self) -> bool:
        """Whether training forwards replay routes; the defaults a replaying mode changes (docs/usage.md, "What the
        swap changes") follow from this."""
        return self.source is not None

    @property
    def card_tag(self) -> str:
        return f"routing-replay-{self.name}"

    def docs_row(self) -> str:
        shown = f'`"{self.name}"`' + (" (default)" if self.default else "")
        return f"| {shown} | {self.routes_text} | {self.backends_text} |"


_REGISTRY: dict[str, ReplayMode] = {}
_SPECS: dict[str, ModeSpec] = {}


class _Registered(type):
    """Iterating ``ReplayMode`` gives the registered modes, in registration order (as an enum's members)."""

    def __iter__(cls) -> Iterator[ReplayMode]:
        return iter(list(_REGISTRY.values()))

    def __len__(cls) -> int:
        return len(_REGISTRY)


class ReplayMode(str, metaclass=_Registered):
    """``routing_replay``: the ``str`` name of a registered mode. ``ReplayMode("r3")`` is the one ``ReplayMode.R3``
    (``is`` holds); an unknown name is a ``ValueError``. What the mode implies is read from its :class:`ModeSpec`."""

    __slots__ = ()
    NONE: ClassVar[ReplayMode]
    R2: ClassVar[ReplayMode]
    R3: ClassVar[ReplayMode]
    PR2: ClassVar[ReplayMode]

    def __new__(cls, value: Any) -> ReplayMode:
        mode = _REGISTRY.get(value) if isinstance(value, str) else None
        if mode is None:
            raise ValueError(f"{value!r} is not a registered routing_replay mode ({list(_REGISTRY)})")
        return mode

    def __repr__(self) -> str:  # messages say routing_replay='r3', as the user wrote it
        return repr(str(self))

    def __str__(self) -> str:
        return str.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (and deep-copies) as the registered mode of that name
        return (ReplayMode, (str(self),))

    def __copy__(self) -> ReplayMode:
        return self

    def __deepcopy__(self, memo: Any) -> ReplayMode:
        return self

    @property
    def value(self) -> str:
        """The plain string, as an enum's ``value``."""
        return str(self)

    @property
    def spec(self) -> ModeSpec:
        return _SPECS[str(self)]

    @classmethod
    def parse(cls, value: Any, trainer: TrainerKind = TrainerKind.SYNC) -> ReplayMode:
        """``value`` as a mode this trainer accepts, or ``ValueError`` in one line saying why not."""
        mode = _REGISTRY.get(value) if isinstance(value, str) else None
        if mode is None:
            raise ValueError(f"routing_replay must be one of {list(_REGISTRY)}, got {value!r}")
        if trainer not in mode.spec.trainers:
            raise ValueError(f"routing_replay={mode!r} {mode.spec.refusal}")
        return mode

    @property
    def replays(self) -> bool:
        """Whether training forwards replay routes (``"none"`` is plain TRL)."""
        return self.spec.replays

    @property
    def source(self) -> RouteSource | None:
        return self.spec.source

    @property
    def needs_engine_routes(self) -> bool:
        """Whether the run cannot replay without the engine returning its routes (the first-batch rule applies)."""
        return self.source is RouteSource.ENGINE

    @property
    def records_old_pass(self) -> bool:
        """Whether the routes replayed are recorded in the trainer's old-logprob pass (R2; PR2's predicted ones)."""
        return self.source in (RouteSource.OLD_PASS, RouteSource.PREDICTED)

    @property
    def async_trainer_accepts(self) -> bool:
        """Whether TRL's async trainer takes it (it runs no old-policy forward)."""
        return TrainerKind.ASYNC in self.spec.trainers


def register_mode(spec: ModeSpec) -> ReplayMode:
    """Declare a mode: ``routing_replay=spec.name`` is then valid wherever ``spec`` says. Returns its ``ReplayMode``."""
    if spec.name in _REGISTRY:
        raise ValueError(f"a routing_replay mode named {spec.name!r} is already registered; pick another name")
    if spec.source is None and _REGISTRY and any(not m.replays for m in _REGISTRY.values()):
        raise ValueError(f"mode {spec.name!r} replays nothing, and 'none' already is that mode")
    if spec.source is not RouteSource.ENGINE and spec.source is not None and TrainerKind.ASYNC in spec.trainers:
        raise ValueError(
            f"mode {spec.name!r} replays {spec.source.value}, which TRL's async trainer never has: "
            "leave TrainerKind.ASYNC out of its trainers"
        )
    if spec.audited and spec.source not in (None, RouteSource.ENGINE):
        raise ValueError(f"mode {spec.name!r}: the audit replays the engine's routes only; set audited=False")
    mode = str.__new__(ReplayMode, spec.name)
    _SPECS[spec.name] = spec
    _REGISTRY[spec.name] = mode
    return mode


def unregister_mode(name: str) -> None:
    """Remove a mode registered with :func:`register_mode` (a test's toy mode); the built-in ones stay."""
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in routing_replay mode and cannot be removed")
    _REGISTRY.pop(name, None)
    _SPECS.pop(name, None)


class _ModeNames(Sequence[str]):
    """The registered modes' names, read live (so ``choices`` of ``routing_replay`` include a mode registered later)."""

    def __getitem__(self, index):  # type: ignore[override]  # an int or a slice, as a tuple takes them
        return tuple(_REGISTRY)[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(list(_REGISTRY))


#: Every registered mode's name, in registration order (a live view: the ``choices`` of ``routing_replay``).
MODE_NAMES: Sequence[str] = _ModeNames()


DOCS_TABLE_HEADER = (
    "| `routing_replay` | routes replayed in the old-logprob, reference and training forwards (and "
    "their backward) | generation backends |\n|---|---|---|"
)


def docs_table() -> str:
    """The mode table of docs/usage.md ("Modes and losses"), generated from the registry."""
    return "\n".join([DOCS_TABLE_HEADER, *(mode.spec.docs_row() for mode in ReplayMode)])


_SYNC_ONLY = frozenset({TrainerKind.SYNC})

ReplayMode.NONE = register_mode(
    ModeSpec(
        "none",
        None,
        routes_text="none: plain `trl.GRPOTrainer`, bit for bit (`routing_metrics=True` adds the routing metrics without "
        "changing a TRL number)",
        backends_text="all",
        audited=True,
    )
)
ReplayMode.R2 = register_mode(
    ModeSpec(
        "r2",
        RouteSource.OLD_PASS,
        routes_text="the old policy's routes, recorded in the trainer's old-logprob pass, in the later updates of that "
        "generation batch (a no-op when the configuration is on-policy; the trainer says so)",
        backends_text="all",
        trainers=_SYNC_ONLY,
        # R2 (vanilla routing replay) was introduced with GSPO and defined against R3 in the MiniRL paper
        papers=("gspo", "minirl"),
    )
)
ReplayMode.R3 = register_mode(
    ModeSpec(
        "r3",
        RouteSource.ENGINE,
        routes_text="the routes the inference engine used while sampling: transformers `generate` (recorded by hooks), "
        "vLLM's `routed_experts` (server and colocate mode)",
        backends_text="transformers, vLLM",
        papers=("r3",),
        audited=True,
        default=True,
    )
)
ReplayMode.PR2 = register_mode(
    ModeSpec(
        "pr2",
        RouteSource.PREDICTED,
        routes_text="R2 with a learned forecast of the router's drift: the old-logprob pass routes by the router logits "
        "plus a zero-initialised linear predictor per router, and that route is replayed (see [PR2](pr2.md))",
        backends_text="all (`pr2_rollout_prediction`: transformers)",
        trainers=_SYNC_ONLY,
        papers=("pr2",),
    )
)
_BUILT_IN = frozenset(_REGISTRY)
