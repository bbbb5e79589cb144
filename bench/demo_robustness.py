"""The offline demos over seeds and thread counts: does the promise of docs/demo.md hold on every run, not just one?

A float sum done in another order (another CPU type, another thread count) changes a sample early on, and from there
the run is another run, as if the seed had changed. So a seed is the honest stand-in for a CPU this machine is not:
a demo whose promise holds on 19 of 20 seeds here holds on other CPUs with the same odds. Each run is the demo's own
command (``recipes/grpo_r3.py``, a fresh process) with ``--seed`` and ``--tiny_num_threads``; its cold start is cached
per seed in ``--cache`` (shared by every mode and thread count of that seed... the thread count is part of its key).

The promise (:func:`judge`, which ``tests/cross_cutting/test_docs.py`` applies to the CI machine's own run):

    cold start   its sampled accuracy is at least 3 of 128 and leaves room for the rise (at most 1 - RISE)
    rise         the mean reward of the last 10 logged steps is at least RISE above that of the first 10
    tool calls   (tool demo) the tool calls per sample rise by RISE the same way
    stop         (math demo) over the last 10 logged steps at most CLIPPED_AT_MOST of the completions were cut at
                 the length limit, and at every step some completion ended

Per run it prints one row (cold-start accuracy, first and last reward, max clipped ratio, the first step at which the
10-step mean reward cleared the first 10 steps' mean + RISE, and whether the promise held), then the count per thread
count. Results go to ``--out`` (JSON; a run already there is not run again, so an interrupted sweep resumes).

    python bench/demo_robustness.py --seeds 20 --threads 1                      # the math demo, seeds 0-19
    python bench/demo_robustness.py --seeds 10 --threads 2
    python bench/demo_robustness.py --demo tools --seeds 10 --threads 1
    python bench/demo_robustness.py --seeds 8 --label none -- --routing_replay none   # recipe flags after --
    python bench/demo_robustness.py --report-only                               # the table from the JSON

Not in CI (a run takes about 2-4 minutes on a core; the sweep an hour or more). ``--jobs`` runs several at once (one
per core at one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo_r3.py"
DEMOS = {"math": [], "tools": ["--config", str(ROOT / "recipes" / "configs" / "tiny_tools_r3.yaml")]}

#: the rise the demo exists to show (GRPO learns): the mean reward of the last WINDOW logged steps at least this much
#: above that of the first WINDOW. Each side averages WINDOW steps of 128 completions (standard error <= 0.014 for a 0/1
#: reward), so a run that learns clears it with room and one that does not learn cannot.
RISE = 0.2
WINDOW = 10
#: the policy the run leaves stops: over the last WINDOW logged steps, at most this share of the completions was cut at
#: max_completion_length (a policy that keeps its stop cuts about none; one that drifted to writing past its answer
#: cuts nearly all, not 0.02), and at every step some completion ended. A share above it at an earlier step is an
#: episode the run came back from; the table's `clipped` column shows the largest.
CLIPPED_AT_MOST = 0.01
#: the cold start learned the answer form (an untrained policy never samples the exact sum in \boxed{}: at least 3 of
#: 128 right) and leaves GRPO room for the rise
COLD_START_ACCURACY = (3 / 128, 1 - RISE)
COLD_START = re.compile(r"cold start: \d+ SFT steps, sampled accuracy ([\d.]+)")


#: what each demo promises (docs/demo.md): the math demo's completions stop; the tool demo's tool calls per sample rise
#: by RISE as its reward does (a multi-turn completion is cut at 96 tokens now and then: its clipped share is shown,
#: not promised)
PROMISES = {"math": ("cold_start", "rise", "stop"), "tools": ("cold_start", "rise", "tool_calls")}


def mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def judge(log_history: list[dict], cold_start_accuracy: float | None, demo: str = "math", key: str = "reward") -> dict:
    """What one run shows against ``demo``'s promise: the figures of its row, the promised ``checks`` and ``held``
    (every one of them)."""
    steps = [entry for entry in log_history if key in entry]
    rewards = [entry[key] for entry in steps]
    clipped = [entry.get("completions/clipped_ratio", 0.0) for entry in steps]
    first, last = mean(rewards[:WINDOW]), mean(rewards[-WINDOW:])
    rose_at = next(
        (
            steps[i + WINDOW - 1].get("step", i + WINDOW)
            for i in range(len(rewards) - WINDOW + 1)
            if sum(rewards[i : i + WINDOW]) / WINDOW >= first + RISE
        ),
        None,
    )
    calls = [entry.get("tools/call_frequency", 0.0) for entry in steps]
    every = {
        "cold_start": cold_start_accuracy is not None
        and COLD_START_ACCURACY[0] <= cold_start_accuracy <= COLD_START_ACCURACY[1],
        "rise": len(rewards) >= 2 * WINDOW and last >= first + RISE,
        "stop": bool(steps)
        and mean(clipped[-WINDOW:]) <= CLIPPED_AT_MOST
        and all(entry.get("completions/mean_terminated_length", 1.0) > 0 for entry in steps),
        "tool_calls": len(calls) >= 2 * WINDOW and mean(calls[-WINDOW:]) >= mean(calls[:WINDOW]) + RISE,
    }
    checks = {part: every[part] for part in PROMISES[demo]}
    return dict(
        cold_start_accuracy=cold_start_accuracy,
        first=first,
        last=last,
        max_clipped=max(clipped, default=0.0),
        rose_at=rose_at,
        steps=len(steps),
        checks=checks,
        held=all(checks.values()),
    )


def run_one(demo: str, seed: int, threads: int, recipe_args: list[str], folder: Path, cache: Path) -> dict:
    """One demo run in a fresh process; its judged row (plus wall time and, on failure, the tail of its output)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRL_MOE_REPLAY_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    command = [
        sys.executable,
        str(RECIPE),
        *DEMOS[demo],
        "--seed",
        str(seed),
        "--tiny_num_threads",
        str(threads),
        "--output_dir",
        str(folder / "run"),
        "--plot",
        "false",
        "--disable_tqdm",
        "true",
        *recipe_args,
    ]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    output = result.stdout + result.stderr
    (folder / "output.log").write_text(output)
    if result.returncode != 0 or not (folder / "run" / "trainer_state.json").exists():
        return dict(error=f"rc {result.returncode}: {output[-2000:]}", held=False, seconds=seconds)
    return {**judge_folder(demo, folder), "seconds": seconds}


def judge_folder(demo: str, folder: Path) -> dict:
    """The judged row of the run saved in ``folder`` (its output.log and run/trainer_state.json)."""
    match = COLD_START.search((folder / "output.log").read_text())
    log_history = json.loads((folder / "run" / "trainer_state.json").read_text())["log_history"]
    return judge(log_history, float(match.group(1)) if match else None, demo)


def row_text(name: str, row: dict) -> str:
    if "error" in row:
        return f"{name:<22} ERROR {row['error'].splitlines()[-1][:80] if row['error'] else ''}"
    failed = [part for part, ok in row["checks"].items() if not ok]
    accuracy = row["cold_start_accuracy"]
    return (
        f"{name:<22} {accuracy if accuracy is not None else float('nan'):>6.2f} {row['first']:>6.3f} "
        f"{row['last']:>6.3f} {row['max_clipped']:>8.3f} {str(row['rose_at'] or '-'):>8} "
        f"{'yes' if row['held'] else 'NO (' + ', '.join(failed) + ')':<10} {row['seconds']:>6.0f}"
    )


HEADER = f"{'run':<22} {'cold':>6} {'first':>6} {'last':>6} {'clipped':>8} {'rose at':>8} {'promise':<10} {'s':>6}"


def report(results: dict) -> str:
    """The table: one row per run, then per (label, demo, threads) the count that met the promise."""
    lines = [HEADER]
    groups: dict[str, list[bool]] = {}
    for name in sorted(results["runs"], key=natural_key):
        row = results["runs"][name]
        lines.append(row_text(name, row))
        group = name.rsplit("/seed", 1)[0]
        groups.setdefault(group, []).append(row["held"])
    lines.append("")
    for group, held in sorted(groups.items()):
        lines.append(f"{group}: promise held on {sum(held)} of {len(held)} seeds")
    return "\n".join(lines)


def natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def environment() -> dict:
    import torch
    import transformers
    import trl

    cpu = platform.processor() or ""
    with open("/proc/cpuinfo") as f:  # Linux: the model name (platform.processor() is often just the architecture)
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        trl=trl.__version__,
        date=time.strftime("%Y-%m-%d"),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    recipe_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--demo", choices=sorted(DEMOS), default="math")
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (or --seed-list)")
    parser.add_argument("--seed-list", type=int, nargs="+", help="these seeds instead of 0..N-1")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch thread counts (--tiny_num_threads)")
    parser.add_argument("--label", default="default", help="name of this configuration in the table (e.g. none)")
    parser.add_argument(
        "--jobs", type=int, default=max(1, (os.cpu_count() or 1)), help="runs at once; a run of T threads counts as T"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "demo_robustness" / "demo_robustness.json")
    parser.add_argument("--cache", type=Path, default=None, help="cold-start cache (default: beside --out)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--rejudge",
        action="store_true",
        help="judge the saved runs again (after a change of the promise) and print the table",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1 or any(t < 1 for t in args.threads) or args.jobs < 1:
        parser.error("--seeds, --threads and --jobs must be at least 1")

    results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}, "settings": {}}
    if args.rejudge:
        for name, row in results["runs"].items():
            if "error" not in row:
                results["runs"][name] = {
                    **judge_folder(name.split("/")[1], args.out.parent / name),
                    "seconds": row["seconds"],
                }
        args.out.write_text(json.dumps(results, indent=1))
    if args.report_only or args.rejudge:
        print(report(results))
        return 0
    results.setdefault("environment", environment())
    cache = args.cache or args.out.parent / "cold_start_cache"
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    todo = [
        (threads, seed)
        for threads in args.threads
        for seed in seeds
        if f"{args.label}/{args.demo}/threads{threads}/seed{seed}" not in results["runs"]
    ]
    results["settings"][f"{args.label}/{args.demo}"] = recipe_args
    print(
        f"{len(todo)} runs to do ({args.demo} demo, {args.label}: {' '.join(recipe_args) or 'the demo as shipped'}; "
        f"{args.jobs} core(s)); {HEADER}",
        flush=True,
    )
    started = time.perf_counter()
    done = 0

    def launch(threads: int, seed: int) -> dict:
        name = f"{args.label}/{args.demo}/threads{threads}/seed{seed}"
        return run_one(args.demo, seed, threads, recipe_args, args.out.parent / name, cache)

    for threads in args.threads:  # one thread count at a time, so a T-thread run gets its T cores
        batch = [(t, s) for t, s in todo if t == threads]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs // threads)) as pool:
            futures = {pool.submit(launch, t, s): (t, s) for t, s in batch}
            for future in as_completed(futures):
                t, s = futures[future]
                name = f"{args.label}/{args.demo}/threads{t}/seed{s}"
                results["runs"][name] = future.result()
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
                done += 1
                elapsed = time.perf_counter() - started
                print(
                    f"[{done}/{len(todo)}, {elapsed / 60:.0f} min, ~{elapsed / done * (len(todo) - done) / 60:.0f} "
                    f"min left] {row_text(name, results['runs'][name])}",
                    flush=True,
                )
    print(report(results))
    env = results["environment"]
    print(
        f"machine: {env['cpu']}, {env['cores']} cores; Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, TRL {env['trl']}; {env['date']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
