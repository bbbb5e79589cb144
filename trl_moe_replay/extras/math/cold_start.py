r"""A short cold-start SFT of a small model on ``prompt``/``solution`` rows, cached on disk by its settings.

RL recipes for reasoning models (DeepSeek-R1, the R3 and GSPO papers' Qwen3 runs) start from a model that already
answers in the expected format and is right some of the time; RL then raises the accuracy. The offline recipe's tiny
random MoE knows nothing, so this module gives it that start: teacher-forced SFT on ``prompt -> \boxed{solution}``
with the prompt tokens masked out of the loss, tokenized exactly as TRL's GRPO trainer tokenizes prompts.

``label_noise`` replaces that fraction of the demonstrations' integer answers by a near miss (answer +- 1): the
demonstrations are imperfect, so the SFT policy learns the format and a spread of plausible answers and is right
only part of the time (about ``1 - label_noise`` of its samples), which is the situation RL improves on.

**Tool use.** With ``tools`` (the callables TRL's ``GRPOTrainer(tools=...)`` gets) prompts are rendered with them, and
``tool_call_fraction`` of the demonstrations first call a tool (``tool_call(row)`` says which, with what arguments),
then answer: ``tool-call turn, tool result, \boxed{answer}``. The sequence is the one TRL's tool loop builds at train
time (``GRPOTrainer._tool_call_loop``, TRL 1.16): prompt ids, the tool-call turn as the chat template renders it
through its end-of-turn token, the tool result suffix made as ``GRPOTrainer._get_tool_suffix_ids`` makes it
(:func:`tool_suffix_ids`), the answer turn; the loss covers the two assistant turns, not the tool result (TRL's
``tool_mask``). The other demonstrations answer at once, so the SFT policy sometimes skips the tool: RL can then
learn to call it where that pays.

Plain PyTorch on purpose: a few hundred tiny steps, no Trainer start-up cost. The result is saved (model, tokenizer,
``cold_start.json`` with the settings and the measured accuracy) under a folder named by a hash of every setting and
of everything else that changes the result (:func:`cold_start_environment`: the torch thread count, the CPU, the
torch, transformers and math-verify versions), so a second run with the same settings on the same machine loads it
instead of training again, and a run on another CPU or thread count trains its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from .rewards import accuracy_reward


COLD_START_FILE = "cold_start.json"


@dataclass(frozen=True)
class ColdStartConfig:
    steps: int = 400
    learning_rate: float = 3e-3
    batch_size: int = 64
    label_noise: float = 0.0
    seed: int = 0
    answer_template: str = "\\boxed{{{}}}"  # str.format'ed with the solution
    eval_samples: int = 128
    tool_call_fraction: float = 0.0  # with tools: fraction of demonstrations that call a tool before answering

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or self.learning_rate <= 0:
            raise ValueError(f"invalid cold-start settings: {self}")
        if not 0.0 <= self.label_noise <= 1.0:
            raise ValueError(f"label_noise must be in [0, 1], got {self.label_noise}")
        if not 0.0 <= self.tool_call_fraction <= 1.0:
            raise ValueError(f"tool_call_fraction must be in [0, 1], got {self.tool_call_fraction}")
        if "{}" not in self.answer_template.replace("{{", "").replace("}}", ""):
            raise ValueError(f"answer_template needs one '{{}}' for the solution, got {self.answer_template!r}")


def prompt_token_ids(tokenizer, prompt, tools: Sequence[Callable] | None = None) -> list[int]:
    """A prompt's ids as TRL's GRPO trainer makes them: chat template (with the tools' schemas, if any) + generation
    prompt for conversational prompts, plain tokenization for strings."""
    if isinstance(prompt, str):
        if tools:
            raise ValueError(
                "tools need conversational prompts ([{'role': 'user', 'content': ...}]): TRL renders "
                "the tools with the chat template"
            )
        return tokenizer(text=prompt)["input_ids"]
    return tokenizer.apply_chat_template(
        prompt,
        tools=list(tools) if tools else None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]


# ----------------------------------------------------------------------------- tool turns, rendered as TRL does
_DUMMY_USER = [{"role": "user", "content": "dummy"}]


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    )


def tool_call_turn_ids(tokenizer, tool_call: dict[str, Any], tools: Sequence[Callable] | None = None) -> list[int]:
    """The ids of an assistant turn that makes ``tool_call`` (``{"name": ..., "arguments": {...}}``), as the chat
    template renders it, through its end-of-turn token (the EOS): what the model generates so that TRL's response
    parser reads the call (``<tool_call>\\n{json}\\n</tool_call><|im_end|>`` for Qwen3-style templates)."""
    message = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": tool_call}]}
    tools = list(tools) if tools else None
    head = _chat_ids(tokenizer, _DUMMY_USER, add_generation_prompt=True, tools=tools)
    full = _chat_ids(tokenizer, _DUMMY_USER + [message], add_generation_prompt=False, tools=tools)
    if full[: len(head)] != head:
        raise ValueError(
            "the chat template renders an assistant turn that does not extend the generation prompt; "
            "TRL's tool loop needs a prefix-preserving template"
        )
    turn = full[len(head) :]
    ends = [i for i, token in enumerate(turn) if token == tokenizer.eos_token_id]
    if not ends:
        raise ValueError(f"the chat template ends an assistant turn without the EOS token {tokenizer.eos_token!r}")
    return turn[: ends[-1] + 1]


def tool_suffix_ids(tokenizer, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The ids TRL appends after a tool-call turn (through its EOS) before generating again: the tool results and
    the next assistant header. Made exactly as TRL 1.16's ``GRPOTrainer._get_tool_suffix_ids`` makes them for a
    text model with the tokenizer's own (prefix-preserving) template: a dummy conversation whose assistant calls
    the first result's tool, rendered with and without the results (no tools in the system prompt), the shorter
    one cut after its last EOS. ``tests/extras/math/test_tools.py`` checks it against TRL's loop."""
    dummy = _DUMMY_USER + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}],
        }
    ]
    prefix = _chat_ids(tokenizer, dummy, add_generation_prompt=False)
    full = _chat_ids(tokenizer, dummy + list(tool_messages), add_generation_prompt=True)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving around tool results")
    return full[len(prefix) :]


def run_tool_calls(tool_calls: list[dict[str, Any]], tools: Sequence[Callable]) -> tuple[list[dict], int]:
    """Run parsed tool calls (``[{"type": "function", "function": {"name", "arguments"}}]``) as TRL's tool loop
    does: ``str(result)``, or ``{"error": message}`` when the tool raises or is unknown. Returns the tool messages
    and the number of failed calls."""
    by_name = {tool.__name__: tool for tool in tools}
    messages, failures = [], 0
    for call in tool_calls:
        function = call.get("function", {})
        name = function.get("name", "unknown")
        try:
            if call.get("type") != "function" or name not in by_name:
                raise ValueError(f"Tool {name} not found.")
            result = by_name[name](**function.get("arguments", {}))
        except Exception as e:  # the model's call is at fault: TRL returns the error to it
            failures += 1
            result = {"error": str(e)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, failures


def tool_demonstration(tokenizer, tool_call: dict[str, Any], tools: Sequence[Callable]) -> tuple[list[int], list[int]]:
    """``(ids, loss mask)`` of a demonstration's tool-call turn and the tool result TRL appends to it (mask 1 on the
    turn, 0 on the result); the answer turn follows."""
    turn = tool_call_turn_ids(tokenizer, tool_call, tools)
    messages, failures = run_tool_calls([{"type": "function", "function": tool_call}], tools)
    if failures:
        raise ValueError(f"a demonstration's tool call fails: {tool_call} -> {messages[0]['content']}")
    suffix = tool_suffix_ids(tokenizer, messages)
    return turn + suffix, [1] * len(turn) + [0] * len(suffix)


def _near_miss(solution: str, rng: random.Random) -> str:
    try:
        value = int(solution)
    except ValueError:
        return solution  # only integer answers get a noisy twin
    return str(value + rng.choice([-1, 1]) if value > 0 else value + 1)


def demonstration(
    tokenizer, prompt_ids: list[int], answer_text: str, tool_part: tuple[list[int], list[int]] | None = None
) -> tuple[list[int], list[int], list[int] | None]:
    """One SFT row ``(prompt ids, completion ids, loss mask or None for all ones)``: the answer turn is
    ``answer_text`` + EOS, after ``tool_part`` (:func:`tool_demonstration`) if given."""
    answer_ids = tokenizer(text=answer_text + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]
    if tool_part is None:
        return prompt_ids, answer_ids, None
    tool_ids, tool_mask = tool_part
    return prompt_ids, tool_ids + answer_ids, tool_mask + [1] * len(answer_ids)


def _batch(rows: list[tuple[list[int], list[int], list[int] | None]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` and ``labels`` (-100 on prompt, padding and completion tokens
    whose loss mask is 0)."""
    width = max(len(p) + len(c) for p, c, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, completion, mask) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[i, :n] = torch.tensor(prompt + completion)
        attention_mask[i, :n] = 1
        targets = torch.tensor(completion)
        if mask is not None:
            targets[torch.tensor(mask) == 0] = -100
        labels[i, len(prompt) : n] = targets
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def cold_start_sft(
    model,
    tokenizer,
    dataset: Dataset,
    config: ColdStartConfig,
    log: Callable[[str], None] = print,
    tools: Sequence[Callable] | None = None,
    tool_call: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
):
    """Train ``model`` in place for ``config.steps`` steps on ``dataset`` (``prompt``, ``solution``); returns a dict
    with the final loss and the sampled accuracy (temperature 1) on ``config.eval_samples`` rows.

    ``tools``: prompts are rendered with them (as TRL does with ``GRPOTrainer(tools=...)``), and with
    ``config.tool_call_fraction > 0`` that fraction of demonstrations first makes ``tool_call(row)`` (``{"name",
    "arguments"}``; the row as a dict) and reads its result. The report then also has ``tool_call_rate`` (sampled
    first turns that TRL parses into a tool call) and ``tool_failure_rate`` (of those calls, the ones that raised),
    and the sampled accuracy is measured through one round of tool calls.
    """
    if config.steps and len(dataset) == 0:
        raise ValueError("the cold-start dataset is empty")
    tools = list(tools or [])
    demonstrates_tools = bool(tools) and config.tool_call_fraction > 0
    if demonstrates_tools and tool_call is None:
        raise ValueError("tool_call_fraction > 0 needs `tool_call`: the call a demonstration makes for a row")
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    prompts, solutions = list(dataset["prompt"]), [str(s) for s in dataset["solution"]]
    prompt_ids = [prompt_token_ids(tokenizer, p, tools) for p in prompts]
    demonstrations: dict[int, tuple[list[int], list[int]]] = {}  # row -> tool-call turn + tool result, rendered once
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    loss_value = float("nan")
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        rows = []
        for _ in range(config.batch_size):
            i = rng.randrange(len(prompts))
            answer = _near_miss(solutions[i], rng) if rng.random() < config.label_noise else solutions[i]
            tool_part = None
            if demonstrates_tools and rng.random() < config.tool_call_fraction:  # no draw without tools
                if i not in demonstrations:
                    assert tool_call is not None  # demonstrates_tools needs it (refused above otherwise)
                    demonstrations[i] = tool_demonstration(tokenizer, tool_call(dataset[i]), tools)
                tool_part = demonstrations[i]
            rows.append(demonstration(tokenizer, prompt_ids[i], config.answer_template.format(answer), tool_part))
        batch = _batch(rows, tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 100 == 0 or step == config.steps:
            log(
                f"cold-start SFT step {step}/{config.steps}: loss {loss_value:.3f} ({time.perf_counter() - start:.0f} s)"
            )
    model.eval()
    if tools:
        measured = sampled_tool_rollouts(model, tokenizer, prompts, solutions, tools, config.eval_samples, config.seed)
    else:
        measured = {
            "sampled_accuracy": sampled_accuracy(
                model, tokenizer, prompts, solutions, config.eval_samples, config.seed
            )
        }
    return {"final_loss": loss_value, **measured, "seconds": time.perf_counter() - start}


def _sample(model, tokenizer, rows: list[list[int]], max_new_tokens: int, seed: int) -> list[list[int]]:
    """One temperature-1 continuation of each row (left-padded batch), cut after its first EOS."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for j, r in enumerate(rows):  # left padding for generation
        input_ids[j, width - len(r) :] = torch.tensor(r)
        attention_mask[j, width - len(r) :] = 1
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    completions = []
    for row in output[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        completions.append(row[:end])
    return completions


def _score(texts: list[str], golds: list[str]) -> float:
    rewards = [r for r in accuracy_reward(texts, golds) if r is not None]
    return sum(rewards) / len(rewards) if rewards else float("nan")


@torch.no_grad()
def sampled_accuracy(model, tokenizer, prompts, solutions, num_samples: int, seed: int, max_new_tokens: int = 16):
    """Mean :func:`accuracy_reward` of one temperature-1 sample for each of ``num_samples`` rows."""
    if num_samples <= 0 or not prompts:
        return float("nan")
    rng = random.Random(seed + 1)
    picks = [rng.randrange(len(prompts)) for _ in range(num_samples)]
    completions = _sample(
        model, tokenizer, [prompt_token_ids(tokenizer, prompts[i]) for i in picks], max_new_tokens, seed
    )
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return _score(texts, [solutions[i] for i in picks])


@torch.no_grad()
def sampled_tool_rollouts(
    model,
    tokenizer,
    prompts,
    solutions,
    tools: Sequence[Callable],
    num_samples: int,
    seed: int,
    max_new_tokens: int = 128,
    answer_tokens: int = 16,
) -> dict[str, float]:
    """Sample ``num_samples`` rows with one round of tool calls, as TRL's tool loop runs them: a first turn
    (parsed by TRL's response parser), the tools run on its calls, the results appended (:func:`tool_suffix_ids`),
    a second turn. Returns ``sampled_accuracy`` (of the final turns), ``tool_call_rate`` (first turns that parse
    into at least one tool call) and ``tool_failure_rate`` (calls that raised or named no tool, of all calls)."""
    from ...upstream import add_response_schema, parse_response

    nan = float("nan")
    if num_samples <= 0 or not prompts:
        return {"sampled_accuracy": nan, "tool_call_rate": nan, "tool_failure_rate": nan}
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        tokenizer = add_response_schema(tokenizer)  # as GRPOTrainer does with tools
    rng = random.Random(seed + 1)
    picks = [rng.randrange(len(prompts)) for _ in range(num_samples)]
    prompt_ids = [prompt_token_ids(tokenizer, prompts[i], tools) for i in picks]
    first = _sample(model, tokenizer, prompt_ids, max_new_tokens, seed)
    finals = list(first)
    calls = failures = 0
    continued: list[tuple[int, list[int]]] = []  # (sample, prompt + first turn + tool results)
    for j, ids in enumerate(first):
        tool_calls = parse_response(tokenizer, ids, prefix=prompt_ids[j], tools=list(tools)).get("tool_calls")
        if tool_calls:
            messages, failed = run_tool_calls(tool_calls, tools)
            calls, failures = calls + len(tool_calls), failures + failed
            continued.append((j, prompt_ids[j] + ids + tool_suffix_ids(tokenizer, messages)))
    if continued:
        second = _sample(model, tokenizer, [ids for _, ids in continued], answer_tokens, seed + 2)
        for (j, _), ids in zip(continued, second, strict=True):
            finals[j] = ids
    texts = tokenizer.batch_decode(finals, skip_special_tokens=True)
    return {
        "sampled_accuracy": _score(texts, [solutions[i] for i in picks]),
        "tool_call_rate": len(continued) / len(picks),
        "tool_failure_rate": failures / calls if calls else 0.0,
    }


def settings_key(settings: dict[str, Any]) -> str:
    """A short stable hash of JSON-serialisable settings."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`), plus its architecture."""
    name = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or platform.processor() or 'unknown'} ({platform.machine()})"


def cold_start_environment() -> dict[str, Any]:
    """What changes a cold start's result besides its settings: float sums run in another order on another thread
    count, CPU (its kernels: ``torch.backends.cpu.get_cpu_capability()``, and the vendor's code paths) or torch
    build, which changes an early sample and from there every weight; transformers builds the model and the
    tokenizer; math-verify scores the measured accuracy; this module's training and sampling and the reward it
    scores with (a hash of their source; how the caller builds the model is the caller's ``settings``). The cold
    start runs where the model is built, on the CPU."""
    from importlib.metadata import version

    import transformers

    from . import rewards

    return {
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "math_verify": version("math-verify"),
        "code": settings_key({path.name: path.read_text() for path in (Path(__file__), Path(rewards.__file__))}),
    }


def cache_folder(cache_dir: str | Path, settings: dict[str, Any], environment: dict[str, Any]) -> Path:
    """Where the cold start for ``settings`` in ``environment`` is cached: a hash of both."""
    return Path(cache_dir) / settings_key({"settings": settings, "environment": environment})


def cached_cold_start(
    cache_dir: str | Path,
    settings: dict[str, Any],
    build: Callable[[], tuple[Any, Any, dict]],
    log: Callable[[str], None] = print,
) -> tuple[Path, dict]:
    """The folder holding the cold-started model for ``settings`` in this environment (:func:`cold_start_environment`),
    building it with ``build()`` if absent.

    ``build`` returns ``(model, tokenizer, report)``; both are saved with ``save_pretrained`` next to
    ``cold_start.json`` (``settings``, ``environment`` and ``report``). The folder is written under a temporary name
    and renamed, so an interrupted build never leaves a half-written cache entry. Returns ``(folder, record)``.
    """
    environment = cold_start_environment()
    folder = cache_folder(cache_dir, settings, environment)
    record_path = folder / COLD_START_FILE
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        log(
            f"cold start: reusing {folder} (sampled accuracy {record['report'].get('sampled_accuracy', float('nan')):.2f})"
        )
        return folder, record
    model, tokenizer, report = build()
    partial = folder.with_name(folder.name + f".partial-{random.getrandbits(32):08x}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    record = {"settings": settings, "environment": environment, "report": report}
    (partial / COLD_START_FILE).write_text(json.dumps(record, indent=2, default=str))
    try:
        partial.rename(folder)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(partial, ignore_errors=True)
        record = json.loads(record_path.read_text())
    log(f"cold start: saved {folder}")
    return folder, record


def default_cache_dir() -> Path:
    """``$TRL_MOE_REPLAY_CACHE`` or ``$XDG_CACHE_HOME/trl_moe_replay`` (``~/.cache/trl_moe_replay``), ``/cold_start``."""
    root = os.environ.get("TRL_MOE_REPLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trl_moe_replay"
    )
    return Path(root) / "cold_start"
