r"""Math datasets in TRL's GRPO format: a ``prompt`` column and a ``solution`` column (the gold answer, read by
:func:`trl_moe_replay.extras.math.rewards.accuracy_reward`).

Two sources:

- :func:`synthetic_math_dataset`: an offline generator of arithmetic (``"12+7*3="``) and short word problems
  (``"tom has 3 pens, gets 4 more. how many?"``) with exact integer answers. ASCII only: lowercase letters, digits,
  spaces and ``+-*/=()., ?:`` (plus ``\boxed{}`` if that instruction is asked for), so the offline character-level
  tokenizer of :mod:`trl_moe_replay.testing` encodes it; prompts are short (at most ~40 characters) and the easiest
  level (single-digit addition) is meant for a tiny model trained on CPU.
- :func:`load_math_dataset`: Hub math datasets mapped to the same columns. The mapping of each dataset is a pure
  function of one row (``map_gsm8k``, ``map_math500``, ...) kept apart from ``datasets.load_dataset``, so it is tested
  offline on rows shaped like the Hub's; :data:`HUB_DATASETS` lists them with the schema each one assumes.

Prompts are standard (``prompt`` is a ``str``) or conversational (``prompt`` is ``[{"role": "user", "content": ...}]``,
after an optional system message). The question text is used as is; ``instruction`` (e.g. :data:`BOXED_INSTRUCTION`)
is appended to it after a space, and ``system_prompt`` (conversational only) becomes the system message. Both default
to None: the prompt is just the question.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from datasets import Dataset, concatenate_datasets, load_dataset

from .rewards import last_boxed_content


#: Short answer-format instruction for the synthetic set (lowercase, in the tiny tokenizer's alphabet).
BOXED_INSTRUCTION = "put the answer in \\boxed{}."
#: The usual instruction for Hub math datasets (Qwen2.5-Math / DeepSeek-R1 style).
REASONING_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


# ----------------------------------------------------------------------------- prompt format
def make_prompt(
    question: str, *, conversational: bool, system_prompt: str | None = None, instruction: str | None = None
) -> str | list[dict[str, str]]:
    """The ``prompt`` value for one question: the question (plus ``" " + instruction``), as a string or as a user
    message after an optional system message."""
    text = f"{question} {instruction}" if instruction else question
    if not conversational:
        if system_prompt is not None:
            raise ValueError("`system_prompt` needs conversational=True: a standard prompt is a single string.")
        return text
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return messages + [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------- synthetic problems
@dataclass(frozen=True)
class _Level:
    num_ops: tuple[int, int]  # operators in an arithmetic expression, inclusive range
    ops: str  # arithmetic operators
    word_ops: tuple[str, ...]  # word-problem templates (keys of _WORD_TEMPLATES)
    max_operand: int
    nonnegative: bool  # every intermediate and final value >= 0


#: Difficulty levels of :func:`synthetic_math_dataset`. Level 0 (single-digit addition, ``"3+4="``, answers 0-18) is
#: the one meant for a tiny model trained on CPU.
LEVELS: dict[int, _Level] = {
    0: _Level((1, 1), "+", ("add",), 9, True),
    1: _Level((1, 1), "+-", ("add", "sub"), 20, True),
    2: _Level((1, 2), "+-*", ("add", "sub", "mul", "div"), 20, False),
    3: _Level((2, 3), "+-*/", ("add", "sub", "mul", "div", "mul_sub"), 30, False),
}
_NAMES = ("tom", "amy", "bob", "sam", "ann", "max", "eva", "joe", "kim", "leo")
_ITEMS = ("pens", "cups", "eggs", "cards", "coins", "books", "balls", "rocks")
_WORD_TEMPLATES = {
    "add": "{name} has {a} {item}, gets {b} more. how many?",  # a + b
    "sub": "{name} has {a} {item}, loses {b}. how many now?",  # a - b, a >= b
    "mul": "{a} bags of {b} {item}. how many {item}?",  # a * b
    "div": "{a} {item} split among {b}. how many each?",  # a / b, exact
    "mul_sub": "{a} bags of {b} {item}, {c} lost. how many?",  # a * b - c, >= 0
}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def _expression(rng: random.Random, num_ops: int, level: _Level, max_operand: int) -> tuple[str, int, int]:
    """A random expression tree printed with minimal parentheses: (text, exact integer value, precedence)."""
    if num_ops == 0:
        value = rng.randint(0, max_operand)
        return str(value), value, _ATOM
    op = rng.choice(level.ops)
    if op == "/":  # divide by a plain number that divides the left value exactly
        left_text, left, left_prec = _expression(rng, num_ops - 1, level, max_operand)
        divisor = rng.choice([d for d in range(2, max_operand + 1) if left % d == 0] or [1])  # 1 only if forced
        right_text, right, right_prec = str(divisor), divisor, _ATOM
    else:
        n_left = rng.randint(0, num_ops - 1)
        left_text, left, left_prec = _expression(rng, n_left, level, max_operand)
        right_text, right, right_prec = _expression(rng, num_ops - 1 - n_left, level, max_operand)
        if op == "-" and level.nonnegative and left < right:
            (left_text, left, left_prec), (right_text, right, right_prec) = (
                (right_text, right, right_prec),
                (left_text, left, left_prec),
            )
    prec = _PRECEDENCE[op]
    if left_prec < prec:
        left_text = f"({left_text})"
    if right_prec < prec or (right_prec == prec and op in "-/"):
        right_text = f"({right_text})"
    if op == "+":
        value = left + right
    elif op == "-":
        value = left - right
    elif op == "*":
        value = left * right
    else:
        value = left // right  # exact: right divides left
    return f"{left_text}{op}{right_text}", value, prec


def _word_problem(rng: random.Random, kind: str, max_operand: int) -> tuple[str, int, str]:
    """(question, answer, the arithmetic expression that computes the answer)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    c = 0
    if kind == "add":
        answer, expression = a + b, f"{a}+{b}"
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        answer, expression = a - b, f"{a}-{b}"
    elif kind == "mul":
        answer, expression = a * b, f"{a}*{b}"
    elif kind == "div":
        b = rng.randint(min(2, max_operand), max_operand)
        answer = a
        a = a * b  # "a*b items split among b" -> a each
        expression = f"{a}/{b}"
    else:  # mul_sub
        c = rng.randint(0, a * b)
        answer, expression = a * b - c, f"{a}*{b}-{c}"
    text = _WORD_TEMPLATES[kind].format(name=name, item=item, a=a, b=b, c=c)
    return text, answer, expression


def synthetic_math_question(
    rng: random.Random, *, difficulty: int = 0, kind: str = "arithmetic", max_operand: int | None = None
) -> tuple[str, int]:
    """One (question, integer answer) pair; ``kind`` is ``"arithmetic"`` or ``"word"``."""
    question, answer, _ = synthetic_math_problem(rng, difficulty=difficulty, kind=kind, max_operand=max_operand)
    return question, answer


def synthetic_math_problem(
    rng: random.Random, *, difficulty: int = 0, kind: str = "arithmetic", max_operand: int | None = None
) -> tuple[str, int, str]:
    """One (question, integer answer, expression) triple: the expression is the arithmetic that computes the answer
    (``"12+7*3"`` for ``"12+7*3="``, ``"3+4"`` for ``"tom has 3 pens, gets 4 more. how many?"``), what a calculator
    tool would be asked. Draws from ``rng`` exactly as :func:`synthetic_math_question`."""
    level = LEVELS[difficulty]
    bound = level.max_operand if max_operand is None else max_operand
    if kind == "arithmetic":
        text, value, _ = _expression(rng, rng.randint(*level.num_ops), level, bound)
        return f"{text}=", value, text
    return _word_problem(rng, rng.choice(level.word_ops), bound)


def synthetic_math_dataset(
    num_samples: int,
    *,
    seed: int = 0,
    conversational: bool = False,
    difficulty: int = 0,
    max_operand: int | None = None,
    kinds: Sequence[str] = ("arithmetic", "word"),
    instruction: str | None = None,
    system_prompt: str | None = None,
    expressions: bool = False,
) -> Dataset:
    r"""An offline math dataset with columns ``prompt`` and ``solution`` (the exact integer answer as a string), and
    ``expression`` if asked.

    Deterministic given ``seed`` (its own ``random.Random``; global random state untouched). Each sample is an
    arithmetic expression ending in ``=`` (``"12+7*3="``; usual precedence, minimal parentheses, divisions exact) or a
    word problem (``"tom has 3 pens, gets 4 more. how many?"``), the kind drawn uniformly from ``kinds``.

    Args:
        num_samples: number of rows.
        seed: random seed.
        conversational: ``prompt`` as ``[{"role": "user", "content": ...}]`` (after the system message, if any)
            instead of a string.
        difficulty: a key of :data:`LEVELS`. 0: one ``+`` on operands 0-9 (``"3+4="``), word problems "gets b more".
            1: one ``+``/``-`` on 0-20, answers >= 0. 2: one or two of ``+ - *`` on 0-20 (answers may be negative);
            word problems also multiply and divide. 3: two or three of ``+ - * /`` on 0-30, two-step word problems.
        max_operand: largest operand, overriding the level's (e.g. ``difficulty=0, max_operand=4``: answers 0-8).
        kinds: any of ``"arithmetic"``, ``"word"``.
        instruction: appended to the question after a space, e.g. :data:`BOXED_INSTRUCTION`
            (``"put the answer in \boxed{}."``). None: the prompt is the bare question.
        system_prompt: system message (conversational only).
        expressions: add a column ``expression``: the arithmetic that computes the answer (``"123+456"``), e.g.
            for demonstrations of a calculator tool. The other columns do not change.
    """
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}.")
    if max_operand is not None and max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}.")
    unknown = set(kinds) - {"arithmetic", "word"}
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty subset of ('arithmetic', 'word'), got {tuple(kinds)!r}.")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}.")
    rng = random.Random(seed)
    prompts, solutions, expression_column = [], [], []
    for _ in range(num_samples):
        question, answer, expression = synthetic_math_problem(
            rng, difficulty=difficulty, kind=rng.choice(tuple(kinds)), max_operand=max_operand
        )
        prompts.append(
            make_prompt(question, conversational=conversational, system_prompt=system_prompt, instruction=instruction)
        )
        solutions.append(str(answer))
        expression_column.append(expression)
    columns = {"prompt": prompts, "solution": solutions}
    if expressions:
        columns["expression"] = expression_column
    return Dataset.from_dict(columns)


# ----------------------------------------------------------------------------- Hub datasets: one mapping per dataset
# Each mapping takes one row as the Hub serves it and returns {"problem": str, "solution": str}.


def map_gsm8k(example: dict[str, Any]) -> dict[str, str]:
    """openai/gsm8k: ``question``; ``answer`` is a worked solution ending in ``#### 72`` -> ``"72"``
    (thousands separators removed; the whole answer text if there is no ``####``)."""
    answer = example["answer"]
    final = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return {"problem": example["question"], "solution": final.strip().replace(",", "")}


def map_math500(example: dict[str, Any]) -> dict[str, str]:
    """HuggingFaceH4/MATH-500: ``problem``, ``answer`` (the final answer in LaTeX; ``solution`` is the worked one)."""
    return {"problem": example["problem"], "solution": example["answer"]}


def map_boxed_solution(example: dict[str, Any]) -> dict[str, str]:
    r"""Rows with ``problem`` and a worked ``solution`` whose final answer is boxed (MATH, NuminaMath): the content
    of the last ``\boxed{}`` (or ``\fbox{}``); the whole solution if it has none (accuracy_reward then extracts its
    final expression)."""
    solution = example["solution"]
    boxed = last_boxed_content(solution)
    return {"problem": example["problem"], "solution": boxed.strip() if boxed else solution}


_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = "\n\nRemember to put your answer on its own line after"


def map_dapo(example: dict[str, Any]) -> dict[str, str]:
    """BytedTsinghua-SIA/DAPO-Math-17k: ``prompt`` is ``[{"role": "user", "content": ...}]``, the answer is
    ``reward_model["ground_truth"]``. The user content wraps the problem in DAPO's format instruction ("Solve the
    following math problem step by step. The last line of your response should be of the form Answer: $Answer
    ...\\n\\n<problem>\\n\\nRemember to put your answer on its own line after "Answer:"."); the wrapper is removed
    so that ``instruction``/``system_prompt`` choose the answer format (contents without it are kept whole)."""
    messages = example["prompt"]
    content = next((m["content"] for m in messages if m.get("role") == "user"), messages[-1]["content"])
    if content.startswith(_DAPO_HEAD) and "\n\n" in content:
        content = content.split("\n\n", 1)[1]
    if _DAPO_TAIL in content:
        content = content.rsplit(_DAPO_TAIL, 1)[0]
    return {"problem": content.strip(), "solution": str(example["reward_model"]["ground_truth"]).strip()}


@dataclass(frozen=True)
class HubMathDataset:
    """How to load one Hub dataset: ``configs`` are loaded and concatenated (``(None,)``: the default config)."""

    path: str
    mapping: Callable[[dict[str, Any]], dict[str, str]]
    configs: tuple[str | None, ...] = (None,)
    default_split: str = "train"
    splits: tuple[str, ...] = ("train", "test")
    schema: str = ""


_MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)

#: Supported Hub datasets and the row schema each mapping assumes.
HUB_DATASETS: dict[str, HubMathDataset] = {
    "openai/gsm8k": HubMathDataset(
        "openai/gsm8k", map_gsm8k, configs=("main",), schema="question: str, answer: str ('... #### 72')"
    ),
    "HuggingFaceH4/MATH-500": HubMathDataset(
        "HuggingFaceH4/MATH-500",
        map_math500,
        default_split="test",
        splits=("test",),
        schema="problem, solution, answer, subject, level, unique_id (test split only)",
    ),
    "EleutherAI/hendrycks_math": HubMathDataset(
        "EleutherAI/hendrycks_math",
        map_boxed_solution,
        configs=_MATH_SUBJECTS,
        schema="one config per subject; problem, level, type, solution (boxed)",
    ),
    "DigitalLearningGmbH/MATH-lighteval": HubMathDataset(
        "DigitalLearningGmbH/MATH-lighteval",
        map_boxed_solution,
        schema="problem, level, solution (boxed), type",
    ),
    "BytedTsinghua-SIA/DAPO-Math-17k": HubMathDataset(
        "BytedTsinghua-SIA/DAPO-Math-17k",
        map_dapo,
        splits=("train",),
        schema="data_source, prompt: [{content, role}], ability, reward_model: {ground_truth, style}, extra_info "
        "(train only; each problem repeated many times: ~1.79M rows for ~17.9k problems)",
    ),
    "AI-MO/NuminaMath-TIR": HubMathDataset(
        "AI-MO/NuminaMath-TIR", map_boxed_solution, schema="problem, solution (tool-integrated, boxed), messages"
    ),
    "AI-MO/NuminaMath-CoT": HubMathDataset(
        "AI-MO/NuminaMath-CoT", map_boxed_solution, schema="source, problem, solution (boxed), messages"
    ),
}


def hub_dataset_spec(name: str) -> HubMathDataset:
    """The registry entry of ``name``; a ValueError listing the supported names if there is none."""
    try:
        return HUB_DATASETS[name]
    except KeyError:
        supported = ", ".join(sorted(HUB_DATASETS))
        raise ValueError(f"Unsupported math dataset {name!r}. Supported: {supported}.") from None


def map_math_dataset(
    dataset: Dataset,
    name: str,
    *,
    conversational: bool = True,
    system_prompt: str | None = None,
    instruction: str | None = None,
    keep_columns: Sequence[str] = (),
    num_proc: int | None = None,
) -> Dataset:
    """Map an already loaded ``dataset`` (rows shaped like Hub dataset ``name``) to ``prompt``/``solution``.

    The other columns are dropped except ``keep_columns`` (all columns reach TRL reward functions as kwargs).
    """
    mapping = hub_dataset_spec(name).mapping

    def to_grpo(example: dict[str, Any]) -> dict[str, Any]:
        row = mapping(example)
        prompt = make_prompt(
            row["problem"], conversational=conversational, system_prompt=system_prompt, instruction=instruction
        )
        return {"prompt": prompt, "solution": row["solution"]}

    make_prompt("", conversational=conversational, system_prompt=system_prompt)  # fail fast on bad arguments
    columns = dataset.column_names or []
    kept = [c for c in keep_columns if c in columns and c not in ("prompt", "solution")]
    mapped = dataset.map(to_grpo, remove_columns=[c for c in columns if c not in kept], num_proc=num_proc)
    return mapped.select_columns(["prompt", "solution", *kept])


def load_math_dataset(
    name: str,
    split: str | None = None,
    *,
    conversational: bool = True,
    system_prompt: str | None = None,
    instruction: str | None = None,
    config: str | None = None,
    keep_columns: Sequence[str] = (),
    num_proc: int | None = None,
    **load_kwargs: Any,
) -> Dataset:
    """Load Hub math dataset ``name`` (a key of :data:`HUB_DATASETS`) with ``prompt`` and ``solution`` columns.

    Args:
        name: Hub id, e.g. ``"openai/gsm8k"``.
        split: split to load; None: the dataset's training split (``"train"``; ``"test"`` for MATH-500, which has
            no other). Slicing syntax (``"train[:100]"``) works.
        conversational: ``prompt`` as a list of messages (default) or a string.
        system_prompt: system message (conversational only).
        instruction: appended to the problem after a space, e.g. :data:`REASONING_INSTRUCTION`.
        config: one dataset config instead of the registry's (e.g. ``"socratic"`` for GSM8K, ``"algebra"`` for
            hendrycks_math, whose default is all seven subjects concatenated).
        keep_columns: original columns to keep.
        num_proc: processes for ``Dataset.map``.
        **load_kwargs: passed to ``datasets.load_dataset`` (``revision``, ``cache_dir``, ...).
    """
    spec = hub_dataset_spec(name)
    split = spec.default_split if split is None else split
    configs = spec.configs if config is None else (config,)
    parts = [load_dataset(spec.path, c, split=split, **load_kwargs) for c in configs]
    dataset = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    return map_math_dataset(
        dataset,
        name,
        conversational=conversational,
        system_prompt=system_prompt,
        instruction=instruction,
        keep_columns=keep_columns,
        num_proc=num_proc,
    )
