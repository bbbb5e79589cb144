"""One trainer per output directory (trl_moe_replay.core.output_lock, issue 16): a second trainer on a busy directory is
refused, a crashed one's lock is taken over, another host's lock is judged by its heartbeat, plain TRL only warns,
and a lock file that is not ours is replaced without being parsed in full."""

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trl_moe_replay.core.output_lock import LOCK_NAME, STALE_AFTER_S, OutputDirInUseError, OutputDirLock
from trl_moe_replay.testing import (
    tiny_moe_model,
)

from tests.helpers import run_two_ranks
from tests.trainer.test_grpo_trainer import make_trainer


# ----------------------------------------------------------------------------- one trainer per output_dir
HOLD_LOCK = """
import sys
from trl_moe_replay.core.output_lock import OutputDirLock
lock = OutputDirLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # until the test kills it (or, should the test die, closes the pipe): however long the test takes
"""


@contextlib.contextmanager
def lock_held_by_another_process(output_dir):
    """Another process holding ``output_dir``'s lock, as a second trainer would; killed (not released) on exit."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(output_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # a second process holds the lock
@pytest.mark.ci
def test_a_second_trainer_on_a_busy_output_dir_is_refused_and_a_crashed_ones_lock_is_taken_over(tmp_path, caplog):
    lock_path = tmp_path / LOCK_NAME
    with lock_held_by_another_process(tmp_path) as holder:
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1)
        with pytest.raises(OutputDirInUseError, match=f"in use by another trainer: pid {holder.pid} on "):
            trainer.train()
        assert trainer.state.global_step == 0 and json.loads(lock_path.read_text())["pid"] == holder.pid
    # the holder was killed without releasing: a crashed run. Its lock is stale and taken over, with a warning.
    assert json.loads(lock_path.read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert f"process {holder.pid} is gone" in caplog.text
    assert json.loads(lock_path.read_text())["pid"] == os.getpid()
    trainer.end()
    assert not lock_path.exists()


def test_trainers_of_one_process_reuse_an_output_dir_one_after_the_other(tmp_path):
    lock_path = tmp_path / LOCK_NAME
    first = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, save_strategy="steps", save_steps=1)
    first.train()
    assert lock_path.exists()  # held after train(): save_model / save_state come next
    # a second trainer object of the same process (a notebook cell run again, a resumed run) takes over ...
    second = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=2, save_strategy="steps", save_steps=1)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 2
    token = json.loads(lock_path.read_text())["token"]
    # ... and the first one, collected later, does not drop its successor's lock
    del first
    gc.collect()
    assert json.loads(lock_path.read_text())["token"] == token
    del second
    gc.collect()
    assert not lock_path.exists()


def test_a_lock_of_another_host_is_judged_by_its_heartbeat(tmp_path, caplog):
    lock_path = tmp_path / LOCK_NAME
    lock_path.write_text(json.dumps({"pid": 4242, "host": "node-7", "token": "theirs", "started": "earlier"}))
    lock = OutputDirLock(tmp_path)
    with pytest.raises(OutputDirInUseError, match="pid 4242 on node-7"):  # fresh heartbeat: live (can't see the pid)
        lock.acquire()
    old = time.time() - STALE_AFTER_S - 10
    os.utime(lock_path, (old, old))
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        lock.acquire()
    assert "no heartbeat for" in caplog.text and lock.held
    lock.release()
    assert not lock_path.exists()


@pytest.mark.slow  # a second process holds the lock
@pytest.mark.ci
def test_plain_trl_on_a_busy_output_dir_only_warns(tmp_path, caplog):
    # routing_replay="none" is plain GRPOTrainer, which TRL would run: a loud warning, not a refusal
    with lock_held_by_another_process(tmp_path) as holder:
        trainer = make_trainer(tmp_path, tiny_moe_model("qwen3_moe"), max_steps=1, routing_replay="none")
        with caplog.at_level(logging.WARNING, logger="trl_moe_replay.trainer.grpo_trainer"):
            trainer.train()
        assert trainer.state.global_step == 1
        assert "OUTPUT DIR IN USE" in caplog.text and f"pid {holder.pid}" in caplog.text
        trainer.end()


@pytest.mark.slow  # torchrun, two processes, twice
@pytest.mark.serial
def test_the_main_process_alone_holds_the_lock_under_data_parallelism(tmp_path):
    result = run_two_ranks(Path(__file__).parents[1] / "scripts" / "output_lock_ddp.py", tmp_path / "run")
    # print() writes text and newline separately, so one rank's report can land right after the other's on one line
    reports = [json.JSONDecoder().raw_decode(chunk)[0] for chunk in result.stdout.split("REPORT ")[1:]]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    main = next(r for r in reports if r["rank"] == 0)
    for report in reports:  # during training both ranks see one lock, the main process's
        assert report["lock_pid"] == main["pid"] and report["steps"] == 1
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released by end()
    # and a busy output_dir stops both ranks (not only the main one, which would leave the other hanging)
    with lock_held_by_another_process(tmp_path / "run"):
        failed = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(Path(__file__).parents[1] / "scripts" / "output_lock_ddp.py"),
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert failed.returncode != 0 and failed.stderr.count("OutputDirInUseError") >= 2


@pytest.mark.parametrize(
    "content",
    [
        "[" + ",".join(["{}"] * 5_000) + "]",  # 15 KB, 10,000 values
        json.dumps({"pid": 1, "padding": "x" * 100_000}),  # 100 KB
    ],
    ids=["many values", "many bytes"],
)
def test_a_lock_file_far_larger_than_a_lock_is_replaced_without_being_parsed(tmp_path, caplog, monkeypatch, content):
    """Read with a bound (trl_moe_replay/bounded_json.py): a hostile lock file cannot make the lock's reader build
    many times its size in objects; it is not one of ours, so it is replaced, with a warning."""
    (tmp_path / LOCK_NAME).write_text(content)
    parsed, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: parsed.append(len(text)) or loads(text, *a, **k))
    lock = OutputDirLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        lock.acquire()
    try:
        assert lock.held and "it is not a lock file this package wrote" in caplog.text
        assert parsed and max(parsed) < 1_000  # only our own lock was parsed
    finally:
        lock.release()


def test_a_lock_file_holding_a_number_python_will_not_convert_is_replaced(tmp_path, caplog):
    # json raises a plain ValueError on an integer of more than 4,300 digits: it was a traceback from acquire()
    (tmp_path / LOCK_NAME).write_text('{"pid": ' + "1" * 5000 + "}")
    lock = OutputDirLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trl_moe_replay.core.output_lock"):
        lock.acquire()
    try:
        assert lock.held and "it is not a lock file this package wrote" in caplog.text
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
