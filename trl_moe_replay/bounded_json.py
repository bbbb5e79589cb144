"""Reading a JSON file another process wrote, within bounds: what the file is, how large it is, and how many values
parsing it may build.

A cap on the file's bytes alone does not bound memory: ``json.loads`` turns each ``{}`` or ``[]`` of a file into a
Python object about 27 times its size, so 256 MiB of empty objects needs about 7 GiB (a ``MemoryError`` traceback under
a memory limit). :func:`read_json_file` counts, before parsing, the bytes that can start a value or a key (``[``,
``{``, ``,`` and ``:``; a count that can only over-estimate, as those inside strings count too) and refuses a file
with more than ``max_values`` of them, so parsing builds at most that many objects. It is the one reader of
``plot`` (cli/plotting.py), ``describe_run`` (checkpointing/checkpoints.py), the output-dir lock (core/output_lock.py)
and the resume pre-flight's ``trainer_state.json`` (checkpointing/checkpoint_files.py), and of ``plan``'s files (a model's
``config.json``; the recipe config and accelerate files through :func:`read_regular_file`); it imports nothing of the package
but ``errors.py`` (which imports nothing), so ``plot`` still runs without TRL or torch.

Only a regular file is read, checked on the opened file (``fstat``: a link to ``/dev/zero``, a FIFO or a folder is
refused, and the file cannot be swapped between check and read); ``O_NONBLOCK`` keeps the open of a FIFO from
waiting for a writer. Every refusal is a :class:`JSONFileError`, one line.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from .errors import TrlMoeReplayError


#: Largest file read (bytes): a long run's trainer_state.json (every step logged) stays far below it.
MAX_JSON_BYTES = 256 * 2**20
#: Most values (and keys) parsing may build: about 100 bytes each at worst in CPython (an empty dict and its slot),
#: so under 1 GiB; a trainer_state.json logging 40 metrics a step holds about 80 per logged step (100,000 steps).
MAX_JSON_VALUES = 8 * 2**20
#: The bytes before which a JSON value or key can start (every one but the top-level value follows one of them).
_VALUE_STARTS = (b"[", b"{", b",", b":")


class JSONFileError(TrlMoeReplayError, ValueError):
    """A JSON file that is not read: not a regular file, too large, too many values to parse, not valid UTF-8 JSON,
    nested too deeply, or holding a number Python will not convert (an integer of more than 4,300 digits)."""


def read_json_file(path: str | os.PathLike, *, max_bytes: int | None = None, max_values: int | None = None) -> Any:
    """The parsed content of the JSON file ``path``, or :class:`JSONFileError` (see the module docstring); at most
    ``max_bytes`` (default :data:`MAX_JSON_BYTES`) and ``max_values`` (default :data:`MAX_JSON_VALUES`).
    ``FileNotFoundError`` (an ``OSError``) if it does not exist."""
    max_bytes = MAX_JSON_BYTES if max_bytes is None else max_bytes
    max_values = MAX_JSON_VALUES if max_values is None else max_values
    data = _read_regular_file(path, max_bytes)
    values = count_values(data)
    if values > max_values:
        raise JSONFileError(
            f"{path} holds up to {values:,} JSON values, more than the {max_values:,} read: refusing to parse it "
            "(parsing builds a Python object per value, many times the file's size)"
        )
    try:
        return json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JSONFileError(
            f"{path} is not valid JSON ({' '.join(str(exc).split())}): the file may be truncated (a run stopped "
            "while saving it)"
        ) from None
    except ValueError as exc:  # Python's own limit: an integer of more than 4,300 digits is not converted
        raise JSONFileError(
            f"{path} holds a number Python refuses to convert ({' '.join(str(exc).split())}): no file this package "
            "or the Trainer writes has one; the file is damaged or not the run's"
        ) from None
    except RecursionError:
        raise JSONFileError(f"{path} nests JSON arrays or objects too deeply to read") from None
    except MemoryError:  # a machine with less memory than max_values needs
        raise JSONFileError(f"{path}: not enough memory to parse it ({len(data):,} bytes)") from None


def count_values(data: bytes) -> int:
    """An upper bound on the values and keys parsing ``data`` builds: one more than the bytes a value or key can
    follow (those inside strings count too, so it never under-counts)."""
    return 1 + sum(data.count(start) for start in _VALUE_STARTS)


def _read_regular_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a folder"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "special"
            )
            raise JSONFileError(f"{path} is {kind}, not a regular file: refusing to read it")
        # + 1: a file that grew past the limit since fstat (or reports no size, as /proc's do) is refused too
        data = b"" if info.st_size > max_bytes else _read_up_to(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if info.st_size > max_bytes or len(data) > max_bytes:
        raise JSONFileError(f"{path} holds more than {max_bytes / 2**20:g} MiB: refusing to read it")
    return data


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(limit - size, 1 << 20))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_regular_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``max_bytes``, else :class:`JSONFileError` (the
    same checks as :func:`read_json_file`; for a YAML or other text file, which its caller parses)."""
    return _read_regular_file(path, max_bytes)
