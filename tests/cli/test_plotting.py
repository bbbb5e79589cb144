"""`plot` against hostile logs (issue 21): every family its own stable file, a run-wide cap on PNGs with a note of
what was left out, and one line for every malformed input."""

import json
import os
import subprocess
import sys

import pytest

from trl_moe_replay import bounded_json
from trl_moe_replay.cli import main, plotting
from trl_moe_replay.cli.plotting import MAX_FIGURES, NOT_DRAWN_FILE, load_log_history, metric_series, plan_figures

from tests.cli.test_audit import fake_history, one_line_error, png_size, write_state


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

    long_int = tmp_path / "long-int"
    long_int.mkdir()
    (long_int / "trainer_state.json").write_text('{"log_history": [{"step": 1, "reward": ' + "1" * 5000 + "}]}")
    message = one_line_error(capsys, ["plot", str(long_int)])  # was json's bare ValueError (4,300-digit limit)
    assert f"{long_int / 'trainer_state.json'} holds a number Python refuses to convert" in message


# ----------------------------------------------------------------------------- hostile run folders (issue 33)
def test_plot_replaces_planted_links_and_never_writes_through_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plotting, "MAX_FIGURES", 1)  # one PNG and a not_drawn.txt note
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    write_state(run, fake_history())
    victims = {name: outside / f"victim-{name}" for name in ("reward.png", NOT_DRAWN_FILE)}
    (run / "plots").mkdir()
    for name, victim in victims.items():
        victim.write_text("precious")
        (run / "plots" / name).symlink_to(victim)
    assert main(["plot", str(run)]) == 0
    assert all(victim.read_text() == "precious" for victim in victims.values())  # nothing written through a link
    png_size(run / "plots" / "reward.png")
    assert not any(p.is_symlink() for p in (run / "plots").iterdir())  # the links were replaced by new files
    assert "mismatch" in (run / "plots" / NOT_DRAWN_FILE).read_text(encoding="utf-8")
    assert not list((run / "plots").glob(".*"))  # no temporary file left behind


@pytest.mark.parametrize("plant", ["symlink", "file"])
def test_a_plots_path_that_is_not_a_folder_of_the_run_is_refused_in_one_line(tmp_path, capsys, plant):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_state(run, fake_history())
    if plant == "symlink":
        (run / "plots").symlink_to(elsewhere, target_is_directory=True)
    else:
        (run / "plots").write_text("a file")
    line = one_line_error(capsys, ["plot", str(run)])
    assert "refusing to write the PNGs through it" in line and "--out" in line
    assert ("is a symlink" if plant == "symlink" else "is not a folder") in line
    assert not list(elsewhere.iterdir())
    assert main(["plot", str(run), "--out", str(elsewhere)]) == 0 and (elsewhere / "reward.png").is_file()


def test_special_and_oversized_state_files_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    device = tmp_path / "device"
    (device / "checkpoint-1").mkdir(parents=True)
    (device / "checkpoint-1" / "trainer_state.json").symlink_to("/dev/zero")  # was a MemoryError after minutes
    line = one_line_error(capsys, ["plot", str(device)])
    assert "is a device, not a regular file: refusing to read it" in line

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "trainer_state.json")  # opening it for reading would wait for a writer forever
    assert "is a FIFO, not a regular file" in one_line_error(capsys, ["plot", str(fifo)])

    folder = tmp_path / "folder"
    (folder / "trainer_state.json").mkdir(parents=True)
    assert "is a folder, not a regular file" in one_line_error(capsys, ["plot", str(folder)])

    big = tmp_path / "big"
    write_state(big, fake_history())
    size = (big / "trainer_state.json").stat().st_size
    monkeypatch.setattr(plotting, "MAX_STATE_BYTES", size - 1)
    assert f"holds more than {(size - 1) / 2**20:g} MiB: refusing to read it" in one_line_error(capsys,
                                                                                                 ["plot", str(big)])
    monkeypatch.setattr(plotting, "MAX_STATE_BYTES", size)
    assert main(["plot", str(big)]) == 0


def test_extreme_values_and_unencodable_names_are_skipped_or_escaped_with_a_note(tmp_path, caplog):
    history = [{"step": step, "reward": 0.1 * step, "loss": 0.5 / step, "grad_norm": value, "kl": float("nan"),
                "\ud800/x": 1.0, "ctl\udcff\n\x00": 2.0} for step, value in
               enumerate([1.0, 1e308, -1e308, float("inf"), float("-inf"), 10 ** 400, 1e300, -1e300, 2.0], start=1)]
    history.append({"step": 10 ** 400, "reward": 1.0})  # a step beyond float: the entry is skipped
    run = tmp_path / "run"
    run.mkdir()
    # json.dumps writes NaN/Infinity (as Python does) and escapes the lone surrogates ("\ud800"), as a JSON
    # file from another writer may hold them
    (run / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert main(["plot", str(run)]) == 0
    series = metric_series(load_log_history(run))
    assert series["grad_norm"] == ([1, 7, 8, 9], [1.0, 1e300, -1e300, 2.0])  # what could be drawn, was
    assert "kl" not in series and max(series["reward"][0]) == 9
    assert "14 values of 2 metrics are NaN, ±inf or beyond ±1e+300: not drawn (kl: 9, grad_norm: 5)" in caplog.text
    for path in (run / "plots").iterdir():
        png_size(path)
    assert {f.family for f in plan_figures(series)} == {"reward", "loss", "other", "\ud800"}
    assert plotting.printable("ctl\udcff\n\x00") == "ctl\\udcff\\n\\x00"


# ----------------------------------------------------------------------------- bounded parsing (issue 38, item 5)
def test_a_state_file_that_would_parse_into_too_many_objects_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bounded_json, "MAX_JSON_VALUES", 1_000)
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_text('{"log_history": [' + ",".join(["{}"] * 1_000) + "]}")
    line = one_line_error(capsys, ["plot", str(run)])
    assert "holds up to 2,003 JSON values, more than the 1,000 read: refusing to parse it" in line
    assert "plot one of the run's checkpoint-N folders" in line
    (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "reward": 0.5}] * 100}))
    assert main(["plot", str(run)]) == 0


def all_values(value) -> int:
    """The values and keys ``json.loads`` built for ``value``."""
    if isinstance(value, dict):
        return 1 + sum(1 + all_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(all_values(v) for v in value)
    return 1


@pytest.mark.parametrize("text", [
    json.dumps({"log_history": fake_history()}), "[]", "{}", '[[], {}, [{}], ""]', '{"a,:[{": [1, 2.5, null]}',
    '  "text"  ', "[1,\n 2]",
])
def test_the_value_count_never_under_counts(text):
    assert bounded_json.count_values(text.encode()) >= all_values(json.loads(text))


def test_under_a_memory_limit_a_state_file_of_empty_objects_is_one_line_not_a_memory_error(tmp_path):
    """60 MiB of ``{}``: json.loads would build about 1.5 GiB of dicts (a MemoryError traceback under this 1 GiB
    limit); the count refuses it before parsing."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_bytes(b'{"log_history": [' + b"{}," * (20 * 2**20) + b"{}]}")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30)); "
            "from trl_moe_replay.cli import main; sys.exit(main(['plot', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "JSON values, more than the 8,388,608 read: refusing to parse it" in lines[0]
