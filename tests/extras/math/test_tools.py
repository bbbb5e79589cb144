"""Tool-use GRPO with R3 on the offline recipe: the calculator tool, the cold start's tool demonstrations (exactly the
sequences TRL's tool loop builds), and `recipes/grpo_r3.py --config recipes/configs/tiny_tools_r3.yaml` end to end."""

import json
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers.utils import get_json_schema
from trl.chat_template_utils import parse_response

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.extras.math.cold_start import (
    _batch,
    demonstration,
    prompt_token_ids,
    run_tool_calls,
    tool_call_turn_ids,
    tool_demonstration,
)
from trl_moe_replay.extras.math.data import synthetic_math_dataset
from trl_moe_replay.extras.math.tools import MAX_EXPRESSION_CHARS, calculator, calculator_demonstration
from trl_moe_replay.testing import scripted_generation, tiny_moe_model, tiny_tokenizer

from tests.helpers import load_script


ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "grpo_r3.py"
TOOLS_CONFIG = ROOT / "recipes" / "configs" / "tiny_tools_r3.yaml"
#: the cold start's sampled tool-call rate that shows it taught the call format (basis at its use)
TOOL_CALLS_AT_LEAST = 3 / 128


@pytest.fixture(scope="module")
def recipe():
    module = load_script(RECIPE, "grpo_r3_tool_recipe")
    return module


# ----------------------------------------------------------------------------- the calculator
def test_calculator_is_exact_and_raises_on_what_it_cannot_evaluate():
    assert calculator("47+38") == "85"
    assert calculator(" (12-5)*3 ") == "21" and calculator("-4--6") == "2"
    assert calculator("84/4") == "21" and calculator("7/2") == "3.5" and calculator("1/3") == "0.333333"
    assert calculator("99999999999*99999999999") == str(99999999999**2)  # exact, no float rounding
    with pytest.raises(ZeroDivisionError):
        calculator("9/0")
    for bad in ["2**64", "abs(-1)", "x+1", "1.5+1", "__import__('os')", "", "1+", "True+1"]:
        with pytest.raises(ValueError):
            calculator(bad)
    with pytest.raises(ValueError, match="longer than"):
        calculator("1+" * MAX_EXPRESSION_CHARS + "1")
    with pytest.raises(TypeError):
        calculator(12)


def test_calculator_docstring_gives_trl_a_tool_schema():
    schema = get_json_schema(calculator)["function"]  # what TRL renders into the prompt
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "123+456" in schema["parameters"]["properties"]["expression"]["description"]


# ----------------------------------------------------------------------------- demonstrations
def test_tool_demonstration_is_parsed_by_trl_and_masks_the_tool_result():
    tokenizer = tiny_tokenizer(tools=True)
    row = {"expression": "47+38"}
    prompt = prompt_token_ids(tokenizer, [{"role": "user", "content": "47+38="}], [calculator])
    turn = tool_call_turn_ids(tokenizer, calculator_demonstration(row), [calculator])
    assert turn[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in turn[:-1]
    parsed = parse_response(tokenizer, turn, prefix=prompt, tools=[calculator])
    assert parsed["tool_calls"] == [{"type": "function", "function": calculator_demonstration(row)}]

    ids, mask = tool_demonstration(tokenizer, calculator_demonstration(row), [calculator])
    assert ids[: len(turn)] == turn and mask == [1] * len(turn) + [0] * (len(ids) - len(turn))
    result = tokenizer.decode(ids[len(turn) :])
    assert "<tool_response>\n85\n</tool_response>" in result and result.endswith("<|im_start|>assistant\n")

    prompt_ids, completion, loss_mask = demonstration(tokenizer, prompt, "\\boxed{85}", (ids, mask))
    labels = _batch([(prompt_ids, completion, loss_mask)], tokenizer.pad_token_id)["labels"][0]
    trained = labels[len(prompt) :] != -100
    assert trained.tolist() == [bool(m) for m in loss_mask]  # the SFT loss skips the prompt and the tool result
    assert tokenizer.decode(completion[len(ids) :]) == "\\boxed{85}<|im_end|>"


def test_failing_tool_calls_become_error_results_like_trls():
    messages, failures = run_tool_calls(
        [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "9/0"}}},
            {"type": "function", "function": {"name": "search", "arguments": {}}},
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}},
        ],
        [calculator],
    )
    assert failures == 2
    assert [m["content"] for m in messages] == [
        str({"error": "division by zero"}),
        str({"error": "Tool search not found."}),
        "6",
    ]


class CapturingTrainer(MoEReplayGRPOTrainer):
    """Keeps what TRL's generation (tool loop included) returns: prompt ids, completion ids and tool mask."""

    def _generate(self, prompts):
        out = super()._generate(prompts)
        self.generated = (prompts, out[0], out[1], out[2])
        return out


def test_cold_start_demonstrations_are_the_sequences_trls_tool_loop_builds(tmp_path):
    """A scripted policy writes the cold start's turns; TRL's loop must build exactly the demonstration's ids, with
    the demonstration's loss mask as its tool mask."""
    tokenizer = tiny_tokenizer(tools=True)
    data = synthetic_math_dataset(
        4, seed=3, conversational=True, max_operand=99, kinds=("arithmetic",), expressions=True
    )
    rows = {row["prompt"][-1]["content"]: row for row in data}
    calls_tool = {question: k % 2 == 0 for k, question in enumerate(rows)}  # two with the tool, two at once

    def script(text: str) -> str:
        question = re.search(r"user\n(.*?)<\|im_end\|>", text).group(1)
        row = rows[question]
        if calls_tool[question] and "<tool_response>" not in text:
            turn = tool_call_turn_ids(tokenizer, calculator_demonstration(row), [calculator])
            return tokenizer.decode(turn[:-1])  # the scripted generate adds the EOS
        return f"\\boxed{{{row['solution']}}}"

    args = MoEReplayGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        logging_steps=1,
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=96,
        save_strategy="no",
        seed=0,
        routing_replay="r3",
    )
    trainer = CapturingTrainer(
        model=tiny_moe_model("qwen3_moe"),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": data["prompt"]}),
        processing_class=tokenizer,
        tools=[calculator],
    )
    with scripted_generation(trainer.model, tokenizer, script):
        trainer.train()
    prompts, prompt_ids, completion_ids, tool_mask = trainer.generated
    assert len(prompts) == 8
    for prompt, got_prompt, got_completion, got_mask in zip(
        prompts, prompt_ids, completion_ids, tool_mask, strict=True
    ):
        row = rows[prompt[-1]["content"]]
        tool_part = None
        if calls_tool[prompt[-1]["content"]]:
            tool_part = tool_demonstration(tokenizer, calculator_demonstration(row), [calculator])
        want_prompt, want_completion, want_mask = demonstration(
            tokenizer, prompt_token_ids(tokenizer, prompt, [calculator]), f"\\boxed{{{row['solution']}}}", tool_part
        )
        assert list(got_prompt) == want_prompt
        assert list(got_completion) == want_completion
        assert list(got_mask) == (want_mask or [1] * len(want_completion))
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == 0.5 and log["tools/failure_frequency"] == 0.0
    assert log["routing/fallback_frac"] == 0.0


def test_cold_start_needs_a_demonstration_for_tool_calls():
    from trl_moe_replay.extras.math.cold_start import ColdStartConfig, cold_start_sft

    data = synthetic_math_dataset(4, seed=0, conversational=True, expressions=True)
    with pytest.raises(ValueError, match="needs `tool_call`"):
        cold_start_sft(
            tiny_moe_model("qwen3_moe"),
            tiny_tokenizer(tools=True),
            data,
            ColdStartConfig(steps=1, tool_call_fraction=0.5),
            tools=[calculator],
        )
    with pytest.raises(ValueError, match="conversational"):
        prompt_token_ids(tiny_tokenizer(tools=True), "3+4=", [calculator])


# ----------------------------------------------------------------------------- the recipe
def test_tools_config_fits_its_demonstrations(recipe):
    script_args, args, model_args = recipe.parse_args(["--config", str(TOOLS_CONFIG)])
    assert model_args.model_name_or_path is None and script_args.dataset_name is None  # offline
    assert script_args.tools == ["calculator"] and args.routing_replay == "r3" and not args.bf16
    assert recipe.tool_functions(script_args.tools) == [calculator]
    train, _ = recipe.load_datasets(script_args, args)
    assert isinstance(train[0]["prompt"], list) and "expression" in train.column_names
    # the longest demonstration (tool call, result, answer) fits the completion budget TRL enforces
    tokenizer = tiny_tokenizer(tools=True)
    longest = max(
        len(
            demonstration(
                tokenizer,
                [],
                f"\\boxed{{{row['solution']}}}",
                tool_demonstration(tokenizer, calculator_demonstration(row), [calculator]),
            )[1]
        )
        for row in train.select(range(200))
    )
    assert longest <= args.max_completion_length


def test_tool_flags_are_checked(recipe):
    assert recipe.tool_functions(["trl_moe_replay.extras.math.tools.calculator"]) == [calculator]
    with pytest.raises(ValueError, match="Unknown tool"):
        recipe.tool_functions(["search"])
    with pytest.raises(ValueError, match="conversational"):
        recipe.is_conversational(recipe.parse_args(["--tools", "calculator", "--conversational", "false"])[0])
    with pytest.raises(ValueError, match="--sft_tool_call_fraction 0"):
        recipe.demonstration_call(["my_lib.search"])


@pytest.mark.slow  # runs the tool recipe
@pytest.mark.ci
def test_tool_recipe_calls_the_tool_and_replays_every_turn(recipe, tmp_path, capsys):
    script_args, training_args, model_args = recipe.parse_args(
        [
            "--config",
            str(TOOLS_CONFIG),
            "--output_dir",
            str(tmp_path / "run"),
            "--sft_cache_dir",
            str(tmp_path / "c"),
            "--max_steps",
            "2",
            "--sft_steps",
            "60",
            "--sft_batch_size",
            "16",
            "--sft_learning_rate",
            "8e-3",
            "--sft_tool_call_fraction",
            "1.0",
            "--synthetic_samples",
            "256",
            "--per_device_train_batch_size",
            "16",
            "--plot",
            "false",
        ]
    )
    torch.manual_seed(0)
    recipe.main(script_args, training_args, model_args)
    out = capsys.readouterr().out
    assert "cold start: saved" in out and "of samples" in out and "tool calls per sample:" in out

    # the cold start taught the format: some of its sampled first turns parse into calculator calls, and most of
    # those calls run. Both rates depend on the CPU type (the 60 SFT steps differ; call rate 0.242 on an Intel Xeon).
    # Basis: an untrained policy never writes the call template (rate 0), so at least 3 of the 128 sampled turns must
    # call; false-failure rate 4e-6 if the true rate is >= 0.13 (exact binomial tail, P(X <= 2 | n=128, p=0.13)).
    (entry,) = (tmp_path / "c").iterdir()
    report = json.loads((entry / "cold_start.json").read_text())["report"]
    assert report["tool_call_rate"] >= TOOL_CALLS_AT_LEAST, report
    # of the calls made, most run: every demonstrated expression is a valid one, so a policy that learned the call
    # copies one (0.09 on the AMD EPYC; it passed on an Intel Xeon); a policy that emits the template with garbage
    # inside fails nearly every call
    assert report["tool_failure_rate"] < 0.5, report

    logged = [
        h for h in json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"] if "reward" in h
    ]
    assert len(logged) == 2
    for h in logged:
        assert h["tools/call_frequency"] > 0.0  # TRL ran the calculator inside GRPO's rollouts
        assert h["routing/fallback_frac"] == 0.0  # every position of every turn replayed an engine route
        assert h["routing/mismatch_frac"] == 0.0 and h["mismatch/kl_k3"] < 1e-6  # fp32: the sampler's own numbers
        assert 0.0 <= h["reward"] <= 1.0
