"""bench/demo_robustness.py: the demo's promise (`judge`) on made-up log histories, and the table's counts. The demo
test (tests/cross_cutting/test_docs.py) applies the same `judge` to the CI machine's own run."""

from pathlib import Path

import pytest

from tests.helpers import load_script


ROOT = Path(__file__).resolve().parents[2]
robustness = load_script(ROOT / "bench" / "demo_robustness.py", "demo_robustness_under_test")


def history(
    rewards: list[float], clipped: list[float] | None = None, terminated: float = 4.0, calls: list[float] | None = None
) -> list[dict]:
    clipped = clipped or [0.0] * len(rewards)
    calls = calls or [0.5] * len(rewards)
    return [
        {
            "step": i + 1,
            "reward": r,
            "completions/clipped_ratio": c,
            "completions/mean_terminated_length": terminated,
            "tools/call_frequency": f,
        }
        for i, (r, c, f) in enumerate(zip(rewards, clipped, calls, strict=True))
    ]


def test_a_run_that_rises_and_stops_keeps_the_promise_and_says_when_it_rose():
    rewards = [0.4] * 20 + [0.7] * 20
    verdict = robustness.judge(history(rewards), cold_start_accuracy=0.3)
    assert verdict["held"] and verdict["first"] == pytest.approx(0.4) and verdict["last"] == pytest.approx(0.7)
    # the 10-step mean first clears 0.4 + 0.2 at the window ending on step 27 (3 x 0.4 + 7 x 0.7 = 6.1 >= 6.0)
    assert verdict["rose_at"] == 27


def test_each_part_of_the_promise_can_fail_alone():
    rising = [0.4] * 20 + [0.7] * 20
    collapsed = robustness.judge(history([0.4] * 20 + [0.7] * 10 + [0.2] * 10), 0.3)  # rose, then fell back
    assert not collapsed["held"] and collapsed["checks"] == {"cold_start": True, "rise": False, "stop": True}
    assert collapsed["rose_at"] is not None  # it did rise on the way: the row shows both
    # the policy it leaves does not stop: 2 of 100 cut over the last 10 steps
    cut = robustness.judge(history(rising, clipped=[0.0] * 30 + [0.02] * 10), 0.3)
    assert cut["checks"] == {"cold_start": True, "rise": True, "stop": False} and cut["max_clipped"] == 0.02
    # an episode it came back from is not a failure to stop, but the row shows it
    episode = robustness.judge(history(rising, clipped=[0.0] * 10 + [0.7] * 10 + [0.0] * 20), 0.3)
    assert episode["held"] and episode["max_clipped"] == 0.7
    never_ends = robustness.judge(history(rising, terminated=0.0), 0.3)
    assert not never_ends["checks"]["stop"]
    for accuracy in (0.0, 0.9, None):  # untrained, no room for the rise, no cold-start line printed
        assert robustness.judge(history(rising), accuracy)["checks"]["cold_start"] is False
    assert not robustness.judge(history([0.4] * 15), 0.3)["checks"]["rise"]  # too short to compare two windows


def test_the_tool_demo_promises_more_tool_calls_instead_of_the_stop():
    rising, cut = [0.4] * 20 + [0.7] * 20, [0.05] * 40  # 5 in 100 multi-turn completions cut at 96 tokens
    calling = robustness.judge(history(rising, clipped=cut, calls=[0.5] * 20 + [0.9] * 20), 0.4, demo="tools")
    assert calling["held"] and set(calling["checks"]) == {"cold_start", "rise", "tool_calls"}
    assert calling["max_clipped"] == 0.05  # shown in its row, not promised
    not_calling = robustness.judge(history(rising, calls=[0.5] * 20 + [0.6] * 20), 0.4, demo="tools")
    assert not not_calling["held"] and not not_calling["checks"]["tool_calls"]
    assert not robustness.judge(history(rising, clipped=cut), 0.4, demo="math")["held"]  # the math demo must stop


def test_the_report_counts_per_configuration_and_thread_count():
    held = robustness.judge(history([0.4] * 20 + [0.7] * 20), 0.3) | {"seconds": 1.0}
    failed = robustness.judge(history([0.4] * 40), 0.3) | {"seconds": 1.0}
    results = {
        "runs": {
            "a/math/threads1/seed0": held,
            "a/math/threads1/seed1": failed,
            "a/math/threads1/seed10": held,
            "a/math/threads2/seed0": failed,
            "b/math/threads1/seed0": {"error": "rc 1: boom", "held": False, "seconds": 2.0},
        }
    }
    text = robustness.report(results)
    assert "a/math/threads1: promise held on 2 of 3 seeds" in text
    assert "a/math/threads2: promise held on 0 of 1 seeds" in text
    assert "b/math/threads1: promise held on 0 of 1 seeds" in text and "ERROR" in text
    rows = [line.split()[0] for line in text.splitlines()[1:6]]
    assert rows[:3] == ["a/math/threads1/seed0", "a/math/threads1/seed1", "a/math/threads1/seed10"]  # natural order


def test_rejudge_reads_the_saved_runs_again(tmp_path, capsys):
    """--rejudge: a change of the promise is applied to saved runs without running them again."""
    import json

    name = "shipped/tools/threads1/seed0"
    folder = tmp_path / name
    (folder / "run").mkdir(parents=True)
    (folder / "output.log").write_text("cold start: 400 SFT steps, sampled accuracy 0.45 before GRPO, tool calls...\n")
    log = history([0.4] * 20 + [0.7] * 20, clipped=[0.05] * 40, calls=[0.5] * 20 + [0.9] * 20)
    (folder / "run" / "trainer_state.json").write_text(json.dumps({"log_history": log}))
    out = tmp_path / "results.json"
    stale = {"held": False, "checks": {"stop": False}, "seconds": 3.0}  # judged by an older promise
    out.write_text(json.dumps({"runs": {name: stale}, "settings": {}}))
    assert robustness.main(["--rejudge", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["runs"][name]
    assert row["held"] and row["cold_start_accuracy"] == 0.45 and row["seconds"] == 3.0
    assert "shipped/tools/threads1: promise held on 1 of 1 seeds" in capsys.readouterr().out
