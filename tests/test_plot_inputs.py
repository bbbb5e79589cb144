"""`plot` against hostile logs (issue 21): every family its own stable file, a run-wide cap on PNGs with a note of
what was left out, and one line for every malformed input."""

import json

import pytest

from trl_moe_replay.cli import main, plotting
from trl_moe_replay.cli.plotting import MAX_FIGURES, NOT_DRAWN_FILE, metric_series, plan_figures

from .test_cli import fake_history, one_line_error, png_size, write_state


def test_families_whose_names_sanitise_alike_get_distinct_stable_files(tmp_path):
    families = ["ρ", "🔥", "γ", "a b", "a_b", "Loss", "loss", "x" * 300, "routing-2", "."]
    history = [{"step": step, **{f"{family}/m": float(step + i) for i, family in enumerate(families)},
                "routing/a": 1.0} for step in (1, 2)]
    run = tmp_path / "run"
    write_state(run, history)
    assert main(["plot", str(run)]) == 0
    figures = plan_figures(metric_series(history))
    names = [f.name for f in figures]
    assert len({n.lower() for n in names}) == len(names) == len(families) + 1  # no two files alike, in any case
    written = sorted(p.name for p in (run / "plots").iterdir())
    assert written == sorted(f"{n}.png" for n in names)  # nothing overwritten
    assert {"a_b", "routing", "routing-2", "loss"} <= set(names)  # plain names stay plain (no second routing PNG)
    assert all(len(n) <= 100 for n in names)
    for path in (run / "plots").iterdir():
        png_size(path)
    # stable: the same names in another plot, whatever else the run logged
    other = [{**entry, "zzz/extra": 1.0} for entry in history]
    again = {f.family: f.name for f in plan_figures(metric_series(other))}
    assert all(again[f.family] == f.name for f in figures)


def test_thousands_of_families_are_capped_with_a_note_of_what_was_left_out(tmp_path, caplog, monkeypatch):
    assert MAX_FIGURES <= 50  # about a minute of drawing on a small machine; this test draws fewer
    monkeypatch.setattr(plotting, "MAX_FIGURES", 6)
    history = [{"step": step, "reward": 0.1 * step, **{f"family{i:04d}/m": float(i) for i in range(3000)}}
               for step in (1, 2)]
    run = tmp_path / "run"
    write_state(run, history)
    assert main(["plot", str(run)]) == 0
    pngs = list((run / "plots").glob("*.png"))
    assert len(pngs) == plotting.MAX_FIGURES and (run / "plots" / "reward.png").is_file()  # FAMILY_ORDER first
    note = (run / "plots" / NOT_DRAWN_FILE).read_text(encoding="utf-8").splitlines()
    left = 3001 - plotting.MAX_FIGURES
    assert f"these {left} metric families were not drawn" in note[0] and len(note) == 1 + left
    assert note[-1] == "family2999: family2999/m"
    assert f"{left} metric families ({left} metrics) not drawn" in caplog.text
    # a later plot with nothing left out removes the stale note
    write_state(run, fake_history())
    assert main(["plot", str(run)]) == 0
    assert not (run / "plots" / NOT_DRAWN_FILE).exists()


@pytest.mark.parametrize("history", [
    [1, "two", None, [3], {"step": 1, "reward": 0.5}],  # entries that are not objects: skipped
    [{"step": True, "reward": 1.0}, {"step": 1, "reward": 10 ** 400, "loss": 0.5, "a$b/x": 1.0}],
], ids=["non-dict-entries", "odd-values"])
def test_malformed_entries_are_skipped_and_the_rest_drawn(tmp_path, capsys, history):
    run = tmp_path / "run"
    write_state(run, history)
    assert main(["plot", str(run)]) == 0
    assert list((run / "plots").glob("*.png"))


def test_malformed_files_are_one_line(tmp_path, capsys):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "trainer_state.json").write_text('{"log_history": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nests JSON arrays or objects too deeply" in one_line_error(capsys, ["plot", str(deep)])

    no_metrics = tmp_path / "nothing"
    write_state(no_metrics, [1, 2, {"step": "one", "reward": 1.0}, {"step": 1, "reward": "high"}])
    assert "logged no metric with a step" in one_line_error(capsys, ["plot", str(no_metrics)])

    not_list = tmp_path / "not-list"
    not_list.mkdir()
    (not_list / "trainer_state.json").write_text(json.dumps({"log_history": {"step": 1}}))
    assert "no 'log_history' list" in one_line_error(capsys, ["plot", str(not_list)])
