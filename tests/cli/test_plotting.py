"""`trl-moe-replay plot`: one PNG per metric family, the latest checkpoint's log, one-line errors; and against hostile
logs (issue 21): every family its own stable file, a run-wide cap on PNGs with a note of
what was left out, and one line for every malformed input."""

import json
import os
import struct
import subprocess
import sys

import pytest

from trl_moe_replay import bounded_json
from trl_moe_replay.cli import main, plotting
from trl_moe_replay.cli.plotting import (
    MAX_FIGURES,
    MAX_FIGURES_PER_FAMILY,
    MAX_PANELS_PER_FIGURE,
    NOT_DRAWN_FILE,
    group_metrics,
    load_log_history,
    metric_series,
    plan_figures,
)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails if the file is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_state(folder, history):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history, "global_step": len(history)}))


def fake_history(steps=5):
    history = []
    for step in range(1, steps + 1):
        history.append(
            {
                "step": step,
                "epoch": step / 10,
                "learning_rate": 1e-3,
                "loss": 0.1 / step,
                "grad_norm": 1.0,
                "reward": 0.2 + 0.1 * step,
                "reward_std": 0.3,
                "rewards/accuracy_reward/mean": 0.2 + 0.1 * step,
                "mismatch/kl_k3": 1e-4 / step,
                "mismatch/kl_k1": 1e-4,
                "sampling/sampling_logp_difference/mean": 1e-3,
                "routing/mismatch_frac": 0.02,
                "routing/topk_agreement": 0.99,
                "clip_ratio/low_mean": 0.0,
                "completions/mean_length": 4.0,
                "rspo/router_shift_mean": 0.9,  # a family added by a later loss
                "kl": float("nan"),  # NaN is skipped, not drawn
            }
        )
    history.append({"step": steps, "eval_reward": 0.55, "eval_mismatch/kl_k3": 1e-5})
    history.append({"step": steps, "train_runtime": 3.2, "train_loss": 0.05})
    return history


def test_the_command_and_the_package_import_without_trl():
    """`trl-moe-replay --help` and `plot` load neither TRL nor torch: the package's top level is lazy (PEP 562).
    (tests/cross_cutting/test_layout.py checks that its public names still import from it.)"""
    code = "import sys, trl_moe_replay.cli; print(sorted({'torch', 'transformers', 'trl'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]


def test_metrics_are_grouped_by_family_with_eval_in_the_training_panel():
    series = metric_series(fake_history())
    assert "kl" not in series and "learning_rate" not in series and "train_runtime" not in series
    groups = group_metrics(series)
    assert list(groups)[:5] == ["reward", "mismatch", "routing", "loss", "completions"]
    assert "rspo" in groups and groups["rspo"] == ["rspo/router_shift_mean"]
    assert "sampling/sampling_logp_difference/mean" in groups["mismatch"]
    assert "eval_reward" not in groups["reward"]  # drawn in the `reward` panel
    assert series["reward"] == ([1, 2, 3, 4, 5], pytest.approx([0.3, 0.4, 0.5, 0.6, 0.7]))


def test_plot_writes_one_png_per_family(tmp_path, capsys):
    run = tmp_path / "run"
    write_state(run, fake_history())
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    names = sorted(p.name for p in (run / "plots").iterdir())
    assert names == sorted(["reward.png", "mismatch.png", "routing.png", "loss.png", "completions.png", "rspo.png"])
    assert len(printed) == len(names)
    for path in (run / "plots").iterdir():
        width, height = png_size(path)
        assert width >= 300 and height >= 200


def test_plot_reads_the_latest_checkpoint_and_custom_out(tmp_path):
    run = tmp_path / "run"
    write_state(run / "checkpoint-2", fake_history(2))
    write_state(run / "checkpoint-10", fake_history(10))
    assert len(load_log_history(run)) == 12  # checkpoint-10, not checkpoint-2 (string order would pick it)
    out = tmp_path / "charts"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert (out / "reward.png").is_file() and not (run / "plots").exists()


def one_line_error(capsys, argv) -> str:
    """Run the CLI; it must fail with exit status 2 and exactly one line on stderr, and no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"trl-moe-replay {argv[0]}: error: ")
    return lines[0]


def test_plot_without_state_explains(tmp_path, capsys):
    assert "save_state" in one_line_error(capsys, ["plot", str(tmp_path)])


def test_plot_without_matplotlib_says_how_to_install_it_in_one_line(tmp_path, capsys, monkeypatch):
    """matplotlib is optional (the `plot` extra): only `plot` needs it."""
    run = tmp_path / "run"
    write_state(run, fake_history())
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert "pip install 'trl-moe-replay[plot]'" in one_line_error(capsys, ["plot", str(run)])


def test_plot_errors_are_one_line_and_say_what_to_do(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert f"{missing} does not exist" in one_line_error(capsys, ["plot", str(missing)])

    not_object = tmp_path / "list"
    not_object.mkdir()
    (not_object / "trainer_state.json").write_text("[1, 2, 3]")
    assert "not a JSON object" in one_line_error(capsys, ["plot", str(not_object)])

    truncated = tmp_path / "truncated"
    write_state(truncated, fake_history())
    text = (truncated / "trainer_state.json").read_text()
    (truncated / "trainer_state.json").write_text(text[: len(text) // 2])
    line = one_line_error(capsys, ["plot", str(truncated)])
    assert "not valid JSON" in line and "truncated" in line

    run, out_file = tmp_path / "run", tmp_path / "charts.png"
    write_state(run, fake_history())
    out_file.write_text("not a folder")
    assert "is a file" in one_line_error(capsys, ["plot", str(run), "--out", str(out_file)])
    assert out_file.read_text() == "not a folder"


@pytest.mark.slow  # the CLI in a subprocess
def test_plot_of_thousands_of_metrics_in_one_family_is_split_and_capped(tmp_path):
    run = tmp_path / "run"
    write_state(
        run,
        [
            {
                "step": step,
                **{f"routing/layer_{i}/expert_frac": i * step / 1e4 for i in range(2000)},
                "reward": 0.1 * step,
            }
            for step in (1, 2, 3)
        ],
    )
    figures = plan_figures(metric_series(load_log_history(run)))
    assert [f.name for f in figures] == ["reward", "routing", "routing-2"]
    routing = [f for f in figures if f.family == "routing"]
    assert [len(f.metrics) for f in routing] == [MAX_PANELS_PER_FIGURE] * MAX_FIGURES_PER_FAMILY
    assert [f.not_drawn for f in routing] == [0, 2000 - MAX_PANELS_PER_FIGURE * MAX_FIGURES_PER_FAMILY]
    assert len({m for f in routing for m in f.metrics}) == MAX_PANELS_PER_FIGURE * MAX_FIGURES_PER_FAMILY
    # the CLI draws them in bounded time (a safety bound for a loaded machine, not a benchmark)
    result = subprocess.run(
        [sys.executable, "-m", "trl_moe_replay.cli", "plot", str(run)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(f"{f.name}.png" for f in figures)
    assert "1952 routing metrics not drawn" in result.stderr


# ----------------------------------------------------------------------------- audit


def test_families_whose_names_sanitise_alike_get_distinct_stable_files(tmp_path):
    families = ["ρ", "🔥", "γ", "a b", "a_b", "Loss", "loss", "x" * 300, "routing-2", "."]
    history = [
        {"step": step, **{f"{family}/m": float(step + i) for i, family in enumerate(families)}, "routing/a": 1.0}
        for step in (1, 2)
    ]
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
    history = [
        {"step": step, "reward": 0.1 * step, **{f"family{i:04d}/m": float(i) for i in range(3000)}} for step in (1, 2)
    ]
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


@pytest.mark.parametrize(
    "history",
    [
        [1, "two", None, [3], {"step": 1, "reward": 0.5}],  # entries that are not objects: skipped
        [{"step": True, "reward": 1.0}, {"step": 1, "reward": 10**400, "loss": 0.5, "a$b/x": 1.0}],
    ],
    ids=["non-dict-entries", "odd-values"],
)
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
    assert f"holds more than {(size - 1) / 2**20:g} MiB: refusing to read it" in one_line_error(
        capsys, ["plot", str(big)]
    )
    monkeypatch.setattr(plotting, "MAX_STATE_BYTES", size)
    assert main(["plot", str(big)]) == 0


def test_extreme_values_and_unencodable_names_are_skipped_or_escaped_with_a_note(tmp_path, caplog):
    history = [
        {
            "step": step,
            "reward": 0.1 * step,
            "loss": 0.5 / step,
            "grad_norm": value,
            "kl": float("nan"),
            "\ud800/x": 1.0,
            "ctl\udcff\n\x00": 2.0,
        }
        for step, value in enumerate(
            [1.0, 1e308, -1e308, float("inf"), float("-inf"), 10**400, 1e300, -1e300, 2.0], start=1
        )
    ]
    history.append({"step": 10**400, "reward": 1.0})  # a step beyond float: the entry is skipped
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


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"log_history": fake_history()}),
        "[]",
        "{}",
        '[[], {}, [{}], ""]',
        '{"a,:[{": [1, 2.5, null]}',
        '  "text"  ',
        "[1,\n 2]",
    ],
)
def test_the_value_count_never_under_counts(text):
    assert bounded_json.count_values(text.encode()) >= all_values(json.loads(text))


def test_under_a_memory_limit_a_state_file_of_empty_objects_is_one_line_not_a_memory_error(tmp_path):
    """60 MiB of ``{}``: json.loads would build about 1.5 GiB of dicts (a MemoryError traceback under this 1 GiB
    limit); the count refuses it before parsing."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_bytes(b'{"log_history": [' + b"{}," * (20 * 2**20) + b"{}]}")
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30)); "
        "from trl_moe_replay.cli import main; sys.exit(main(['plot', sys.argv[1]]))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "JSON values, more than the 8,388,608 read: refusing to parse it" in lines[0]
