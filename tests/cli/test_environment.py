"""`trl-moe-replay env` for a bug report: the machine's rows (GPU rows "none" on a CPU machine), the accelerate
config, the package with its git commit, the stack, the routing-replay default and the seam's probes; no error line
when the reader of a pipe leaves early."""

import json
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import torch

from trl_moe_replay.cli import environment, main
from trl_moe_replay.cli.environment import gpu_rows, nvidia_driver, seam_rows


ROOT = Path(__file__).resolve().parents[2]


def test_on_a_cpu_machine_the_gpu_rows_say_none(capsys):
    assert not torch.cuda.is_available()  # the suite's machines have no GPU
    rows = gpu_rows()
    assert rows["GPUs"].startswith("none") and rows["NCCL"] == "none" and rows["driver"] == "none"
    assert rows["CUDA"].startswith("none") or "no device visible" in rows["CUDA"]
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    lines = {
        line.split("  ", 1)[0].strip(): line.split("  ", 1)[1].strip()
        for line in out.splitlines()
        if "  " in line and not line.startswith(" ")
    }
    assert lines["platform"] == platform.platform() and lines["Python"] == platform.python_version()
    assert lines["GPUs"].startswith("none") and lines["NCCL"] == "none" and lines["driver"] == "none"
    assert lines["routing_replay default"].startswith("'r3'")
    assert "accelerate config" in lines


def test_the_package_row_names_the_clones_commit():
    short = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    row = environment.system_rows()["trl-moe-replay"]
    assert row.startswith(f"{version('trl-moe-replay')}+{short}")
    assert environment.git_commit(ROOT / "docs") is None  # not a clone's root: no commit claimed


def test_the_gpu_rows_of_a_gpu_machine(monkeypatch, tmp_path):
    """With two visible GPUs (torch's answers replaced): each GPU's name and memory, torch's CUDA, NCCL's version and
    the kernel driver's, read from /proc/driver/nvidia/version's first line."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  (dvs)\n")
    monkeypatch.setattr(environment, "nvidia_driver", lambda: nvidia_driver(str(driver)))
    assert gpu_rows() == {
        "GPUs": "0: NVIDIA H100 80GB HBM3 (80.0 GiB); 1: NVIDIA H100 80GB HBM3 (80.0 GiB)",
        "CUDA": "12.8",
        "NCCL": "2.21.5",
        "driver": "570.124.06",
    }
    assert nvidia_driver(str(tmp_path / "absent")) == "none"


def test_every_seam_entry_is_listed_with_its_probe(monkeypatch, capsys):
    from trl_moe_replay import upstream
    from trl_moe_replay.upstream import Finding, all_entries

    entries = all_entries()
    rows = seam_rows()
    assert [r.entry for r in rows] == list(entries)
    assert all(r.probe == "passed" or r.probe.startswith("not probed") for r in rows), [
        r for r in rows if r.probe != "passed"
    ]
    # a probe that fails on this install is named, with what no longer holds
    first = next(iter(entries.values()))
    monkeypatch.setattr(upstream, "check_upstream", lambda: (Finding(first, "GRPOTrainer.x does not exist"),))
    failed = {r.entry: r.probe for r in seam_rows()}
    assert failed[first.name] == "FAILED: GRPOTrainer.x does not exist"
    assert all(probe != failed[first.name] for name, probe in failed.items() if name != first.name)
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"system", "packages", "seam"} == set(report)
    assert next(r for r in report["seam"] if r["entry"] == first.name)["probe"].startswith("FAILED")


def test_a_reader_that_leaves_early_gets_no_error_line():
    """`trl-moe-replay env | head`: the reader closes the pipe before the report is written; no traceback, no
    'Exception ignored' line at exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "trl_moe_replay.cli", "env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    process.stdout.close()  # before the report is written: every write meets a closed pipe
    err = process.stderr.read().decode()
    process.wait(timeout=300)
    assert "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err
