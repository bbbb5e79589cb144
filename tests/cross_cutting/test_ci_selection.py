"""Which slow tests CI runs is a mark (`ci`, pyproject's markers; Makefile, test-newest): a misplaced or misspelt
mark must stop the collection, not silently move a test into or out of CI."""

import tomllib
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import misplaced_ci_marks


def item(nodeid, *marks):
    return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: object() if name in marks else None)


def test_only_a_ci_mark_on_a_fast_test_is_misplaced():
    items = [item("slow_in_ci", "slow", "ci"), item("fast_marked_ci", "ci"), item("slow", "slow"), item("fast")]
    assert misplaced_ci_marks(items) == ["fast_marked_ci"]


def test_pytest_refuses_an_unregistered_mark():
    options = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]
    assert "--strict-markers" in options["addopts"]
    assert {line.split(":")[0] for line in options["markers"]} >= {"slow", "serial", "oldest_end", "ci"}
