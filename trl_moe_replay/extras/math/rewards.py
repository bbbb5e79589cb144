r"""Math rewards for GRPO, built on math-verify and hardened against hostile completions.

Both functions have the signature of a TRL reward function and can be passed straight to ``GRPOTrainer``:

    GRPOTrainer(..., reward_funcs=[accuracy_reward, format_reward])

TRL calls them as ``f(prompts=..., completions=..., completion_ids=..., **dataset_columns, trainer_state=...,
log_extra=..., log_metric=...)``; ``completions`` is a ``list[str]`` for standard datasets and a
``list[list[{"role", "content"}]]`` for conversational ones. Both forms are accepted here.

**Answer extraction** (:func:`accuracy_reward`). If the completion contains ``\boxed{...}`` (or ``\fbox{...}``),
the content of the *last* one is the answer (braces balanced, ``\{``/``\}`` are literal braces), parsed as one LaTeX
expression. Otherwise math-verify's default extraction runs on the completion's last :data:`MAX_COMPLETION_CHARS`
characters ("the answer is 7", "$\frac{1}{2}$", a final number, ...). The gold ``solution`` may be a worked solution
with ``\boxed{}`` (its last box is the answer), a bare answer (``"12"``, ``"3\sqrt{2}"``, ``"[-2, 7]"``, MATH-500's
``answer`` column), read as one LaTeX expression as if boxed, or prose (``"... so 72 clips"``: at least two words
outside LaTeX commands, or ``$``/``\(``/``\[``/``####`` delimiters), which gets math-verify's default extraction.
Reading bare golds whole matters: math-verify's default extraction reads ``3\sqrt{2}`` as 3 and ``\frac{\pi}{2}`` as
nothing, which TRL's ``accuracy_reward`` inherits. Equality is math-verify's ``verify`` (numeric, symbolic, sets,
intervals, ...): ``\boxed{0.5}`` matches ``\frac{1}{2}``.

**None.** A gold answer that cannot be parsed gives ``None`` (as TRL's own ``accuracy_reward``). TRL 1.16
(``GRPOTrainer._calculate_rewards``) turns ``None`` into NaN; the per-group mean/std and the logged reward use
nan-aware reductions, so the completion is ignored by this reward function, and a completion for which *every* reward
function returned None is "unscorable": excluded from its group's baseline and given advantage 0 (TRL also logs a
warning for it). A completion that cannot be parsed, times out or is not text scores ``0.0``, never None: it is the
policy's fault and must be penalised.

**Bounded time.** Hostile completions (megabytes of text, ``{`` * 100000, unbalanced braces, NUL/control characters,
exponent towers such as ``\boxed{9^{9^{9^{9}}}}`` that make sympy compute forever, non-str entries) never crash or
hang training:

- Only bounded pieces reach math-verify: the boxed answer (at most :data:`MAX_ANSWER_CHARS` characters, brackets
  nested at most :data:`MAX_NESTING_DEPTH` deep, else 0.0) or the completion's tail of :data:`MAX_COMPLETION_CHARS`
  characters. Parsing cost grows faster than linearly with length and nesting depth, so this caps the work before any
  timeout is needed. Control characters (NUL included) become spaces.
- math-verify's timeouts (:data:`PARSING_TIMEOUT_S` per parse, :data:`VERIFY_TIMEOUT_S` per comparison) rely on
  ``signal.alarm``, which works only in the main thread. In the main thread (where TRL calls reward functions) the
  work runs in-process with those timeouts. In any other thread, instead of dropping the timeouts (TRL's choice,
  under which ``\boxed{9^{9^{9^{9}}}}`` never returns), the work is sent to one helper Python process that runs
  math-verify in *its* main thread with the same timeouts; the parent also waits at most a hard deadline and kills
  and restarts the helper when it is exceeded. A timeout scores 0.0 and is reported through TRL's ``log_metric`` as
  ``accuracy_reward/timeout_frac``.

**Format rule** (:func:`format_reward`): 1.0 iff the completion contains the text ``\boxed`` exactly once, that
``\boxed`` is immediately followed by ``{``, the braces opened there balance within :data:`MAX_ANSWER_CHARS`
characters (``\{`` and ``\}`` do not count) and the content is not blank. Otherwise 0.0.

This module imports nothing from the package (only the standard library and math-verify) so that the helper process
can load it by file path without importing torch or trl.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import numbers
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from math_verify import parse, verify
from math_verify.errors import TimeoutException


# Nothing of the package is imported here: the helper process (_WORKER_BOOT) loads this file alone, by its path,
# with no package around it (a relative import there fails, the helper never starts, and the reward runs unbounded).
logger = logging.getLogger(__name__)

#: Only the last this-many characters of a completion (or gold solution) are searched by math-verify's default
#: extraction when there is no ``\boxed{}``. The final answer sits at the end; math-verify's extraction is
#: super-linear in the length of some inputs (``"1 " * 8000`` takes 0.25 s, ``* 16000`` takes 1 s).
MAX_COMPLETION_CHARS = 4096
#: A ``\boxed{}`` whose content is longer than this is not an answer (0.0) and is not well-formed for
#: :func:`format_reward`. Real answers (MATH, GSM8K, DAPO) are far shorter.
MAX_ANSWER_CHARS = 512
#: A boxed answer whose ``( [ {`` brackets nest deeper than this scores 0.0 without parsing (math-verify needs seconds
#: for ``((((...))))`` 16 deep). Real answers nest a handful of levels.
MAX_NESTING_DEPTH = 12
#: math-verify's per-parse timeout, seconds (integer: ``signal.alarm``). math-verify's own default.
PARSING_TIMEOUT_S = 5
#: math-verify's per-comparison timeout, seconds (integer: ``signal.alarm``). math-verify's own default.
VERIFY_TIMEOUT_S = 5
#: Extra seconds the parent grants the helper process beyond the sum of math-verify's own timeouts for one completion
#: before it kills the helper (the helper only needs this when a computation ignores ``SIGALRM``).
WORKER_SLACK_S = 5.0
#: Seconds to wait for the helper process to import math-verify and sympy and report ready.
WORKER_START_TIMEOUT_S = 60.0

_BOXED, _FBOX = "\\boxed", "\\fbox"
# C0 controls (but tab, newline, carriage return), DEL and C1 controls become spaces.
_CONTROL_TO_SPACE = dict.fromkeys([*range(0, 9), 11, 12, *range(14, 32), *range(127, 160)], " ")
_OPEN, _CLOSE = "([{", ")]}"
_LATEX_COMMAND = re.compile(r"\\(?:begin|end)\{[^{}]*\}|\\[A-Za-z]+(?:\{[A-Za-z ]*\})?")
_WORD = re.compile(r"[A-Za-z]{2,}")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[|####")  # unescaped $, \(, \[, GSM8K's ####

# Statuses of one scored completion.
_OK, _NO_GOLD, _TIMEOUT = "ok", "no_gold", "timeout"


# ----------------------------------------------------------------------------- text helpers
def completion_text(completion: Any) -> str:
    """The text of one completion as TRL passes it; ``""`` for anything that is not text.

    Accepts a ``str``; ``bytes`` (decoded as UTF-8 with replacement); a conversational completion (a list of
    messages: the content of the last ``assistant`` message, else of the last message); a single message dict; message
    content given as a list of parts (the ``"text"`` of each part, joined); an int or float (its ``str``).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (bytes, bytearray)):
        return bytes(completion).decode("utf-8", errors="replace")
    if isinstance(completion, numbers.Real) and not isinstance(completion, bool):
        return str(completion)
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        if not messages:
            return ""
        assistant = [m for m in messages if m.get("role") == "assistant"]
        return _content_text((assistant or messages)[-1].get("content"))
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _clean(text: str) -> str:
    return text.translate(_CONTROL_TO_SPACE)


def _braced_group(text: str, open_index: int, max_chars: int) -> str | None:
    """Content of the ``{...}`` group that opens at ``text[open_index]``; None if there is no ``{`` there or it does
    not close within ``max_chars`` characters. ``\\{`` and ``\\}`` are escaped braces and do not count."""
    if open_index >= len(text) or text[open_index] != "{":
        return None
    depth, i, end = 0, open_index, min(len(text), open_index + max_chars + 2)
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
        i += 1
    return None


def last_boxed_content(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    r"""Content of the last ``\boxed{...}`` of ``text`` (``"12"`` for ``"... \boxed{12}."``), or None when the last
    ``\boxed`` is not followed by a balanced ``{...}`` of at most ``max_chars`` characters. Also reads ``\fbox{...}``
    when there is no ``\boxed`` (some MATH solutions use it)."""
    for command in (_BOXED, _FBOX):
        start = text.rfind(command)
        if start != -1:
            return _braced_group(text, start + len(command), max_chars)
    return None


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        if c in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif c in _CLOSE and depth:
            depth -= 1
    return deepest


def _boxed_source(text: str) -> str | None:
    r"""``\boxed{<content of the last box>}``, or None when that box is malformed, too long or nested too deep."""
    content = last_boxed_content(text)
    if content is None or not content.strip() or _nesting_depth(content) > MAX_NESTING_DEPTH:
        return None
    return _BOXED + "{" + _clean(content) + "}"


def _is_bare_answer(text: str) -> bool:
    r"""Whether a gold text is one bare answer (``"3\sqrt{2}"``, ``"[-2, 7]"``, ``"\text{east}"``) rather than prose
    or a solution: short, not nested too deep, no math delimiters, and at most one word once LaTeX commands
    (``\frac``, ``\text{Monday}``, ``\begin{pmatrix}``) are removed."""
    text = text.strip()
    if not text or len(text) > MAX_ANSWER_CHARS or _MATH_DELIMITER.search(text):
        return False
    return _nesting_depth(text) <= MAX_NESTING_DEPTH and len(_WORD.findall(_LATEX_COMMAND.sub(" ", text))) < 2


def _completion_source(text: str) -> str | None:
    """Text handed to math-verify for a completion: the last box if there is one, else the tail."""
    if _BOXED in text or _FBOX in text:
        return _boxed_source(text)
    return _clean(text[-MAX_COMPLETION_CHARS:])


def _gold_sources(text: str) -> list[str]:
    r"""Texts handed to math-verify for a gold solution, tried in order until one parses. A bare answer is read as one
    LaTeX expression (math-verify's default extraction reads ``3\sqrt{2}`` as 3 and ``\frac{\pi}{2}`` as nothing)."""
    if _BOXED in text or _FBOX in text:
        source = _boxed_source(text)
        return [source] if source else []
    sources = [_BOXED + "{" + _clean(text.strip()) + "}"] if _is_bare_answer(text) else []
    return sources + [_clean(text[-MAX_COMPLETION_CHARS:])]


# ----------------------------------------------------------------------------- scoring (in-process or in the helper)
@functools.lru_cache(maxsize=4096)
def _parse_gold(source: str, parsing_timeout: int) -> tuple:  # gold repeats num_generations times in GRPO
    return tuple(parse(source, parsing_timeout=parsing_timeout, raise_on_error=True))


def _raise_if_signal_error(error: Exception) -> None:
    """math-verify raises this ValueError when ``signal.alarm`` is unusable (not the main thread of the main
    interpreter); the caller then moves the work to the helper process."""
    if isinstance(error, ValueError) and "threaded environment" in str(error):
        raise error


def _score(completion: str, gold: str, parsing_timeout: int, verify_timeout: int) -> tuple[float | None, str, str]:
    """(reward, status, extracted answer) for one completion text and one gold text. Raises only math-verify's
    "signals unusable here" ValueError."""
    gold_parsed: tuple = ()
    for gold_source in _gold_sources(gold):
        if not gold_source.strip():
            continue
        try:
            gold_parsed = _parse_gold(gold_source, parsing_timeout)
        except TimeoutException:
            return None, _NO_GOLD, ""
        except Exception as e:
            _raise_if_signal_error(e)
        if gold_parsed:
            break
    if not gold_parsed:
        return None, _NO_GOLD, ""

    source = _completion_source(completion)
    if source is None or not source.strip():
        return 0.0, _OK, ""
    try:
        answer = parse(source, parsing_timeout=parsing_timeout, raise_on_error=True)
    except TimeoutException:
        return 0.0, _TIMEOUT, ""
    except Exception as e:
        _raise_if_signal_error(e)
        return 0.0, _OK, ""
    if not answer:
        return 0.0, _OK, ""
    shown = str(answer[-1])[:MAX_ANSWER_CHARS]  # math-verify returns [sympy object, extracted string]

    # verify(gold, answer) is any() over the (gold, answer) pairs; done pair by pair so a timeout can be told apart.
    timed_out = False
    for g in gold_parsed:
        for a in answer:
            try:
                if verify(g, a, timeout_seconds=verify_timeout, raise_on_error=True):
                    return 1.0, _OK, shown
            except TimeoutException:
                timed_out = True
            except Exception as e:
                _raise_if_signal_error(e)
    return 0.0, (_TIMEOUT if timed_out else _OK), shown


# ----------------------------------------------------------------------------- helper process (non-main threads)
_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_trl_moe_replay_reward_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main()\n"
)


def _worker_main() -> None:
    """Helper process loop: one JSON request a line on stdin, one JSON reply a line on stdout, until EOF."""
    logging.disable(logging.CRITICAL)  # timeouts and failures travel in the replies
    out, sys.stdout = sys.stdout, sys.stderr  # keep stray prints off the reply channel
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        reward, status, shown = _score(request["c"], request["g"], request["pt"], request["vt"])
        out.write(json.dumps({"r": reward, "s": status, "a": shown}) + "\n")
        out.flush()


class _WorkerUnavailable(RuntimeError):  # private, caught in this module; not a TrlMoeReplayError (see the imports)
    pass


class _Worker:
    """One helper process shared by all non-main threads (a lock serialises requests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue | None = None
        self.broken = False

    def _start(self) -> None:
        if not sys.executable:
            raise _WorkerUnavailable("sys.executable is empty")
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
        replies: queue.Queue = queue.Queue()
        stdout = proc.stdout
        assert stdout is not None  # stdout=PIPE

        def pump() -> None:
            for line in stdout:
                replies.put(line)
            stdout.close()
            replies.put(None)  # EOF: the process ended

        threading.Thread(target=pump, name="accuracy-reward-worker-reader", daemon=True).start()
        self._proc, self._replies = proc, replies
        try:
            ready = replies.get(timeout=WORKER_START_TIMEOUT_S)
        except queue.Empty:
            ready = None
        if not ready or not json.loads(ready).get("ready"):
            self.close()
            raise _WorkerUnavailable("the helper process did not start")

    def close(self) -> None:
        proc, self._proc, self._replies = self._proc, None, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.close()
        except OSError:  # broken pipe: it is gone anyway
            pass

    def score(
        self, completion: str, gold: str, parsing_timeout: int, verify_timeout: int, deadline_s: float
    ) -> tuple[float | None, str, str]:
        request = json.dumps({"c": completion, "g": gold, "pt": parsing_timeout, "vt": verify_timeout}) + "\n"
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.close()
                self._start()
            proc, replies = self._proc, self._replies
            assert proc is not None and proc.stdin is not None and replies is not None  # _start set them (stdin=PIPE)
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                reply = replies.get(timeout=deadline_s)
            except (OSError, queue.Empty):
                reply = None
            if reply is None:  # past the hard deadline, or the helper died (e.g. out of memory): restart next time
                self.close()
                return 0.0, _TIMEOUT, ""
            reply = json.loads(reply)
            return reply["r"], reply["s"], reply["a"]


_WORKER = _Worker()
atexit.register(_WORKER.close)


def _reset_worker_after_fork() -> None:  # a forked child must not share the parent's pipes
    global _WORKER
    _WORKER = _Worker()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_worker_after_fork)


def _score_safely(completion: str, gold: str) -> tuple[float | None, str, str]:
    pt, vt = int(PARSING_TIMEOUT_S), int(VERIFY_TIMEOUT_S)
    if threading.current_thread() is threading.main_thread():
        try:
            return _score(completion, gold, pt, vt)
        except ValueError:  # signals unusable after all (e.g. a sub-interpreter): use the helper process
            pass
    if not _WORKER.broken:
        # Worst case inside the helper: three parses (two gold sources, one answer) plus four comparisons (gold and
        # answer each parse to at most two candidates), each bounded by math-verify's own timeout.
        deadline = 3 * pt + 4 * vt + WORKER_SLACK_S
        try:
            return _WORKER.score(completion, gold, pt, vt, deadline)
        except (_WorkerUnavailable, OSError) as e:
            _WORKER.broken = True
            logger.warning(
                "accuracy_reward: could not start its helper process (%s); off the main thread it now runs "
                "math-verify without timeouts, like TRL's accuracy_reward.",
                e,
            )
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence its "Timeout is disabled" warnings
    return _score(completion, gold, 0, 0)


# ----------------------------------------------------------------------------- reward functions
def accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    r"""1.0 if the completion's final answer equals the gold ``solution`` (math-verify), 0.0 if not, None if the
    gold cannot be parsed. See the module docstring for extraction, timeouts and None semantics.

    Args:
        completions: ``list[str]`` or conversational ``list[list[{"role", "content"}]]``; anything else scores 0.0.
        solution: gold answers, one per completion: ``"12"``, ``"\frac{1}{2}"``, or a worked solution with
            ``\boxed{}``; ints and floats are accepted; None or empty gives None.
        **kwargs: TRL's other arguments. ``log_extra`` (if given) receives the column ``extracted_answer``;
            ``log_metric`` receives ``accuracy_reward/timeout_frac`` and ``accuracy_reward/gold_unparsed_frac``.

    Example:
    ```python
    >>> accuracy_reward([r"so \boxed{\frac{1}{2}}", "the answer is 0.5", "7"], ["0.5", r"\frac{1}{2}", "8"])
    [1.0, 1.0, 0.0]
    ```
    """
    if len(completions) != len(solution):
        raise ValueError(f"accuracy_reward got {len(completions)} completions but {len(solution)} solutions.")
    rewards, answers, timeouts, unparsed = [], [], 0, 0
    for completion, gold in zip(completions, solution, strict=True):
        reward, status, shown = _score_safely(completion_text(completion), completion_text(gold))
        rewards.append(reward)
        answers.append(shown or "[none]")
        timeouts += status == _TIMEOUT
        unparsed += status == _NO_GOLD

    log_extra: Callable | None = kwargs.get("log_extra")
    log_metric: Callable | None = kwargs.get("log_metric")
    if callable(log_extra):
        log_extra("extracted_answer", answers)
    if callable(log_metric) and rewards:
        log_metric("accuracy_reward/timeout_frac", timeouts / len(rewards))
        log_metric("accuracy_reward/gold_unparsed_frac", unparsed / len(rewards))
    return rewards


def format_reward(completions: list, **kwargs) -> list[float]:
    r"""1.0 if the completion holds exactly one well-formed ``\boxed{...}`` answer, else 0.0.

    Exact rule: the completion text contains the substring ``\boxed`` exactly once; it is immediately followed by
    ``{``; the braces opened there close within :data:`MAX_ANSWER_CHARS` characters (``\{`` and ``\}`` are literal
    braces and do not count); and the content is not blank. Text around the box is free. Non-text entries score 0.0.
    Time is linear in the length of the completion (a C-level substring count plus a bounded scan).

    Example:
    ```python
    >>> format_reward([r"so \boxed{7}", r"\boxed{7} or \boxed{8}", r"\boxed{7", r"\boxed{\{1,2\}}", "7"])
    [1.0, 0.0, 0.0, 1.0, 0.0]
    ```
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        ok = False
        if text.count(_BOXED) == 1:
            content = _braced_group(text, text.find(_BOXED) + len(_BOXED), MAX_ANSWER_CHARS)
            ok = content is not None and bool(content.strip())
        rewards.append(1.0 if ok else 0.0)
    return rewards
