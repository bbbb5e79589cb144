"""PNG charts of a training run's logged metrics (``trainer_state.json``), and side-by-side comparisons of runs.

A run's metrics are grouped by family, one PNG each, one panel per metric against the optimizer step:
``reward.png`` (``reward``, ``reward_std``, ``rewards/<function>/mean``), ``mismatch.png`` (``mismatch/*`` and
TRL's ``sampling/*`` engine-vs-trainer numbers), ``routing.png`` (``routing/*``), ``loss.png`` (``loss``,
``grad_norm``, ``kl``, ``entropy``, ``clip_ratio/*``), ``completions.png`` and one more PNG per remaining metric
prefix (``<prefix>/...``), so the metrics of a loss or a replay mode added later are drawn without code changes.
Evaluation metrics (``eval_<name>``) share their training metric's panel. A PNG holds at most
:data:`MAX_PANELS_PER_FIGURE` panels: a larger family is split over ``<family>-2.png``, ``<family>-3.png``, ... up to
:data:`MAX_FIGURES_PER_FAMILY` PNGs; the family's remaining metrics are not drawn (a warning and the last PNG's title
say how many), so a run that logs thousands of metrics in one family still plots in seconds. A run draws at most
:data:`MAX_FIGURES` PNGs in all (the families of :data:`FAMILY_ORDER` first); the families left out are listed in
``not_drawn.txt`` next to the PNGs and in a warning.

File names are the family's name where it is a plain file name (``routing.png``); any other name (``ρ/...``,
``a b/...``, a very long one, one that differs from another only in case) gets a short hash of the exact name, so
every family has its own file, the same in every plot of the run, and none overwrites another.

A run folder may hold things it should not: files we write never follow a link out of it (each PNG is written as a
new file and renamed into place, so a planted symlink is replaced, not written through; a symlinked ``plots/`` is
refused), a ``trainer_state.json`` is read only if it is a regular file of at most :data:`MAX_STATE_BYTES` and of at
most :data:`~trl_moe_replay.bounded_json.MAX_JSON_VALUES` JSON values (the bounded reader,
bounded_json.py: parsing cannot build many times the file's size in objects), values
that matplotlib cannot draw (NaN, ±inf, beyond ±:data:`MAX_DRAWN_MAGNITUDE`) are left out with a warning, and names
that cannot be printed (lone surrogates, control characters) are shown escaped.

matplotlib is imported lazily with its non-interactive ``Agg`` backend: nothing here needs a display.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import IO, NamedTuple

from ..bounded_json import MAX_JSON_BYTES, JSONFileError, read_json_file
from ..errors import TrlMoeReplayError


#: Log-history keys that are bookkeeping, not metrics.
_NOT_METRICS = frozenset(
    {
        "step",
        "epoch",
        "learning_rate",
        "num_tokens",
        "step_time",
        "total_flos",
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_loss",
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
    }
)
# Family of the metrics without a "prefix/" or whose prefix belongs to another family: name -> family.
_FAMILY_OF_NAME = {
    "reward": "reward",
    "reward_std": "reward",
    "frac_reward_zero_std": "reward",
    "loss": "loss",
    "grad_norm": "loss",
    "kl": "loss",
    "entropy": "loss",
    "aux_loss": "loss",
    "policy_loss": "loss",
    "entropy_coef": "loss",
    "cispo_clip_ratio": "loss",
}
_FAMILY_OF_PREFIX = {
    "rewards": "reward",
    "sampling": "mismatch",
    "mismatch": "mismatch",
    "routing": "routing",
    "clip_ratio": "loss",
    "completions": "completions",
}
_LEAD_METRIC = {"reward": "reward", "mismatch": "mismatch/kl_k3", "routing": "routing/mismatch_frac", "loss": "loss"}
#: Families written first, in this order; the others follow alphabetically.
FAMILY_ORDER = ("reward", "mismatch", "routing", "loss", "completions")
#: Panels per PNG, and PNGs per family: at most 48 metrics of one family are drawn (a PNG of 24 panels takes seconds).
MAX_PANELS_PER_FIGURE = 24
MAX_FIGURES_PER_FAMILY = 2
#: PNGs per run: a run logging thousands of metric families still plots in about a minute.
MAX_FIGURES = 40
#: where plot_run lists the families and metrics it left out (in the output folder)
NOT_DRAWN_FILE = "not_drawn.txt"
_MAX_STEM = 80  # characters of a family's name kept in its file name
_MAX_TITLE = 120  # characters of a metric's name shown above its panel
#: Largest trainer_state.json read (bytes): a long run logging every step stays far below it; /dev/zero does not.
MAX_STATE_BYTES = MAX_JSON_BYTES
#: Values beyond ± this are not drawn: matplotlib's axis arithmetic overflows near float's limit (1e308).
MAX_DRAWN_MAGNITUDE = 1e300

logger = logging.getLogger(__name__)


class RunFileRefusedError(TrlMoeReplayError, OSError):
    """A run folder's folder that ``plot`` will not write through: a symlinked ``plots/``, one that is not a folder."""


def find_trainer_state(run_dir: str | Path) -> Path:
    """``RUN_DIR/trainer_state.json``, else the one of the latest ``checkpoint-N`` inside ``RUN_DIR``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        problem = "is not a folder" if run_dir.exists() else "does not exist"
        raise FileNotFoundError(
            f"{run_dir} {problem}: pass a training output_dir (the folder with trainer_state.json or checkpoint-N "
            "folders)"
        )
    direct = run_dir / "trainer_state.json"
    if direct.exists():  # a FIFO or a link to a device too: read_json_file refuses them in one line
        return direct
    checkpoints = sorted(
        (p for p in run_dir.glob("checkpoint-*/trainer_state.json") if p.parent.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.parent.name.split("-")[-1]),
    )
    if checkpoints:
        return checkpoints[-1]
    raise FileNotFoundError(
        f"no trainer_state.json in {run_dir} nor in a checkpoint-N folder inside it. The Trainer writes it with "
        "each checkpoint and with `trainer.save_state()` (the recipe calls it at the end of training)."
    )


def load_log_history(run_dir_or_file: str | Path) -> list[dict]:
    """The ``log_history`` list of a run folder (see :func:`find_trainer_state`) or of a trainer_state.json."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = find_trainer_state(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass a training output_dir or its trainer_state.json")
    try:
        state = read_json_file(path, max_bytes=MAX_STATE_BYTES)
    except JSONFileError as exc:
        raise JSONFileError(f"{exc}; plot one of the run's checkpoint-N folders instead") from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} holds a JSON {type(state).__name__}, not a JSON object with a 'log_history' list: is it a "
            "Trainer's trainer_state.json?"
        )
    history = state.get("log_history")
    if not isinstance(history, list):
        raise ValueError(f"{path} has no 'log_history' list")
    return history


def metric_series(
    log_history: Iterable[Mapping],
    skipped: dict[str, int] | None = None,
) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (steps, values)}`` for every numeric metric logged with an integer step. Entries that are not JSON
    objects, steps beyond ±2**53, and values that are not numbers (text, nested objects, ``true``) are skipped, and
    so are numbers matplotlib cannot draw (NaN, ±inf, ints beyond float, beyond ±:data:`MAX_DRAWN_MAGNITUDE`):
    those are counted per metric in ``skipped`` when given."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        if not isinstance(entry, Mapping):
            continue
        step = entry.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or abs(step) > 2**53:
            continue
        for name, value in entry.items():
            if name in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            try:
                value = float(value)
            except OverflowError:  # an int beyond float's range
                value = math.inf
            if not abs(value) <= MAX_DRAWN_MAGNITUDE:  # NaN too
                if skipped is not None:
                    skipped[str(name)] = skipped.get(str(name), 0) + 1
                continue
            steps, values = series.setdefault(str(name), ([], []))
            steps.append(step)
            values.append(value)
    return series


def metric_family(name: str) -> str:
    """The PNG a metric is drawn in (without ``.png``): see the module docstring."""
    base = name.removeprefix("eval_")
    if base in _FAMILY_OF_NAME:
        return _FAMILY_OF_NAME[base]
    if "/" in base:
        prefix = base.split("/", 1)[0]
        return _FAMILY_OF_PREFIX.get(prefix, prefix)
    return "other"


def group_metrics(names: Iterable[str]) -> dict[str, list[str]]:
    """``{family: [training metric names]}``; an ``eval_`` metric is listed under its training name's panel (or
    alone when there is no training metric of that name). Families in :data:`FAMILY_ORDER` first."""
    names = set(names)
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        panel = name.removeprefix("eval_")
        if name.startswith("eval_") and panel in names:
            continue  # drawn in the training metric's panel
        groups.setdefault(metric_family(name), []).append(name)
    for family, members in groups.items():  # the family's headline metric first
        lead = _LEAD_METRIC.get(family)
        members.sort(key=lambda n: (n.removeprefix("eval_") != lead, n))
    ordered = [f for f in FAMILY_ORDER if f in groups] + sorted(f for f in groups if f not in FAMILY_ORDER)
    return {family: groups[family] for family in ordered}


def _window(count: int) -> int:
    return max(2, count // 10)


def moving_average(values: Sequence[float], min_points: int = 20) -> list[float] | None:
    """Trailing running mean over ``max(2, n // 10)`` points; None for short series (drawn as they are)."""
    if len(values) < min_points:
        return None
    window, out, total = _window(len(values)), [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class MatplotlibMissingError(TrlMoeReplayError, ImportError):
    """``plot`` needs matplotlib, an optional dependency (the ``plot`` extra)."""


def check_matplotlib():
    """matplotlib, or :class:`MatplotlibMissingError` (one line): every path that draws checks here first."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MatplotlibMissingError(
            "plotting needs matplotlib, which is not installed: pip install 'trl-moe-replay[plot]'"
        ) from exc
    return matplotlib


def _pyplot():
    matplotlib = check_matplotlib()
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _grid(count: int, max_columns: int = 3) -> tuple[int, int]:
    columns = min(max_columns, count)
    return -(-count // columns), columns


def _file_stem(label: str, taken: set[str]) -> str:
    """A file name (without ``.png``) for ``label``, distinct from those in ``taken`` (compared case-insensitively,
    as macOS and Windows do), which it joins. ``label`` itself where it is a plain name, else with a hash of it."""
    plain = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip(".")[:_MAX_STEM] or "metrics"
    stem, salt = plain, 0
    while stem != label or stem.lower() in taken:
        digest = hashlib.sha1(f"{label}#{salt}".encode("utf-8", "surrogatepass")).hexdigest()[:8]
        stem, salt = f"{plain}-{digest}", salt + 1
        if stem.lower() not in taken:
            break
    taken.add(stem.lower())
    return stem


def printable(text: str) -> str:
    """``text`` with what cannot be drawn or encoded escaped: lone surrogates (JSON's ``"\\ud800"``, a non-UTF-8
    folder name) and control characters become ``\\ud800``, ``\\n``."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _title(name: str) -> str:
    """A metric's name as a panel title: printable, shortened, and ``$`` kept literal (matplotlib reads it as
    math)."""
    name = printable(name)
    short = name if len(name) <= _MAX_TITLE else name[: _MAX_TITLE - 1] + "…"
    return short.replace("$", r"\$")


def write_new_file(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``path`` as a new file: ``write(f)`` fills a temporary file created in the same folder (``O_EXCL``,
    ``O_NOFOLLOW``), which then replaces ``path``. A symlink (or hard link) at ``path`` is replaced, never written
    through, and a reader never sees half a file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, 0o666)  # less the umask, as open() creates files
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def _safe_out_dir(run_dir: Path, out_dir: Path | None) -> Path:
    """The folder for the PNGs, created: ``out_dir`` as given, or ``RUN_DIR/plots``, which must be a real folder
    inside the run folder (a symlink planted there would send the PNGs elsewhere)."""
    if out_dir is not None:  # the user's choice, links and all (each file is still written new)
        out_dir.mkdir(parents=True, exist_ok=True)
        return out_dir
    out_dir = run_dir / "plots"
    refusal = (
        f"{out_dir} is a symlink"
        if out_dir.is_symlink()
        else f"{out_dir} is not a folder"
        if out_dir.exists() and not out_dir.is_dir()
        else None
    )
    if refusal is None:
        out_dir.mkdir(exist_ok=True)
        if not out_dir.resolve().is_relative_to(run_dir.resolve()):
            refusal = f"{out_dir} resolves to {out_dir.resolve()}, outside the run folder"
    if refusal:
        raise RunFileRefusedError(f"{refusal}: refusing to write the PNGs through it; remove it, or pass --out DIR")
    return out_dir


class Figure(NamedTuple):
    """One PNG of :func:`plot_run`: its file name (without ``.png``), its family, and its metrics (one panel each)."""

    name: str
    family: str
    metrics: list[str]
    not_drawn: int = 0  # the family's metrics left out (set on the family's last PNG only)


def plan_figures(
    series: Mapping[str, object],
    max_panels: int = MAX_PANELS_PER_FIGURE,
    max_figures: int = MAX_FIGURES_PER_FAMILY,
    max_total: int | None = None,
) -> list[Figure]:
    """The PNGs for ``series``: each family of :func:`group_metrics` split into PNGs of at most ``max_panels``
    panels (``<family>``, ``<family>-2``, ...), at most ``max_figures`` per family (its other metrics are left out),
    and at most ``max_total`` in all (default :data:`MAX_FIGURES`; the families after that are left out:
    :func:`left_out`). File names are distinct and stable (see the module docstring)."""
    max_total = MAX_FIGURES if max_total is None else max_total
    figures: list[Figure] = []
    taken: set[str] = set()
    for family, names in group_metrics(series).items():
        chunks = [names[i : i + max_panels] for i in range(0, len(names), max_panels)][:max_figures]
        if len(figures) + len(chunks) > max_total:
            break
        left_out = len(names) - sum(len(chunk) for chunk in chunks)
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            stem = _file_stem(family if k == 0 else f"{family}-{k + 1}", taken)
            figures.append(Figure(stem, family, chunk, left_out if last else 0))
    return figures


def left_out(series: Mapping[str, object], figures: Sequence[Figure]) -> dict[str, list[str]]:
    """``{family: metric names}`` of the families :func:`plan_figures` drew no PNG of (the run-wide cap)."""
    drawn = {figure.family for figure in figures}
    return {family: names for family, names in group_metrics(series).items() if family not in drawn}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, title: str | None = None) -> list[Path]:
    """Write the PNGs of the run in ``run_dir`` into ``out_dir`` (default ``RUN_DIR/plots``): one per metric family,
    split when large (:func:`plan_figures`).

    Returns the written paths, in :data:`FAMILY_ORDER` first. Raises if the run logged no metric at all.
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else None
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"the output folder {out_dir} is a file: pass a folder (it is created if missing)")
    history = load_log_history(run_dir)
    skipped = sum(not isinstance(entry, Mapping) for entry in history)
    if skipped:
        logger.warning(f"{skipped} of {len(history)} log_history entries are not JSON objects: skipped")
    undrawable: dict[str, int] = {}
    series = metric_series(history, undrawable)
    if undrawable:
        logger.warning(
            f"{sum(undrawable.values())} values of {len(undrawable)} metrics are NaN, ±inf or beyond "
            f"±{MAX_DRAWN_MAGNITUDE:g}: not drawn ("
            + ", ".join(f"{printable(name)}: {count}" for name, count in list(undrawable.items())[:5])
            + (", ..." if len(undrawable) > 5 else "")
            + ")"
        )
    if not series:
        raise ValueError(f"the run in {run_dir} logged no metric with a step (is logging_steps > max_steps?)")
    figures = plan_figures(series)
    for figure in figures:
        if figure.not_drawn:
            logger.warning(
                f"{figure.not_drawn} {figure.family} metrics not drawn: at most {MAX_FIGURES_PER_FAMILY} PNGs of "
                f"{MAX_PANELS_PER_FIGURE} panels per family (plot_comparison draws chosen metrics)"
            )
    plt = _pyplot()
    out_dir = _safe_out_dir(run_dir, out_dir)
    missing = left_out(series, figures)
    note = out_dir / NOT_DRAWN_FILE
    if missing:
        text = (
            f"At most {MAX_FIGURES} PNGs per run: these {len(missing)} metric families were not drawn "
            "(plot_comparison draws chosen metrics).\n"
            + "".join(
                f"{printable(family)}: {', '.join(map(printable, names))}\n" for family, names in missing.items()
            )
        )
        write_new_file(note, lambda f: f.write(text.encode("utf-8")))
        logger.warning(
            f"{len(missing)} metric families ({sum(map(len, missing.values()))} metrics) not drawn: at most "
            f"{MAX_FIGURES} PNGs per run; they are listed in {note}"
        )
    elif note.exists():
        note.unlink()  # from an earlier plot of this run
    written = []
    for figure in figures:
        names = figure.metrics
        rows, columns = _grid(len(names))
        fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names, strict=False):  # spare cells: hidden below
            steps, values = series[name]
            smooth = moving_average(values)
            if smooth is None:
                ax.plot(steps, values, marker=".", label="train")
            else:  # noisy per-step values: faint raw line, bold running mean
                ax.plot(steps, values, alpha=0.3, color="C0")
                ax.plot(steps, smooth, color="C0", label=f"train (mean of {_window(len(values))})")
            eval_name = "eval_" + name
            if not name.startswith("eval_") and eval_name in series:
                ax.plot(*series[eval_name], linestyle="--", marker="o", markersize=3, color="C1", label="eval")
            if smooth is not None or (not name.startswith("eval_") and eval_name in series):
                ax.legend(fontsize=7)
            ax.set_title(_title(name), fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.ticklabel_format(axis="y", useOffset=False)  # 1.00001, not "1e-5+1" above the axis
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(names) :]:
            ax.set_visible(False)
        heading = f"{title or run_dir.name}: {figure.family}"
        if figure.not_drawn:
            heading += f" ({figure.not_drawn} more {figure.family} metrics not drawn)"
        fig.suptitle(_title(heading), fontsize=10)
        fig.tight_layout()
        path = write_new_file(out_dir / f"{figure.name}.png", partial(fig.savefig, format="png", dpi=100))
        plt.close(fig)
        written.append(path)
    return written


def plot_comparison(
    runs: Mapping[str, Sequence[Mapping]],
    metrics: Sequence[str],
    out_path: str | Path,
    *,
    title: str = "",
    log_y: Iterable[str] = (),
) -> Path:
    """One PNG with a panel per metric and one line per run (``{label: log_history}``), e.g. none/r2/r3.

    Metrics in ``log_y`` get a logarithmic y axis when all their values are positive (KL estimators span decades).
    A metric that no run logged gets an empty panel that says so rather than silently disappearing.
    """
    log_y = set(log_y)
    if not metrics:
        raise ValueError("plot_comparison needs at least one metric")
    plt = _pyplot()
    per_run = {label: metric_series(history) for label, history in runs.items()}
    rows, columns = _grid(len(metrics))
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for ax, name in zip(axes.flat, metrics, strict=False):  # spare cells: hidden below
        drawn = False
        for label, series in per_run.items():
            if name in series:
                steps, values = series[name]
                ax.plot(steps, values, label=printable(label), marker="." if len(steps) <= 40 else None)
                drawn = True
        if drawn:
            ax.legend(fontsize=7)
            values = [v for series in per_run.values() for v in series.get(name, ((), ()))[1]]
            if name in log_y and min(values) > 0:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(_title(name), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(printable(title), fontsize=10)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_new_file(out_path, lambda f: fig.savefig(f, format=out_path.suffix.lstrip(".").lower() or "png", dpi=100))
    plt.close(fig)
    return out_path
