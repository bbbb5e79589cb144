"""Math datasets: the synthetic generator's answers are right (checked by an independent evaluator), it is
deterministic and in the tiny tokenizer's alphabet; each Hub mapping extracts the right answer from rows shaped like
the Hub's, and the loader wires name, config and split (no Hub access: ``load_dataset`` is replaced)."""

import ast
import operator
import re
from fractions import Fraction

import pytest
from datasets import Dataset

from trl_moe_replay.extras.math import data
from trl_moe_replay.extras.math.data import (
    BOXED_INSTRUCTION,
    HUB_DATASETS,
    load_math_dataset,
    map_boxed_solution,
    map_dapo,
    map_gsm8k,
    map_math500,
    map_math_dataset,
    synthetic_math_dataset,
)
from trl_moe_replay.extras.math.rewards import accuracy_reward


ALPHABET = re.compile(r"^[a-z0-9 +\-*/=().,?:]*$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression, by Python's own parser and rational arithmetic."""

    def walk(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return Fraction(node.value)

    return walk(ast.parse(expression, mode="eval").body)


def solve_word_problem(text: str) -> Fraction:
    n = [Fraction(int(x)) for x in re.findall(r"\d+", text)]
    if "lost" in text:
        return n[0] * n[1] - n[2]
    if "bags of" in text:
        return n[0] * n[1]
    if "split among" in text:
        return n[0] / n[1]
    if "loses" in text:
        return n[0] - n[1]
    if "more" in text:
        return n[0] + n[1]
    raise AssertionError(f"unknown word problem: {text}")


def solve(question: str) -> Fraction:
    return evaluate(question[:-1]) if question.endswith("=") else solve_word_problem(question)


# ----------------------------------------------------------------------------- synthetic
@pytest.mark.parametrize("difficulty", sorted(data.LEVELS))
def test_synthetic_answers_are_correct(difficulty):
    ds = synthetic_math_dataset(300, seed=difficulty, difficulty=difficulty)
    assert ds.column_names == ["prompt", "solution"]
    for prompt, solution in zip(ds["prompt"], ds["solution"], strict=True):
        assert isinstance(prompt, str) and isinstance(solution, str)
        assert ALPHABET.match(prompt), prompt
        assert len(prompt) <= 42, prompt
        value = solve(prompt)
        assert value.denominator == 1, prompt  # exact integer answer, divisions included
        assert solution == str(value.numerator), prompt
        if data.LEVELS[difficulty].nonnegative:
            assert value >= 0


@pytest.mark.parametrize("difficulty", sorted(data.LEVELS))
def test_synthetic_expressions_compute_the_answers_and_change_nothing_else(difficulty):
    plain = synthetic_math_dataset(200, seed=difficulty, difficulty=difficulty)
    with_expressions = synthetic_math_dataset(200, seed=difficulty, difficulty=difficulty, expressions=True)
    assert with_expressions.column_names == ["prompt", "solution", "expression"]
    assert with_expressions["prompt"] == plain["prompt"] and with_expressions["solution"] == plain["solution"]
    columns = (with_expressions[c] for c in ("prompt", "solution", "expression"))
    for prompt, solution, expression in zip(*columns, strict=True):
        assert evaluate(expression) == int(solution), (prompt, expression)
        if prompt.endswith("="):
            assert expression == prompt[:-1]
        else:  # a word problem: the expression uses the numbers of the text
            assert sorted(re.findall(r"\d+", expression)) == sorted(re.findall(r"\d+", prompt)), (prompt, expression)


def test_difficulty_zero_is_single_digit_addition():
    ds = synthetic_math_dataset(200, seed=3, difficulty=0, kinds=("arithmetic",))
    assert all(re.fullmatch(r"\d\+\d=", p) for p in ds["prompt"])
    assert {int(s) for s in ds["solution"]} <= set(range(19))
    small = synthetic_math_dataset(200, seed=3, difficulty=0, max_operand=2, kinds=("arithmetic",))
    assert {int(s) for s in small["solution"]} <= set(range(5))


def test_harder_levels_use_their_operators():
    prompts = synthetic_math_dataset(300, seed=0, difficulty=3, kinds=("arithmetic",))["prompt"]
    text = "".join(prompts)
    assert all(op in text for op in "+-*/()")
    words = synthetic_math_dataset(300, seed=0, difficulty=3, kinds=("word",))["prompt"]
    for template_word in ("more", "loses", "bags of", "split among", "lost"):
        assert any(template_word in w for w in words), template_word


def test_synthetic_is_deterministic_and_seeded():
    a = synthetic_math_dataset(50, seed=7, difficulty=2)
    b = synthetic_math_dataset(50, seed=7, difficulty=2)
    c = synthetic_math_dataset(50, seed=8, difficulty=2)
    assert a.to_dict() == b.to_dict()
    assert a["prompt"] != c["prompt"]


def test_synthetic_conversational_and_instruction():
    ds = synthetic_math_dataset(
        5, seed=1, conversational=True, instruction=BOXED_INSTRUCTION, system_prompt="be brief"
    )
    for prompt, plain in zip(ds["prompt"], synthetic_math_dataset(5, seed=1)["prompt"], strict=True):
        assert prompt == [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"{plain} put the answer in \\boxed{{}}."},
        ]
    only_user = synthetic_math_dataset(2, conversational=True)["prompt"]
    assert [[m["role"] for m in p] for p in only_user] == [["user"], ["user"]]
    with pytest.raises(ValueError, match="conversational=True"):
        synthetic_math_dataset(2, system_prompt="x")


@pytest.mark.parametrize(
    "kwargs", [dict(difficulty=9), dict(max_operand=0), dict(kinds=("poems",)), dict(kinds=()), dict(num_samples=-1)]
)
def test_synthetic_rejects_bad_arguments(kwargs):
    kwargs = {"num_samples": 3, **kwargs}
    with pytest.raises(ValueError):
        synthetic_math_dataset(**kwargs)


def test_synthetic_solutions_are_rewarded():
    ds = synthetic_math_dataset(40, seed=2, difficulty=3)
    solutions = ds["solution"]
    assert accuracy_reward(solutions, solutions) == [1.0] * 40
    assert accuracy_reward([f"so \\boxed{{{s}}}" for s in solutions], solutions) == [1.0] * 40
    assert accuracy_reward([str(int(s) + 1) for s in solutions], solutions) == [0.0] * 40


# ----------------------------------------------------------------------------- Hub mappings (rows as on the Hub)
GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her "
    "friends in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
    "in April and May.\n#### 72",
}
MATH500_ROW = {
    "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in the "
    "form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
    "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... Therefore, the polar coordinates are "
    "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
    "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
    "subject": "Precalculus",
    "level": 2,
    "unique_id": "test/precalculus/807.json",
}
MATH_ROW = {  # EleutherAI/hendrycks_math and DigitalLearningGmbH/MATH-lighteval
    "problem": "What is the value of $\\sqrt{36 \\times \\sqrt{16}}$?",
    "level": "Level 1",
    "type": "Prealgebra",
    "solution": "Calculating from the inside out, $$\\sqrt{36 \\times \\sqrt{16}} = \\sqrt{36 \\times 4} = "
    "\\sqrt{144} = \\boxed{12}.$$",
}
MATH_NESTED_ROW = {
    "problem": "Simplify $\\frac{1}{2}+\\frac{1}{4}$.",
    "level": "Level 2",
    "type": "Algebra",
    "solution": "We have $\\frac{1}{2} = \\frac{2}{4}$ (so $\\boxed{x}$ is not it), and the sum is "
    "$\\boxed{\\frac{3}{4}}$.",
}
DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [
        {
            "content": "Solve the following math problem step by step. The last line of your response should be "
            "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            "In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$ and $\\angle A < 90^\\circ$. Find $AB$.\n\n"
            'Remember to put your answer on its own line after "Answer:".',
            "role": "user",
        }
    ],
    "ability": "MATH",
    "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}
NUMINA_TIR_ROW = {
    "problem": "What is the coefficient of $x^2y^6$ in the expansion of "
    "$\\left(\\frac{3}{5}x-\\frac{y}{2}\\right)^8$?",
    "solution": "To determine the coefficient ...\n```python\nimport sympy as sp\nx, y = sp.symbols('x y')\n"
    "expr = {'a': 1}\nprint(coeff)\n```\n```output\n63/400\n```\nThe coefficient is "
    "\\(\\boxed{\\frac{63}{400}}\\).",
    "messages": [{"content": "...", "role": "user"}, {"content": "...", "role": "assistant"}],
}


def test_map_gsm8k():
    assert map_gsm8k(GSM8K_ROW) == {"problem": GSM8K_ROW["question"], "solution": "72"}
    assert map_gsm8k({"question": "q", "answer": "so\n#### 1,234"})["solution"] == "1234"


def test_map_math500():
    assert map_math500(MATH500_ROW) == {"problem": MATH500_ROW["problem"], "solution": MATH500_ROW["answer"]}


def test_map_boxed_solution():
    assert map_boxed_solution(MATH_ROW) == {"problem": MATH_ROW["problem"], "solution": "12"}
    assert map_boxed_solution(MATH_NESTED_ROW)["solution"] == "\\frac{3}{4}"  # the last box, nested braces
    assert map_boxed_solution(NUMINA_TIR_ROW)["solution"] == "\\frac{63}{400}"  # braces in code do not confuse it
    assert map_boxed_solution({"problem": "p", "solution": "so it is $\\fbox{5}$"})["solution"] == "5"
    unboxed = {"problem": "p", "solution": "the answer is 5"}
    assert map_boxed_solution(unboxed)["solution"] == "the answer is 5"


def test_map_dapo():
    row = map_dapo(DAPO_ROW)
    assert row["solution"] == "34"
    assert row["problem"].startswith("In triangle $ABC$") and row["problem"].endswith("Find $AB$.")
    bare = {**DAPO_ROW, "prompt": [{"role": "user", "content": "What is 2+2?"}], "reward_model": {"ground_truth": 4}}
    assert map_dapo(bare) == {"problem": "What is 2+2?", "solution": "4"}


ROWS = {
    "openai/gsm8k": (GSM8K_ROW, "72"),
    "HuggingFaceH4/MATH-500": (MATH500_ROW, MATH500_ROW["answer"]),
    "EleutherAI/hendrycks_math": (MATH_ROW, "12"),
    "DigitalLearningGmbH/MATH-lighteval": (MATH_ROW, "12"),
    "BytedTsinghua-SIA/DAPO-Math-17k": (DAPO_ROW, "34"),
    "AI-MO/NuminaMath-TIR": (NUMINA_TIR_ROW, "\\frac{63}{400}"),
    "AI-MO/NuminaMath-CoT": ({**MATH_ROW, "source": "amc_aime", "messages": []}, "12"),
}


def test_every_registered_dataset_has_a_test_row():
    assert set(ROWS) == set(HUB_DATASETS)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_map_math_dataset(name):
    row, answer = ROWS[name]
    ds = Dataset.from_list([row, row])
    conv = map_math_dataset(ds, name, system_prompt="sys", instruction="Box it.")
    assert conv.column_names == ["prompt", "solution"]
    prompt = conv[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user"] and prompt[0]["content"] == "sys"
    assert prompt[1]["content"].endswith(" Box it.")
    assert conv["solution"] == [answer, answer]
    std = map_math_dataset(ds, name, conversational=False)
    assert isinstance(std[0]["prompt"], str) and std["solution"] == [answer, answer]
    # the gold answers work with the reward
    assert accuracy_reward([f"\\boxed{{{answer}}}", "\\boxed{-1}"], [answer, answer]) == [1.0, 0.0]


def test_map_math_dataset_keep_columns():
    ds = Dataset.from_list([MATH500_ROW])
    out = map_math_dataset(ds, "HuggingFaceH4/MATH-500", keep_columns=("level", "subject"))
    assert sorted(out.column_names) == ["level", "prompt", "solution", "subject"]


# ----------------------------------------------------------------------------- loader wiring (no Hub)
@pytest.fixture
def fake_hub(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, *, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        row, _ = ROWS[path]
        return Dataset.from_list([row])

    monkeypatch.setattr(data, "load_dataset", fake_load_dataset)
    return calls


def test_load_math_dataset_wiring(fake_hub):
    ds = load_math_dataset("openai/gsm8k", conversational=False, revision="main")
    assert fake_hub == [("openai/gsm8k", "main", "train", {"revision": "main"})]
    assert ds.to_dict() == {"prompt": [GSM8K_ROW["question"]], "solution": ["72"]}

    fake_hub.clear()
    load_math_dataset("HuggingFaceH4/MATH-500")
    assert fake_hub[0][:3] == ("HuggingFaceH4/MATH-500", None, "test")  # its only split

    fake_hub.clear()
    ds = load_math_dataset("EleutherAI/hendrycks_math", "test")
    assert [c[1] for c in fake_hub] == list(data._MATH_SUBJECTS) and {c[2] for c in fake_hub} == {"test"}
    assert len(ds) == 7  # one row per subject config, concatenated

    fake_hub.clear()
    load_math_dataset("EleutherAI/hendrycks_math", config="algebra")
    assert [c[1] for c in fake_hub] == ["algebra"]


def test_unknown_dataset_lists_supported_names():
    with pytest.raises(ValueError) as error:
        load_math_dataset("nobody/nothing")
    assert "nobody/nothing" in str(error.value)
    assert all(name in str(error.value) for name in HUB_DATASETS)
