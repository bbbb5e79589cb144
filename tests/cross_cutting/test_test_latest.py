"""tools/test_latest.py (`make test-latest`): its pure parts, reading our bounds, the index's answer and a JUnit
report, and building the table. The environment it builds and the run itself are the maintainer's (docs/maintaining.md).
"""

from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.helpers import load_script


ROOT = Path(__file__).resolve().parents[2]
latest = load_script(ROOT / "tools" / "test_latest.py", "test_latest")

PYPROJECT = """
[project]
name = "x"
dependencies = ["torch>=2.11,<2.16", "transformers>=5.16.1,<5.26", "numpy>=2.0", "peft"]
[project.optional-dependencies]
plot = ["matplotlib>=3.8.4"]
test = ["pytest==9.2.0"]
"""


def test_the_bounds_are_the_runtime_dependencies_and_the_plot_extra_not_the_pinned_test_tools():
    bounds = latest.declared_bounds(PYPROJECT)
    assert list(bounds) == ["torch", "transformers", "numpy", "peft", "matplotlib"]
    assert bounds["transformers"] == SpecifierSet(">=5.16.1,<5.26") and bounds["peft"] == SpecifierSet()


def test_the_real_pyproject_reads_and_caps_transformers_and_trl():
    bounds = latest.declared_bounds((ROOT / "pyproject.toml").read_text())
    assert {"torch", "trl", "transformers", "numpy", "matplotlib"} <= set(bounds)
    assert "pytest" not in bounds
    assert all(any(s.operator == "<" for s in bounds[name]) for name in ("trl", "transformers", "torch"))


def test_the_newest_release_is_the_first_line_of_pip_index_versions():
    answer = (
        "transformers (5.25.0)\nAvailable versions: 5.25.0, 5.24.0, 5.23.0\n  INSTALLED: 5.24.0\n  LATEST:    5.25.0\n"
    )
    assert latest.newest_from_index(answer) == "5.25.0"
    assert latest.newest_from_index("WARNING: something\nmath-verify (0.9.0)\nAvailable versions: 0.9.0") == "0.9.0"
    assert latest.newest_from_index("ERROR: No matching distribution found for nosuchpackage") is None


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="1" tests="5"><testcase classname="tests.routing.test_replay" name="test_a" time="0.1" />
<testcase classname="tests.routing.test_replay" name="test_b[qwen3_moe]" time="0.1"><failure message="boom" /></testcase>
<testcase classname="tests.core.test_x" name="test_c" time="0.1"><skipped message="no" /></testcase>
<testcase classname="tests.core.test_x" name="test_d" time="0.1"><error message="fixture" /></testcase>
<testcase classname="tests.core.test_x" name="test_e" time="0.1" /></testsuite></testsuites>"""


def test_the_junit_report_gives_counts_and_the_first_failing_test():
    run = latest.fast_run_from_junit(JUNIT)
    assert (run.passed, run.failed, run.skipped) == (2, 2, 1)
    assert run.first_failure == "tests/routing/test_replay.py::test_b[qwen3_moe]"


def test_the_table_marks_a_newest_release_above_our_cap_and_one_that_did_not_install():
    rows = [
        latest.Row("transformers", "5.26.0", SpecifierSet(">=5.16.1,<5.26"), "5.26.0"),
        latest.Row("torch", "2.15.0", SpecifierSet(">=2.11,<2.16"), "2.13.0+cpu", "the CPU build 2.13.0 instead"),
        latest.Row("peft", "0.22.0", SpecifierSet(), "0.21.2"),
        latest.Row("datasets", None, SpecifierSet(">=4.7.0"), None),
    ]
    text = latest.table(rows, latest.fast_run_from_junit(JUNIT)).splitlines()
    assert text[0].startswith("| dependency | newest | our bound | newest inside it | installs | fast subset |")
    assert text[2] == "| transformers | 5.26.0 | `<5.26,>=5.16.1` | no | yes | | |"
    assert text[3] == "| torch | 2.15.0 | `<2.16,>=2.11` | yes | no (2.13.0+cpu); the CPU build 2.13.0 instead | | |"
    assert text[4] == "| peft | 0.22.0 | `any` | yes | no (0.21.2) | | |"
    assert text[5] == "| datasets | ? | `>=4.7.0` | ? | no | | |"
    assert text[6] == (
        "| (all of the above) | | | | | failed: 2 passed, 2 failed, 1 skipped | "
        "tests/routing/test_replay.py::test_b[qwen3_moe] |"
    )


def test_a_local_version_label_still_counts_as_the_newest_installed_and_a_run_without_failures_passes():
    row = latest.Row("torch", "2.13.0", SpecifierSet("<2.16"), "2.13.0+cpu")
    assert row.installs and row.inside
    clean = latest.FastRun(passed=1000, failed=0, skipped=4, first_failure=None, exit_code=0)
    assert latest.table([row], clean).splitlines()[-1] == (
        "| (all of the above) | | | | | passed: 1000 passed, 0 failed, 4 skipped | none |"
    )
    assert latest.table([row], None).splitlines()[-1] == "| (all of the above) | | | | | not run |  |"


# What pytest 9 writes when a session stops midway (here a test raising KeyboardInterrupt, exit status 2): the tests
# that ran, then one <testcase> without a name or class in place of the one it stopped in.
INTERRUPTED = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="0" failures="0" skipped="0" tests="1"><testcase classname="tests.core.test_x" name="test_a" time="0.001" />
<testcase time="0.000" /></testsuite></testsuites>"""


def test_an_interrupted_session_is_not_passed_and_its_placeholder_is_not_counted():
    run = latest.fast_run_from_junit(INTERRUPTED, exit_code=2)
    assert (run.passed, run.failed, run.skipped, run.interrupted) == (1, 0, 0, True)
    assert run.verdict == "not finished: interrupted (pytest exit 2)"
    # the placeholder alone says so, where pytest's exit status is unknown (a reused report without its .rc)
    assert latest.fast_run_from_junit(INTERRUPTED).verdict == "not finished: interrupted"
    row = latest.Row("torch", "2.15.0", SpecifierSet("<2.16"), "2.15.0")
    assert latest.table([row], run).splitlines()[-1] == (
        "| (all of the above) | | | | | not finished: interrupted (pytest exit 2): 1 passed, 0 failed | none |"
    )


CLEAN = """<testsuites><testsuite><testcase classname="tests.a" name="test_a" /></testsuite></testsuites>"""


def test_only_a_session_pytest_says_finished_clean_is_passed():
    assert latest.fast_run_from_junit(CLEAN, exit_code=0).verdict == "passed"
    assert latest.fast_run_from_junit(CLEAN, exit_code=1).verdict == "failed"  # pytest saw a failure the report lacks
    assert (
        latest.fast_run_from_junit(CLEAN, exit_code=3).verdict
        == "not finished: pytest's internal error (pytest exit 3)"
    )
    assert latest.fast_run_from_junit(CLEAN, exit_code=-9).verdict == "killed (signal 9)"
    assert latest.fast_run_from_junit(CLEAN).verdict == "no failure reported, pytest's exit status unknown"
    assert latest.fast_run_from_junit(JUNIT, exit_code=1).verdict == "failed"


@pytest.mark.parametrize(
    ("report", "exit_code", "status"),
    [
        (CLEAN, "0", 0),
        (CLEAN, "2", 1),  # pytest stopped between two tests: the report alone looks clean
        (INTERRUPTED, "2", 1),
        (CLEAN, None, 1),  # no status beside the report: not known to have passed
    ],
    ids=["clean-exit-0", "clean-exit-2", "interrupted-exit-2", "clean-no-status"],
)
def test_main_takes_pytests_exit_status_from_beside_a_reused_report(
    tmp_path, monkeypatch, capsys, report, exit_code, status
):
    (tmp_path / "fast-subset.xml").write_text(report)
    if exit_code is not None:
        (tmp_path / "fast-subset.rc").write_text(f"{exit_code}\n")
    names = latest.declared_bounds((ROOT / "pyproject.toml").read_text())
    monkeypatch.setattr(latest, "newest_release", lambda python, name: "1.0")  # every newest release installed
    monkeypatch.setattr(latest, "installed_versions", lambda python: dict.fromkeys(names, "1.0"))
    assert latest.main(["--venv", str(tmp_path), "--junit", str(tmp_path / "fast-subset.xml")]) == status
    assert capsys.readouterr().out.splitlines()[-1].startswith("| (all of the above) | | | | | passed:") == (
        status == 0
    )
