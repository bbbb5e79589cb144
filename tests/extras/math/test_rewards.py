"""Math rewards: correctness on plain/boxed/conversational answers, the format rule, TRL's calling convention, and
bounded time on hostile completions in the main thread (signal timeouts) and off it (helper process)."""

import math
import threading
import time

import pytest

from trl_moe_replay.extras.math import rewards
from trl_moe_replay.extras.math.rewards import accuracy_reward, format_reward


# Bounds against runaway work (catastrophic backtracking, sympy blow-ups), not benchmarks. In-process work is bounded
# in CPU seconds of this process (time.process_time), which other jobs on the machine do not inflate; work in the
# helper process is bounded by the parent's deadline, which the status "timeout" shows, and threads by HANG_GUARD_S.
BOUND_S = 60.0
HANG_GUARD_S = 600.0  # far beyond any run under load; only a hang reaches it


@pytest.fixture(autouse=True)
def generous_timeouts(monkeypatch):
    """Correctness must not depend on the machine's speed: 30 s math-verify timeouts (production: 5 s), far above what
    a correct answer needs even on a loaded machine. Tests about timing out ask for ``short_timeouts``."""
    monkeypatch.setattr(rewards, "PARSING_TIMEOUT_S", 30)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 30)
    monkeypatch.setattr(rewards, "WORKER_SLACK_S", 30.0)


@pytest.fixture
def short_timeouts(monkeypatch):
    """1 s math-verify timeouts, for the tests whose subject is timing out: only inputs that can never finish in time
    (the power tower) are asserted to time out, and no correct answer is expected under these timeouts."""
    monkeypatch.setattr(rewards, "PARSING_TIMEOUT_S", 1)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 1)
    monkeypatch.setattr(rewards, "WORKER_SLACK_S", 3.0)


@pytest.fixture
def slow_machine(monkeypatch):
    """Every math-verify parse and comparison takes 1.5 s longer, inside its timed section: a machine under load."""
    import math_verify.grader
    import math_verify.parser

    def slowed(fn):
        def wrapper(*args, **kwargs):
            time.sleep(1.5)
            return fn(*args, **kwargs)

        return wrapper

    parse_inner = math_verify.parser.extract_target_from_pred
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", slowed(parse_inner))
    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", slowed(math_verify.grader.sympy_expr_eq))
    rewards._parse_gold.cache_clear()  # a cached gold answer would skip the slowed parser
    yield
    rewards._parse_gold.cache_clear()


def in_thread(fn, *args, **kwargs):
    """Run fn in a non-main thread; return its result or raise its exception."""
    box = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=HANG_GUARD_S)
    assert not thread.is_alive(), "reward function hung in a non-main thread"
    if "error" in box:
        raise box["error"]
    return box["result"]


def chat(text):
    return [{"role": "assistant", "content": text}]


# ----------------------------------------------------------------------------- accuracy: correct / wrong / None
CORRECT = [
    ("7", "7"),  # bare number, no box: math-verify's default extraction
    (r"3+4=7 so the answer is \boxed{7}.", "7"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),  # decimal equals LaTeX fraction
    (r"so $x = \boxed{\dfrac{1}{2}}$", "0.5"),
    (r"\boxed{2/4}", r"\frac{1}{2}"),
    ("the answer is 12", "12"),
    ("we get 3+4=7. total 12", "12"),  # final number
    (r"\boxed{-5}", "-5"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{\{1,2\}}", r"\{1, 2\}"),  # escaped braces inside the box
    (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)"),  # MATH-500 style gold
    (r"first \boxed{3}, no wait: \boxed{12}", "12"),  # the last box counts
    (r"\boxed{12}", r"Adding gives $5+7=12$, so the answer is $\boxed{12}$."),  # worked gold solution
    (r"\boxed{12}", 12),  # int gold
    (r"\fbox{12}", "12"),
    # bare LaTeX golds (MATH-500's `answer`) are read as one expression
    (r"\boxed{\frac{\pi}{2}}", r"\frac{\pi}{2}"),
    (r"\boxed{3\sqrt{2}}", r"3\sqrt{2}"),
    (r"\boxed{[-2, 7]}", "[-2, 7]"),
    (r"\boxed{(-\infty, 3) \cup (5, \infty)}", r"(-\infty,3)\cup(5,\infty)"),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    (r"\boxed{12}", r"\$12"),
    (r"\boxed{12}", "Natalia sold 48+24 = 72 clips, so 12"),  # prose gold: its final number
]


@pytest.mark.parametrize("completion,gold", CORRECT)
def test_correct_answers_score_one(completion, gold):
    assert accuracy_reward([completion], [gold]) == [1.0]
    assert accuracy_reward([chat(completion)], [gold]) == [1.0]  # conversational form


WRONG = [
    ("8", "7"),
    (r"\boxed{13}", "12"),
    (r"\boxed{12}, no wait: \boxed{3}", "12"),  # the last box counts
    (r"\boxed{0.51}", r"\frac{1}{2}"),
    ("", "12"),
    ("i do not know", "12"),
    (r"\boxed{}", "12"),
    (r"\boxed{12", "13"),  # malformed box: falls back to the final number, 12
    (r"\boxed{3}", r"3\sqrt{2}"),  # math-verify's default extraction would read this gold as 3
    (r"\boxed{7}", "[-2, 7]"),
]


@pytest.mark.parametrize("completion,gold", WRONG)
def test_wrong_answers_score_zero(completion, gold):
    assert accuracy_reward([completion], [gold]) == [0.0]
    assert accuracy_reward([chat(completion)], [gold]) == [0.0]


@pytest.mark.parametrize("gold", ["", None, "no numbers here", r"\boxed{12", r"\boxed{}"])
def test_unparseable_gold_gives_none(gold):
    assert accuracy_reward([r"\boxed{12}", "12"], [gold, gold]) == [None, None]


def test_conversational_forms():
    tool_turns = [
        {"role": "assistant", "content": "let me compute"},
        {"role": "tool", "content": "99"},
        {"role": "assistant", "content": r"so \boxed{12}"},
    ]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{12}"}]}]
    out = accuracy_reward([tool_turns, parts, [], [{"role": "assistant"}], {"content": "12"}], ["12"] * 5)
    assert out == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_trl_calling_convention_and_logging():
    """TRL passes prompts, completion_ids, every dataset column and its hooks as keyword arguments."""
    extra, metrics = {}, {}
    out = accuracy_reward(
        prompts=["3+4=", "1+1="],
        completions=[r"\boxed{7}", "3"],
        completion_ids=[[1, 2], [3]],
        solution=["7", "2"],
        level=[1, 1],
        trainer_state=None,
        log_extra=lambda column, values: extra.__setitem__(column, values),
        log_metric=lambda name, value: metrics.__setitem__(name, value),
    )
    assert out == [1.0, 0.0]
    assert extra["extracted_answer"] == ["7", "3"]
    assert metrics == {"accuracy_reward/timeout_frac": 0.0, "accuracy_reward/gold_unparsed_frac": 0.0}
    assert format_reward(prompts=["x"], completions=[r"\boxed{7}"], completion_ids=[[1]], solution=["7"]) == [1.0]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        accuracy_reward(["1", "2"], ["1"])


# ----------------------------------------------------------------------------- format rule
@pytest.mark.parametrize(
    "completion,expected",
    [
        (r"so \boxed{7}", 1.0),
        (r"\boxed{\frac{1}{2}} is it", 1.0),
        (r"\boxed{\{1,2\}}", 1.0),  # escaped braces do not count
        (r"\boxed{7} or \boxed{8}", 0.0),  # two boxes
        (r"\boxed{\boxed{7}}", 0.0),
        (r"\boxed{7", 0.0),  # unbalanced
        (r"\boxed{{7}", 0.0),
        (r"\boxed {7}", 0.0),  # "{" must follow immediately
        (r"\boxed{ }", 0.0),  # blank
        ("7", 0.0),
        (r"\boxed{" + "1" * (rewards.MAX_ANSWER_CHARS + 1) + "}", 0.0),  # too long
        (r"\boxed{" + "1" * rewards.MAX_ANSWER_CHARS + "}", 1.0),
    ],
)
def test_format_rule(completion, expected):
    assert format_reward([completion]) == [expected]
    assert format_reward([chat(completion)]) == [expected]


def test_format_reward_non_text():
    assert format_reward([None, 7, object(), [], [{"role": "assistant", "content": None}]]) == [0.0] * 5


# ----------------------------------------------------------------------------- hostile completions
HOSTILE = {
    "10MB_digits": "1" * 10_000_000,
    "10MB_latex_soup": "a b $ \\frac{ " * 800_000,
    "10MB_then_answer": "x" * 10_000_000 + r" \boxed{12}",
    "open_braces": "{" * 100_000,
    "close_braces": "}" * 100_000 + "{",
    "boxed_open_100k": "\\boxed{" * 100_000,
    "deep_parens_in_box": "\\boxed{" + "(" * 5000 + "12" + ")" * 5000 + "}",
    "deep_parens_12": "\\boxed{" + "(" * 16 + "12" + ")" * 16 + "}",
    "unbalanced_box": r"\boxed{\frac{1}{2}" + "}" * 3 + "{" * 7,
    "power_tower": r"\boxed{9^{9^{9^{9}}}}",  # sympy would compute forever: needs the timeout
    "control_chars": "".join(map(chr, range(32))) + "\x7f\x85 \\boxed{12}\x00",
    "nul_bytes": "\x00" * 1000 + "12" + "\x00" * 1000,
    "lone_surrogate": "\ud800\\boxed{12}\udfff",
    "none": None,
    "int": 12,
    "float_nan": float("nan"),
    "object": object(),
    "bytes": b"\\boxed{12}\xff",
    "message_without_content": [{"role": "assistant"}],
    "message_content_none": [{"role": "assistant", "content": None}],
    "message_content_int": [{"role": "assistant", "content": 12}],
    "list_of_junk": [1, None, "x"],
}


def assert_reward_type(value, allow_none=False):
    assert (value is None and allow_none) or (isinstance(value, float) and math.isfinite(value))


NEVER_IN_TIME = "power_tower"  # sympy would compute forever: it times out whatever the timeout and the machine
SURVIVES_NOISE = ("10MB_then_answer", "control_chars", "lone_surrogate", "bytes", "nul_bytes")
STOPPED_BEFORE_PARSING = ("deep_parens_in_box", "open_braces", "10MB_digits")  # size and depth limits


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_completion_is_bounded_main_thread(name, short_timeouts):
    completion, metrics = HOSTILE[name], {}
    start = time.process_time()
    acc = accuracy_reward([completion], ["12"], log_metric=lambda k, v: metrics.__setitem__(k, v))
    fmt = format_reward([completion])
    cpu = time.process_time() - start
    assert cpu < BOUND_S, f"{name} took {cpu:.1f} s of CPU"
    assert len(acc) == len(fmt) == 1
    assert_reward_type(acc[0])
    assert_reward_type(fmt[0])
    if name in (NEVER_IN_TIME, *STOPPED_BEFORE_PARSING):
        assert acc == [0.0]
        assert metrics["accuracy_reward/timeout_frac"] == (1.0 if name == NEVER_IN_TIME else 0.0)


@pytest.mark.parametrize("name", [n for n in HOSTILE if n != NEVER_IN_TIME])
def test_hostile_completion_answers_and_no_timeouts_with_room_to_finish(name):
    metrics = {}
    acc = accuracy_reward([HOSTILE[name]], ["12"], log_metric=lambda k, v: metrics.__setitem__(k, v))
    if name in SURVIVES_NOISE:
        assert acc == [1.0]  # the answer survives the noise
    assert_reward_type(acc[0])
    # only the tower needs math-verify's timeout; the size and depth limits stop the rest before parsing
    assert metrics["accuracy_reward/timeout_frac"] == 0.0


def test_hostile_gold_is_bounded(short_timeouts):
    golds = [HOSTILE[k] for k in ("10MB_digits", "10MB_latex_soup", "open_braces", "boxed_open_100k", "object")]
    start = time.process_time()
    out = accuracy_reward(["12"] * len(golds), golds)
    assert time.process_time() - start < BOUND_S
    for value in out:
        assert_reward_type(value, allow_none=True)


def test_off_main_thread_is_bounded(short_timeouts):
    """Off the main thread math-verify's signal timeouts cannot work: the helper process must bound the time."""
    names = list(HOSTILE)
    completions = [HOSTILE[n] for n in names]
    hostile = in_thread(accuracy_reward, completions, ["12"] * len(completions))  # returns: bounded
    for name, value in zip(names, hostile, strict=True):
        assert_reward_type(value), name
    assert dict(zip(names, hostile, strict=True))[NEVER_IN_TIME] == 0.0


def test_off_main_thread_is_correct():
    completions, golds = zip(*CORRECT, *WRONG, strict=True)
    expected = [1.0] * len(CORRECT) + [0.0] * len(WRONG)
    assert in_thread(accuracy_reward, list(completions), list(golds)) == expected
    assert in_thread(accuracy_reward, [r"\boxed{12}"], [None]) == [None]
    assert in_thread(accuracy_reward, [HOSTILE["10MB_then_answer"]], ["12"]) == [1.0]


def test_correct_answers_do_not_depend_on_the_machines_speed(slow_machine, monkeypatch):
    """Under 1.5 s of extra latency per parse and comparison, correct answers still score 1.0 with the timeouts the
    correctness tests use; with the 1 s timeouts they once used, the same answers time out (the old flake)."""
    metrics = {}
    log = dict(log_metric=lambda k, v: metrics.__setitem__(k, v))
    assert accuracy_reward([r"\boxed{\frac{1}{2}}"], ["0.5"], **log) == [1.0]
    assert metrics["accuracy_reward/timeout_frac"] == 0.0
    monkeypatch.setattr(rewards, "PARSING_TIMEOUT_S", 1)
    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 1)
    assert accuracy_reward([r"\boxed{\frac{1}{3}}"], ["1/3"], **log) in ([0.0], [None])


def test_helper_process_hard_deadline():
    """A computation that escapes math-verify's timeout (here: timeouts disabled in the helper) is killed at the
    parent's deadline, scored 0.0, and the helper restarts for the next request."""
    # private on purpose: the helper process's deadline, with math-verify's own timeouts disabled in it
    reward, status, _ = rewards._WORKER.score(HOSTILE["power_tower"], "12", 1, 0, deadline_s=1.0)
    assert (reward, status) == (0.0, "timeout")  # the tower never ends: only the parent's deadline returns it
    assert in_thread(accuracy_reward, [r"\boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]
