"""docs/maintaining.md's test map against the package: a new module without a line fails, and so does a stale line."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
MAP_ROW = re.compile(r"^\| `(trl_moe_replay/[\w/]+\.py)` \| (.*) \|$", re.M)


def map_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "maintaining.md").read_text()
    section = text[text.index("## Test map") :]
    rows = MAP_ROW.findall(section)
    modules = [module for module, _ in rows]
    assert len(modules) == len(set(modules)), "a module has two lines in the test map"
    return dict(rows)


def package_modules() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / "trl_moe_replay").rglob("*.py")}


def test_every_module_of_the_package_has_a_line_in_the_test_map():
    mapped, modules = set(map_rows()), package_modules()
    assert len(modules) > 50  # the scan sees the package
    assert sorted(modules - mapped) == [], "modules without a line in docs/maintaining.md's test map"
    assert sorted(mapped - modules) == [], "lines in docs/maintaining.md's test map for modules that are gone"


def test_every_line_names_test_files_that_exist():
    for module, tests in map_rows().items():
        named = re.findall(r"`(tests/[\w/]+\.py)`", tests)
        assert named, f"{module}: no test file named"
        missing = [path for path in named if not (ROOT / path).is_file()]
        assert missing == [], f"{module}: {missing}"


def mirror_of(module: str) -> Path:
    """``trl_moe_replay/<package>/<module>.py`` -> ``tests/<package>/test_<module>.py``."""
    package, name = Path(module).relative_to("trl_moe_replay").parent, Path(module).name
    return Path("tests") / package / f"test_{name}"


def test_a_module_with_a_test_file_of_its_own_names_it_first():
    for module, tests in map_rows().items():
        mirror = mirror_of(module)
        if (ROOT / mirror).is_file():
            assert re.findall(r"`(tests/[\w/]+\.py)`", tests)[0] == mirror.as_posix(), module


def test_the_test_folders_mirror_the_package():
    """A test file under tests/<package>/ is named after a module of trl_moe_replay/<package>/ (test_<module>.py, or
    test_<module>_<aspect>.py); tests of no one module live in tests/cross_cutting/ (docs/maintaining.md)."""
    own_folders = {"cross_cutting", "vllm_plugin", "scripts", "data"}  # not package mirrors
    strays = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        folder = path.parent.relative_to(ROOT / "tests")
        if folder.parts and folder.parts[0] in own_folders:
            continue
        package = ROOT / "trl_moe_replay" / folder
        modules = {p.stem for p in package.glob("*.py")} if package.is_dir() else set()
        stem = path.stem.removeprefix("test_")
        if not any(stem == m or stem.startswith(f"{m}_") for m in modules):
            strays.append(path.relative_to(ROOT).as_posix())
    assert len(list((ROOT / "tests").rglob("test_*.py"))) > 50  # the scan sees the tests
    assert strays == [], "test files named after no module of the package folder they mirror"
