"""What an entry of the seam is, the registry of every entry by name, and the errors the seam raises.

An entry is one reliance on an upstream library beyond its public API: a private name, or the order or form of
upstream code the package depends on. Each part of the seam (``torch_seam``, ``transformers_seam``, ``trl_seam``,
``trl_async_seam``) declares its entries with :func:`entry` next to the functions that use them (``vllm_seam``
declares those the vLLM plugin keeps itself); citations elsewhere in the package name the entry (``seam entry
`old_logps_after_forward```), never a number.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import TrlMoeReplayError


ENTRIES: dict[str, Entry] = {}
"""Every entry of the seam by name, filled as the parts are imported (``trl_moe_replay.upstream.all_entries()``)."""


@dataclass(frozen=True)
class Entry:
    """One reliance on an upstream library.

    ``read_from``: the version its code was read from; ``verified_on``: the versions the entry's check passed and the
    test suite ran green on. ``inherited``: private names of an upstream class that our subclasses override or use
    as ``self._name`` (declared here so that ``tests/cross_cutting/test_layout.py`` can tell a declared use from a leak).
    """

    name: str
    library: str
    read_from: str
    verified_on: tuple[str, ...]
    inherited: tuple[str, ...] = ()


def entry(
    name: str,
    library: str,
    read_from: str,
    verified_on: tuple[str, ...] | None = None,
    inherited: tuple[str, ...] = (),
) -> Entry:
    """Declare (and register) an entry; ``verified_on`` defaults to ``(read_from,)``."""
    if name in ENTRIES:
        raise ValueError(f"seam entry {name!r} is declared twice")
    declared = Entry(name, library, read_from, verified_on or (read_from,), inherited)
    ENTRIES[name] = declared
    return declared


@dataclass(frozen=True)
class Finding:
    """What no longer holds of an entry in the installed library."""

    entry: Entry
    problem: str

    def __str__(self) -> str:
        return (
            f"[{self.entry.name}] {self.problem} (read from {self.entry.library} {self.entry.read_from}; "
            f"verified on {', '.join(self.entry.verified_on)})"
        )


def method_finding(
    declared: Entry, owner: Any, label: str, name: str, params: tuple[str, ...], exact: bool = False
) -> Finding | None:
    """The finding when ``owner.name`` (``label.name`` in the message) no longer exists or no longer starts with the
    parameters ``params`` the package calls or overrides it with (``exact``: has exactly them); else None."""
    method = getattr(owner, name, None)
    if not callable(method):
        return Finding(declared, f"{label}.{name} does not exist")
    have = tuple(inspect.signature(method).parameters)
    if (have if exact else have[: len(params)]) != params:
        return Finding(declared, f"{label}.{name}{params} became {name}{have}")
    return None


def installed_versions(findings: Sequence[Finding]) -> str:
    """``"transformers 5.22.2"``: the installed version of each library ``findings`` name, for a message that blames
    the library that changed (not TRL for a transformers entry)."""
    libraries = sorted({finding.entry.library for finding in findings})
    return " and ".join(f"{library} {_version_of(library)}" for library in libraries)


def _version_of(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


class UpstreamChangedError(TrlMoeReplayError, RuntimeError):
    """The installed TRL no longer matches what this package relies on (see ``trl_seam.check_trl``)."""


class TransformersChangedError(TrlMoeReplayError, RuntimeError):
    """The installed transformers no longer matches an entry of ``upstream/transformers_seam.py`` (named in the
    message)."""
