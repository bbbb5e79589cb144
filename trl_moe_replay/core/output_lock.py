"""One trainer per output directory: a lock file that a second, concurrent run is refused on.

Two runs writing into one ``output_dir`` overwrite each other's checkpoints, ``trainer_state.json`` and logs, and
the last writer wins silently. :class:`OutputDirLock` is a small JSON file, ``output_dir/_trl_moe_replay.lock``
(transformers' ``push_to_hub`` skips names starting with ``_``), holding the owner's pid, host and a random token.
The owner touches it every :data:`HEARTBEAT_S` seconds from a daemon thread while it holds it.

A lock found in place is judged:

- written by this process (an earlier trainer object, e.g. a notebook cell run again, or a resumed run): taken over;
- its heartbeat is older than :data:`STALE_AFTER_S`, or its pid is gone on this host (a crashed run): taken over,
  with a warning;
- otherwise another live run owns the directory: :class:`OutputDirInUseError`, naming its pid and host.

Release removes the file only while it still carries this lock's token, so an older trainer object of the same process
that is garbage-collected later does not drop its successor's lock. Two runs that find the same stale lock at the same
instant may both take it over (the check and the replacement are not one atomic step).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
import weakref
from pathlib import Path

from transformers.utils import logging

from ..bounded_json import JSONFileError, read_json_file
from ..errors import TrlMoeReplayError


logger = logging.get_logger(__name__)

LOCK_NAME = "_trl_moe_replay.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


class OutputDirInUseError(TrlMoeReplayError, RuntimeError):
    """Another live trainer writes into this output directory."""


class OutputDirLock:
    """The lock of one output directory, for one trainer (see the module docstring)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_NAME
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return (_read(self.path) or {}).get("token") == self.token

    def acquire(self) -> None:
        """Create the lock file, or take over one that is ours or stale; raise ``OutputDirInUseError`` otherwise."""
        if self.held:
            return
        if self.path.is_dir() or (self.path.exists() and not self.path.is_file()):
            raise OutputDirInUseError(
                f"{self.path} is a {'folder' if self.path.is_dir() else 'special file'}, not this package's lock "
                "file: the trainer keeps its one-run-per-output_dir lock under that name. Remove it (or use another "
                "output_dir)."
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "token": self.token,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        }
        for _ in range(3):  # another process may create the file between our removal of a stale one and our create
            if _create_with(self.path, json.dumps(owner)):
                self._stop.clear()
                self._heartbeat = threading.Thread(target=self._beat, name="trl-moe-replay-output-lock", daemon=True)
                self._heartbeat.start()
                return
            self._judge(_read(self.path))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        raise OutputDirInUseError(f"could not create {self.path}: other processes keep creating it")

    def release(self) -> None:
        """Remove the lock file if it is still this lock's; stop the heartbeat."""
        self._stop.set()
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _judge(self, owner: dict | None) -> None:
        """Return if the lock file in place may be taken over; raise if a live run owns it."""
        if owner is None:  # vanished, or not a lock we wrote (unreadable, not JSON, too large): replace it
            if self.path.is_file():
                logger.warning(
                    f"replacing {self.path}: it is not a lock file this package wrote (unreadable, not a "
                    "JSON object, or far larger than one)"
                )
            return
        pid, host = owner.get("pid"), owner.get("host")
        if pid == os.getpid() and host == socket.gethostname():
            return  # an earlier trainer of this very process
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return
        gone = host == socket.gethostname() and not _alive(pid)
        if gone or age > STALE_AFTER_S:
            why = f"process {pid} is gone" if gone else f"no heartbeat for {age:.0f} s"
            logger.warning(
                f"taking over the lock of {self.path.parent} left by an earlier run (pid {pid} on {host}, started "
                f"{owner.get('started')}): {why}; it probably crashed"
            )
            return
        raise OutputDirInUseError(
            f"output_dir {self.path.parent} is in use by another trainer: pid {pid} on {host}, started "
            f"{owner.get('started')}. Two runs in one folder overwrite each other's checkpoints and logs. Use another "
            f"output_dir, or stop that run; if it is not running any more, delete {self.path}."
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.held:  # taken over (or removed): nothing to keep alive
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)


def hold_output_dir(trainer) -> OutputDirLock:
    """The lock of ``trainer.args.output_dir`` for ``trainer`` (sync or async), released when the trainer is garbage
    collected. Both trainers build it in ``__init__``, claim it in ``train()`` (:func:`claim_output_dir`) and release
    it in ``end()``."""
    lock = OutputDirLock(trainer.args.output_dir)
    weakref.finalize(trainer, lock.release)
    return lock


def claim_output_dir(lock: OutputDirLock, state, *, strict: bool = True) -> None:
    """Acquire ``lock`` on the main process of ``state`` (an ``Accelerator`` or ``PartialState``) and share the
    outcome: with ``strict``, :class:`OutputDirInUseError` on every rank (the others would otherwise hang), else a
    loud warning. The one check both the trainer's ``train()`` and the recipe (before any other work) go through."""
    problem = None
    if state.is_main_process:  # one lock per run
        try:
            lock.acquire()
        except OutputDirInUseError as exc:
            problem = str(exc)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem])[0]
    if problem is not None and not strict:
        logger.warning(f"OUTPUT DIR IN USE (not stopping: routing_replay='none' trains as TRL would): {problem}")
    elif problem is not None:
        raise OutputDirInUseError(problem)


def _create_with(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` in one atomic step (a hard link of a written temporary file); False if it
    exists. Readers never see it half written. Without hard links (some filesystems), an exclusive create."""
    temporary = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    temporary.write_text(text)
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    finally:
        temporary.unlink()


#: A lock file is a few hundred bytes of a flat JSON object: anything much larger is not one of ours.
_MAX_LOCK_BYTES, _MAX_LOCK_VALUES = 64 * 2**10, 1_000


def _read(path: Path) -> dict | None:
    """The lock's owner, or ``None`` where there is none or the file is not a lock this package wrote (unreadable,
    not JSON, too large to parse: read with a bound, so a hostile file cannot exhaust memory)."""
    try:
        owner = read_json_file(path, max_bytes=_MAX_LOCK_BYTES, max_values=_MAX_LOCK_VALUES)
    except (OSError, JSONFileError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(pid) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
