"""Runs that survive Ctrl-C and preemption: save a checkpoint on SIGINT or SIGTERM, resume from the newest one, say
what a re-run does.

- :class:`SaveOnInterrupt` (a ``TrainerCallback``): the first Ctrl-C or SIGTERM (:data:`STOP_SIGNALS`; SLURM,
  Kubernetes and torchrun stop a job with SIGTERM, then SIGKILL after a grace period) lets the step in progress
  finish, saves a checkpoint and stops training; a second Ctrl-C, later than :data:`FORCE_AFTER_S`, stops at once
  without a checkpoint. The stop waits for the end of a generation batch: TRL keeps the rollouts of a generation
  batch (and with them the routes R2/R3/PR2 replay) in memory only, and a run resumed in the middle of one regenerates
  it (TRL's ``_buffered_inputs`` is empty after a resume), so only a checkpoint at a boundary resumes exactly.
- :func:`resolve_resume`: ``--resume_from_checkpoint`` with no path (``true``) names the newest complete
  checkpoint of ``output_dir``. Everything of ours that a resume needs is inside the checkpoint: PR2's predictors
  (``pr2_predictors.safetensors``, read by ``MoEReplayGRPOTrainer._load_optimizer_and_scheduler``); routes live only
  inside a generation batch (see above).
- :func:`describe_run` / :class:`StartOver`: a run started into an ``output_dir`` that holds an earlier one says so
  in one line, and (not resuming) removes that run's checkpoints when it starts training, so that a later resume can
  never pick up the older run's checkpoint.

The model weights of a checkpoint come back through :func:`~.checkpoint_weights.restore_checkpoint_weights`
(every weight of the model, or a one-line refusal; checkpointing/checkpoint_weights.py), after the resume pre-flight has
checked the checkpoint's other files (checkpointing/checkpoint_files.py).

A resumed run continues the uninterrupted one bit for bit (loss, grad norm, samples, rewards, every logged number but
the timings) when the checkpoint is at a generation-batch boundary (what :class:`SaveOnInterrupt` writes;
``save_steps`` a multiple of the generation period), within the first epoch, on the same machine and thread count:
the Trainer restores optimizer, scheduler and the RNG states and skips the batches already seen, and the weights come
back whole through ``restore_checkpoint_weights`` (docs/demo.md, "Stopping and resuming"). In a later epoch TRL's
``RepeatSampler`` restarts its shuffling from the seed, so the data order differs.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..bounded_json import read_json_file
from ..errors import TrlMoeReplayError
from .checkpoint_files import check_checkpoint_files


logger = logging.get_logger(__name__)
# what signal.signal takes and returns: a handler, SIG_DFL/SIG_IGN, or None (a handler not installed from Python)
_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

#: A second Ctrl-C this long after the first stops at once (a launcher that forwards the first one to the training
#: processes, as torchrun does, delivers it twice within milliseconds).
FORCE_AFTER_S = 2.0

#: The signals that save a checkpoint and stop: Ctrl-C, and SIGTERM, the stop request of SLURM (``scancel``, the time
#: limit with ``--signal=TERM@S``, preemption), Kubernetes and Docker, which torchrun and accelerate's launchers also
#: forward to every rank. A repeated SIGTERM changes nothing: the scheduler's SIGKILL is the forced stop, and stopping
#: at once would cut the save short.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: Seconds :meth:`SaveOnInterrupt.engine_gone` waits for this process's own stop signal after the vLLM server went
#: away: a scheduler signals every process of a job within moments, in no set order.
ENGINE_GONE_WAIT_S = 5.0
_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
TRAINER_STATE = "trainer_state.json"


class NoCheckpointError(TrlMoeReplayError, FileNotFoundError, ValueError):
    """Asked to resume, but the output directory holds no complete checkpoint (a ``ValueError`` too, as
    transformers' own refusal of ``resume_from_checkpoint=True`` without one)."""


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``output_dir``'s complete ``checkpoint-N`` folders (``trainer_state.json`` in them, the Trainer writes it
    last), oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / TRAINER_STATE).is_file()]


def newest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(value, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint ``--resume_from_checkpoint VALUE`` names: none for ``None``/``false``, the newest complete one
    of ``output_dir`` for ``True``/``"true"``/``""`` (:class:`NoCheckpointError` if there is none), else the path;
    its files checked by the resume pre-flight (:func:`~.checkpoint_files.check_checkpoint_files`, ``CheckpointError``
    in one line), so that a damaged checkpoint is refused before the model is built."""
    folder = _named_checkpoint(value, output_dir)
    if folder is not None:
        check_checkpoint_files(folder)
    return folder


def _named_checkpoint(value, output_dir: str | os.PathLike) -> str | None:
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "no", "none")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("", "true", "yes", "latest")):
        found = newest_checkpoint(output_dir)
        if found is None:
            raise NoCheckpointError(
                f"resume_from_checkpoint: no checkpoint in {output_dir} to resume from (checkpoint-N folders with "
                f"{TRAINER_STATE}); pass --output_dir of the run to resume, or a checkpoint path, or drop the flag "
                "to start a new run"
            )
        return str(found)
    if not os.path.isdir(value):
        raise NoCheckpointError(
            f"--resume_from_checkpoint {value}: no such folder (pass a checkpoint-N folder, "
            "or no value for the newest checkpoint in --output_dir)"
        )
    return str(value)


def describe_run(output_dir: str | os.PathLike) -> str | None:
    """What an earlier run left in ``output_dir`` ("a finished run of 200 steps", "an unfinished run, last checkpoint
    at step 150 of 200"), or ``None`` if it holds none."""
    folder = Path(output_dir)
    newest = newest_checkpoint(folder)
    state_file = newest / TRAINER_STATE if newest else folder / TRAINER_STATE
    if not state_file.is_file():
        return None
    try:
        state = read_json_file(state_file)
        step, max_steps = int(state["global_step"]), int(state["max_steps"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError) as exc:  # JSONFileError is a ValueError
        return f"an earlier run ({state_file} unreadable: {' '.join(str(exc).split())[:200]})"
    if step >= max_steps:
        return f"a finished run of {step} steps"
    return f"an unfinished run (last checkpoint at step {step} of {max_steps})"


class StartOver(TrainerCallback):
    """Remove the ``checkpoint-N`` folders and ``trainer_state.json`` an earlier run left in ``output_dir`` when
    this (not resumed) run begins training: by then the trainer holds the output-directory lock, so no live run's
    files go. Other files (the earlier final model, plots) are overwritten when this run ends."""

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for checkpoint in Path(args.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            if _CHECKPOINT.match(checkpoint.name) and checkpoint.is_dir():
                shutil.rmtree(checkpoint)
        (Path(args.output_dir) / TRAINER_STATE).unlink(missing_ok=True)


class SaveOnInterrupt(TrainerCallback):
    """Ctrl-C (SIGINT) or SIGTERM during ``trainer.train()``: save a checkpoint at the end of the generation batch in
    progress (every step in TRL's default settings) and stop training; ``train()`` then returns normally. A second
    Ctrl-C, :data:`FORCE_AFTER_S` or more after the first request, raises ``KeyboardInterrupt`` at once; a second
    SIGTERM does nothing.

    At the signal the main process says in one line which step it saves at and, should the process be killed before
    (a grace period shorter than the rest of the generation batch plus the save), which checkpoint the run resumes
    from and which steps are lost: a checkpoint cut short has no ``trainer_state.json`` and is never resumed from.

    After ``train()``, :attr:`checkpoint` is the folder saved on the signal (``None`` if there was none) and
    :attr:`signum` the signal (this process's, else the largest number another process got). With several processes
    the decision to stop is shared at each boundary (an all-reduce), so a signal to any one of them stops all at the
    same step.
    """

    def __init__(self):
        self.requested_at: float | None = None
        self.signum: int | None = None
        self.checkpoint: str | None = None
        self.engine_lost = False  # the vLLM server went away during the stop: no checkpoint (engine_gone)
        self._previous_handlers: dict[int, _SignalHandler] = {}
        self._is_main = True
        self._args = self._state = None

    @property
    def interrupted(self) -> bool:
        return self.checkpoint is not None

    @property
    def exit_status(self) -> int:
        """The shell's status for a process stopped by :attr:`signum`: 130 after Ctrl-C, 143 after SIGTERM."""
        return 128 + int(self.signum or signal.SIGINT)

    def took(self) -> str:
        """`` (41 s after SIGTERM)``: from this process's signal to now (after the save), what a grace period must
        cover; empty where the signal reached another process only."""
        if self.requested_at is None:
            return ""
        signum = self.signum
        assert signum is not None  # _handle sets it with requested_at
        return f" ({time.monotonic() - self.requested_at:.0f} s after {_NAMES.get(signum, signum)})"

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at, self.signum = now, signum
            if self._is_main:
                # nothing raised here may reach the code the signal interrupted: rank 0 dying there would leave the
                # other ranks waiting in the step-boundary all-reduce until they are killed, with no checkpoint
                try:
                    line = self._announcement(signum)
                except Exception as error:  # e.g. an OSError listing output_dir (a stale NFS handle)
                    name = _NAMES.get(signum, f"signal {signum}")
                    line = (
                        f"{name}: saving a checkpoint at the end of this generation batch, then stopping "
                        f"(the newest checkpoint could not be listed: {type(error).__name__})"
                    )
                try:
                    print("\n" + line, file=sys.stderr, flush=True)
                except Exception:  # a closed or broken stderr: the save goes on without the line
                    pass
        elif signum == signal.SIGINT and now - self.requested_at >= FORCE_AFTER_S:
            raise KeyboardInterrupt

    def _announcement(self, signum) -> str:
        """The line printed at the signal: where the checkpoint will be, what a kill before that loses."""
        name = _NAMES.get(signum, f"signal {signum}")
        if self._args is None or self._state is None:  # not expected: the handler is set in on_train_begin
            return f"{name}: saving a checkpoint at the end of this generation batch, then stopping"
        at = _next_boundary(self._args, self._state.global_step)
        newest = newest_checkpoint(self._args.output_dir)
        kept = 0
        if newest is not None:
            numbered = _CHECKPOINT.match(newest.name)
            assert numbered is not None  # newest_checkpoint lists checkpoint-N folders only
            kept = int(numbered.group(1))
        where = f"the run resumes from {newest}" if newest is not None else "with no checkpoint yet the run restarts"
        lost = f" and step {at} is lost" if at == kept + 1 else f" and steps {kept + 1}-{at} are lost"
        if kept >= at:  # a checkpoint past this step already (resumed from an older one)
            lost = ""
        line = f"{name}: saving a checkpoint at the end of step {at}, then stopping; killed before, {where}{lost}"
        if signum == signal.SIGINT:
            line += f" (Ctrl-C again after {FORCE_AFTER_S:.0f} s to stop at once, without one)"
        return line

    def engine_gone(self, error: BaseException, global_step: int, wait_s: float = ENGINE_GONE_WAIT_S) -> str | None:
        """The one line for a run whose vLLM server went away while a stop was requested (a scheduler that signals
        the whole job, the server first), or None when no stop was requested (then ``error`` is a plain failure).

        The server is needed only at the start of a generation batch (weight sync, generation): stopped before this
        process's batch in progress ended, it leaves the step in progress unfinished, and no checkpoint is saved by
        this stop. The line names the checkpoint the run resumes from and what to change (the trainer signalled
        before the server: docs/recipes.md, "Preemption of the whole job"). A server that vanished an instant before
        this process's own signal arrived is the same event: the signal is awaited for up to ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        while self.requested_at is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a signal handler runs between these sleeps
        if self.requested_at is None:
            return None
        self.engine_lost = True
        name = _NAMES.get(int(self.signum or signal.SIGTERM), "SIGTERM")
        try:
            newest = newest_checkpoint(self._args.output_dir) if self._args is not None else None
        except OSError:
            newest = None
        kept = int(_CHECKPOINT.match(newest.name).group(1)) if newest is not None else 0  # type: ignore[union-attr]
        at = global_step + 1
        where = f"the run resumes from {newest}" if newest is not None else "with no checkpoint yet the run restarts"
        lost = f"step {at} is lost" if at == kept + 1 else f"steps {kept + 1}-{at} are lost"
        return (
            f"{name}: the vLLM server stopped before step {at} could finish (it was stopped too: "
            f"{type(error).__name__}), so no checkpoint was saved by this stop; {where} and {lost}. Stop the "
            'trainer before the server: docs/recipes.md, "Preemption of the whole job"'
        )

    def on_train_begin(self, args, state, control, **kwargs):
        self._is_main = state.is_world_process_zero
        self._args, self._state = args, state  # the Trainer keeps both objects to the end of train()
        self.requested_at, self.signum, self.checkpoint = None, None, None
        if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
            self._previous_handlers = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        if not _at_generation_boundary(args, state.global_step):
            return
        signum = self._stop_requested(args)
        if not signum:
            return
        if self.requested_at is None and self._is_main:  # the signal reached another process only
            name = _NAMES.get(signum, f"signal {signum}")
            print(
                f"\n{name} on another process: saving a checkpoint at the end of step {state.global_step}, then "
                "stopping",
                file=sys.stderr,
                flush=True,
            )
        self.signum = self.signum or signum
        control.should_save = True
        control.should_training_stop = True
        self.checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _stop_requested(self, args) -> int:
        """The stop signal any process got (0: none; SIGTERM over Ctrl-C): the same answer on every rank, all must
        save and stop together."""
        signum = int(self.signum or 0)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and args.world_size > 1:
            flag = torch.tensor([signum], device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
        return signum


def generation_period(args) -> int:
    """Optimizer steps from one generation batch to the next: TRL regenerates every ``steps_per_generation *
    num_iterations`` micro-batches, and an optimizer step takes ``gradient_accumulation_steps`` of them (1 for
    arguments without generation batches)."""
    micro = (getattr(args, "steps_per_generation", None) or 1) * (getattr(args, "num_iterations", None) or 1)
    accumulation = max(1, args.gradient_accumulation_steps)
    return micro // math.gcd(micro, accumulation)


def saves_inside_generation_batches(args) -> str | None:
    """The one-line warning for a ``save_steps`` that is not a multiple of :func:`generation_period` (a periodic
    checkpoint inside a generation batch: a resume from it regenerates that batch, so the resumed run is not the one
    that would have happened), or None. ``save_steps`` below 1 (a fraction of the run) is left alone."""
    save_steps = getattr(args, "save_steps", None)
    if (
        str(getattr(args, "save_strategy", "no")) not in ("steps", "SaveStrategy.STEPS")
        or save_steps is None
        or isinstance(save_steps, bool)
        or save_steps < 1
        or save_steps != int(save_steps)
    ):
        return None
    period = generation_period(args)
    if int(save_steps) % period == 0:
        return None
    lower, upper = int(save_steps) // period * period, -(-int(save_steps) // period) * period
    return (
        f"save_steps {int(save_steps)} is not a multiple of the generation period, {period} optimizer steps "
        f"(steps_per_generation x num_iterations over gradient_accumulation_steps): a checkpoint inside a "
        f"generation batch resumes by regenerating it, not as the run would have gone on; use "
        f"{f'{lower} or ' if lower else ''}{upper}"
    )


def _at_generation_boundary(args, global_step: int) -> bool:
    return global_step % generation_period(args) == 0


def _next_boundary(args, global_step: int) -> int:
    """The step at whose end a stop requested now saves: the step in progress (``global_step + 1``), rounded up to
    the end of its generation batch."""
    period = generation_period(args)
    return -(-(global_step + 1) // period) * period
