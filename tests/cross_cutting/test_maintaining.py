"""docs/maintaining.md's test map against the package: a new module without a line fails, and so does a stale line."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
MAP_ROW = re.compile(r"^\| `(trl_moe_replay/[\w/]+\.py)` \| (.*) \|$", re.M)


def map_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "maintaining.md").read_text()
    section = text[text.index("## Test map"):]
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
