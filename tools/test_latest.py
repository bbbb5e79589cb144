"""`make test-latest`: the newest release of every runtime dependency, our upper bounds ignored, and the fast subset.

    python tools/test_latest.py                      # build .venv-latest, install, run the fast subset, print the table
    python tools/test_latest.py --venv DIR           # reuse DIR (already built) instead of building .venv-latest
    python tools/test_latest.py --venv DIR --junit FILE   # reuse a fast-subset run's JUnit XML too: only the table
    python tools/test_latest.py --cuda-torch         # the newest torch even where it is PyPI's CUDA build

A maintainer's command, not in .ci/run: it answers "which release that landed since our last bump breaks us?" the
day a release lands. For each dependency of ``pyproject.toml`` (``[project] dependencies`` and the ``plot`` extra)
it asks the package index for the newest release (``pip index versions NAME``), installs every one of them at that
version into a fresh virtual environment (each with its own dependencies, resolved by pip; the package itself with
``--no-deps``, so our caps do not pull anything back), runs the fast subset (``-m "not slow and not serial"``) there
with a JUnit report, and prints one table: dependency, newest version, our bound (and whether the newest is inside
it), what was installed, and, in its last row, the fast subset's result and its first failing test.

torch: PyPI's Linux wheel is the CUDA build (gigabytes, ~15 ``nvidia-*`` packages); where pip's sources offer a CPU
build of torch (a local wheel, as on the machines this project was built on) of another version, that build is
installed instead (``tools/cpu_install.py``'s rule) and the table says so; ``--cuda-torch`` installs the newest CUDA
build anyway (it runs on a CPU). A dependency whose newest release does not install (a resolver conflict, no wheel
for this Python) is left at what pip picks and marked ``no``. The fast subset's cell says "passed" only where pytest's
exit status says every test ran and passed: an interrupted, killed or errored session is named as such, with the
counts it reached (pytest's status is kept beside the report, ``fast-subset.rc``, for ``--junit``).

The pure parts (reading the bounds, the index's answer, the JUnit report; building the table) are tested in
tests/cross_cutting/test_test_latest.py; docs/maintaining.md, "A new release", says how to turn the table into a
bump.
"""

import argparse
import json
import re
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


ROOT = Path(__file__).resolve().parents[1]
FAST = "not slow and not serial"
EXTRAS = ("plot",)  # extras whose packages the package itself imports (the `test` extra's tools are pinned on purpose)


@dataclass(frozen=True)
class Row:
    """One dependency: its newest release, our bound, and what the environment got."""

    name: str
    newest: str | None  # None: the index has no release (or could not be asked)
    bound: SpecifierSet
    installed: str | None  # the version in the environment, None if absent
    note: str = ""

    @property
    def inside(self) -> bool | None:
        """Whether the newest release is inside our declared range (None where the newest is unknown)."""
        return None if self.newest is None else self.bound.contains(self.newest, prereleases=True)

    @property
    def installs(self) -> bool:
        """Whether the newest release is what the environment holds (a local version label aside)."""
        return (
            self.newest is not None
            and self.installed is not None
            and Version(self.installed).public == Version(self.newest).public
        )


# pytest's exit statuses (pytest.ExitCode) other than 0 (all passed) and 1 (some failed): the run did not finish
EXIT_WORDS = {2: "interrupted", 3: "pytest's internal error", 4: "usage error", 5: "no tests collected"}


@dataclass(frozen=True)
class FastRun:
    """A fast-subset run, from its JUnit report and pytest's exit status."""

    passed: int
    failed: int  # failures and errors
    skipped: int
    first_failure: str | None  # "tests/x/test_y.py::test_z", the first in the report's order
    interrupted: bool = False  # the report holds pytest's nameless placeholder of a session stopped midway
    exit_code: int | None = None  # pytest's exit status (negative: killed by that signal); None: unknown

    @property
    def verdict(self) -> str:
        """ "passed" only for a run that pytest says finished with every test passed; otherwise what went wrong."""
        code = self.exit_code
        if code is not None and code < 0:
            return f"killed (signal {-code})"
        if self.interrupted or code not in (None, 0, 1):
            word = EXIT_WORDS.get(code, f"pytest exit {code}") if code is not None else "interrupted"
            return f"not finished: {word}" + (f" (pytest exit {code})" if code in EXIT_WORDS else "")
        if self.failed or code == 1:
            return "failed"
        return "passed" if code == 0 else "no failure reported, pytest's exit status unknown"


def declared_bounds(pyproject_text: str, extras: tuple[str, ...] = EXTRAS) -> dict[str, SpecifierSet]:
    """``{name: specifier}`` of ``[project] dependencies`` and of ``extras``, in that order (a name in both keeps the
    first)."""
    project = tomllib.loads(pyproject_text)["project"]
    requirements = [
        *project["dependencies"],
        *(r for extra in extras for r in project["optional-dependencies"][extra]),
    ]
    bounds: dict[str, SpecifierSet] = {}
    for requirement in map(Requirement, requirements):
        bounds.setdefault(requirement.name, requirement.specifier)
    return bounds


INDEX_LINE = re.compile(r"^(?P<name>[A-Za-z0-9._-]+) \((?P<version>[^)]+)\)\s*$", re.M)


def newest_from_index(answer: str) -> str | None:
    """The newest release in ``pip index versions NAME``'s output (its first line, ``NAME (X.Y.Z)``), or None."""
    match = INDEX_LINE.search(answer)
    if match is None:
        return None
    try:
        return str(Version(match.group("version")))
    except InvalidVersion:
        return None


def fast_run_from_junit(xml_text: str, exit_code: int | None = None) -> FastRun:
    """The counts and the first failing test of a pytest JUnit report (``--junitxml``), with pytest's exit status.

    A session stopped midway (Ctrl-C, a test raising KeyboardInterrupt, ``pytest.exit``) still writes its report, with
    the tests that ran and one ``<testcase>`` without a name in place of the one it stopped in: that placeholder is
    neither passed nor failed, it marks the run as interrupted."""
    root = ET.fromstring(xml_text)
    passed = failed = skipped = 0
    first = None
    interrupted = False
    for case in root.iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed += 1
            if first is None:
                module = case.get("classname", "").replace(".", "/")
                first = f"{module}.py::{case.get('name')}" if module else str(case.get("name"))
        elif "skipped" in outcome:
            skipped += 1
        elif not case.get("name"):
            interrupted = True
        else:
            passed += 1
    return FastRun(passed, failed, skipped, first, interrupted, exit_code)


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def table(rows: list[Row], run: FastRun | None) -> str:
    """The report: one Markdown table, a row per dependency and a last row for the fast subset."""
    lines = [
        "| dependency | newest | our bound | newest inside it | installs | fast subset | first failing test |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        installed = "yes" if row.installs else ("no" if row.installed is None else f"no ({row.installed})")
        note = f"; {row.note}" if row.note else ""
        lines.append(
            f"| {row.name} | {row.newest or '?'} | `{row.bound or 'any'}` | {_yes_no(row.inside)} | "
            f"{installed}{note} | | |"
        )
    if run is None:
        result, first = "not run", ""
    else:
        result = f"{run.verdict}: {run.passed} passed, {run.failed} failed"
        result += f", {run.skipped} skipped" if run.skipped else ""
        first = run.first_failure or "none"
    lines.append(f"| (all of the above) | | | | | {result} | {first} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the impure parts
def _run(*command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def newest_release(python: str, name: str) -> str | None:
    """The newest release of ``name`` on pip's configured indexes."""
    return newest_from_index(_run(python, "-m", "pip", "index", "versions", name).stdout)


def installed_versions(python: str) -> dict[str, str]:
    """``{canonical name: version}`` of the environment."""
    listed = json.loads(_run(python, "-m", "pip", "list", "--format", "json", check=True).stdout)
    return {item["name"].lower().replace("_", "-"): item["version"] for item in listed}


def pip_install(python: str, *args: str) -> bool:
    result = _run(python, "-m", "pip", "install", "--quiet", *args)
    if result.returncode != 0:
        print(f"  pip install {' '.join(args)}: failed ({result.stderr.strip().splitlines()[-1:]})", flush=True)
    return result.returncode == 0


def install_torch(python: str, newest: str | None, cpu_version: str, cuda: bool = False) -> str:
    """torch at ``newest`` where pip would install a CPU build of it (or any build, with ``cuda``), else the CPU build
    ``cpu_version`` through tools/cpu_install.py (what ``make setup`` installs); returns the table's note ("" for the
    newest)."""
    from cpu_install import cuda_packages  # tools/ is on sys.path (main)

    if newest is not None:
        dry = _run(python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", f"torch=={newest}")
        if dry.returncode == 0 and (cuda or not cuda_packages(json.loads(dry.stdout)["install"])):
            return "" if pip_install(python, f"torch=={newest}") else "its newest release does not install here"
        why = "a CUDA build on this index" if dry.returncode == 0 else "not installable here"
    else:
        why = "unknown"
    subprocess.run([python, str(ROOT / "tools" / "cpu_install.py"), "torch", cpu_version], check=True)
    return f"the CPU build {cpu_version} instead (the newest: {why})"


def build(venv: Path, newest: dict[str, str | None], cpu_torch: str, cuda: bool = False) -> dict[str, str]:
    """A fresh environment at ``venv`` with every dependency at its newest release (torch: see
    :func:`install_torch`), the `test` extra's tools and the package (``--no-deps``); returns ``{name: note}``."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip_install(python, "--upgrade", "pip")
    notes = {"torch": install_torch(python, newest.get("torch"), cpu_torch, cuda)}
    torch = installed_versions(python).get("torch")
    pins = [f"{name}=={version}" for name, version in newest.items() if version and name != "torch"]
    if not pip_install(python, *pins, f"torch=={torch}"):  # one at a time: which of them does not install
        for pin in pins:
            if not pip_install(python, pin, f"torch=={torch}"):
                notes[pin.split("==")[0]] = "its newest release does not install here"
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pip_install(python, *test_extra, f"torch=={torch}")
    pip_install(python, "--no-deps", "-e", str(ROOT))
    return {name: note for name, note in notes.items() if note}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, help="reuse this environment instead of building .venv-latest")
    parser.add_argument("--junit", type=Path, help="reuse this fast-subset JUnit report instead of running the tests")
    parser.add_argument(
        "--cpu-torch",
        default="2.13.0",
        help="the CPU torch to install where the newest is a CUDA build (default: what make setup installs)",
    )
    parser.add_argument(
        "--cuda-torch",
        action="store_true",
        help="install the newest torch even where it is the "
        "CUDA build (gigabytes of nvidia-* packages; it runs on a CPU too)",
    )
    args = parser.parse_args(argv)
    bounds = declared_bounds((ROOT / "pyproject.toml").read_text())
    print(f"asking the index for the newest release of {', '.join(bounds)}...", flush=True)
    newest = {name: newest_release(sys.executable, name) for name in bounds}
    notes: dict[str, str] = {}
    venv = args.venv or ROOT / ".venv-latest"
    if args.venv is None:
        print(f"building {venv} (several minutes)...", flush=True)
        sys.path.insert(0, str(ROOT / "tools"))
        notes = build(venv, newest, args.cpu_torch, args.cuda_torch)
    python = str(venv / "bin" / "python")
    have = installed_versions(python)
    if args.junit is None:
        junit = venv / "fast-subset.xml"
        for stale in (junit, junit.with_suffix(".rc")):  # an earlier run's report must not stand in for this one
            stale.unlink(missing_ok=True)
        print(f"running the fast subset in {venv} (about 20 minutes on 2 cores)...", flush=True)
        code = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", FAST, f"--junitxml={junit}", "tests"],
            cwd=ROOT,
        ).returncode
        junit.with_suffix(".rc").write_text(f"{code}\n")
    else:
        junit = args.junit
    code_file = junit.with_suffix(".rc")  # pytest's exit status, written beside the report by the run above
    code = int(code_file.read_text()) if code_file.is_file() else None
    if junit.is_file():
        run = fast_run_from_junit(junit.read_text(), code)
    else:  # pytest wrote no report (killed, or never started): nothing passed
        run = None if code is None else FastRun(0, 0, 0, None, interrupted=True, exit_code=code)
    rows = [
        Row(name, newest[name], bound, have.get(name.lower()), notes.get(name, "")) for name, bound in bounds.items()
    ]
    print(table(rows, run))
    return 0 if run is not None and run.verdict == "passed" and all(row.installs or row.note for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
