"""Every benchmark ratio and its target in one table (``make bench``).

Runs each script of this folder in a subprocess of its own; each measures its ratios side by side in its one
process (ABBA-interleaved) and prints them as ``ratio: NAME = VALUE (target OP TARGET)`` lines
(``_harness.report``), which this script collects. Prints the date, the machine's load average before and after,
and the table (markdown, ready for docs/benchmarks.md). Not part of CI: minutes with ``--quick``, much longer
without.

    python bench/run_all.py --quick                   # small sizes, few rounds
    python bench/run_all.py                           # the scripts' default sizes (real shapes: very long on CPU)
    python bench/run_all.py --only route_transport vllm_overhead
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^ratio: (?P<name>.+) = (?P<value>-?[0-9.]+|nan|inf) \(target (?P<op><=|>=) (?P<target>[0-9.]+)\)$")

# script -> (arguments with --quick, arguments without)
SCRIPTS = {
    "route_transport": (["--batch", "32", "--repeats", "5"], []),
    "replay_overhead": (["--quick"], []),
    "real_shapes": (["--models", "qwen3", "--tokens", "512", "--rounds", "1"], []),
    "step_overhead": (["--rounds", "3"], []),
    "router_shift_overhead": (["--rounds", "3"], []),
    "pr2_overhead": (["--quick"], []),
    # 9 rounds: on 2 shared cores, 3 rounds do not resolve differences below ~15 %
    "vllm_overhead": (["--rounds", "9", "--max-tokens", "32", "--step-rounds", "9"], []),
    "multi_turn_routes": (["--quick"], []),
}


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (minutes)")
    parser.add_argument("--only", nargs="+", choices=sorted(SCRIPTS), help="run these scripts only")
    args = parser.parse_args()

    started = datetime.datetime.now(datetime.UTC)
    load_before = load()
    rows, failed = [], []
    for script in args.only or list(SCRIPTS):
        extra = SCRIPTS[script][0 if args.quick else 1]
        command = [sys.executable, str(HERE / f"{script}.py"), *extra]
        print(f"$ {' '.join([Path(command[0]).name, *command[1:]])}", flush=True)
        start = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
        seconds = time.perf_counter() - start
        found = [LINE.match(line) for line in run.stdout.splitlines()]
        found = [match for match in found if match]
        print(f"  {len(found)} ratios in {seconds:.0f} s (exit {run.returncode})", flush=True)
        if run.returncode != 0 or not found:
            failed.append(script)
            print(run.stdout[-2000:], run.stderr[-3000:], sep="\n", flush=True)
        for match in found:
            value, target, op = float(match["value"]), float(match["target"]), match["op"]
            met = value <= target if op == "<=" else value >= target
            rows.append((script, match["name"], value, f"{op} {target:g}", "met" if met else "**over**"))
            print(f"  {match['name']}: {value:.3f} (target {op} {target:g})", flush=True)

    print()
    print(
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs"
        f"{' (--quick)' if args.quick else ''}; load average (1/5/15 min) before {load_before}, after {load()}."
    )
    print()
    print("| script | ratio | measured | target | |")
    print("|---|---|---|---|---|")
    for script, name, value, target, verdict in rows:
        print(f"| {script} | {name} | {value:.3f} | {target} | {verdict} |")
    if failed:
        print(f"\nfailed or printed no ratio: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
