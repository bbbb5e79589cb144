r"""A short cold-start SFT of a small model on ``prompt``/``solution`` rows, cached on disk by its settings.

RL recipes for reasoning models (DeepSeek-R1, the R3 and GSPO papers' Qwen3 runs) start from a model that already
answers in the expected format and is right some of the time; RL then raises the accuracy. The offline recipe's tiny
random MoE knows nothing, so this module gives it that start: teacher-forced SFT on ``prompt -> \boxed{solution}``
with the prompt tokens masked out of the loss, tokenized exactly as TRL's GRPO trainer tokenizes prompts.

``label_noise`` replaces that fraction of the demonstrations' integer answers by a near miss (answer +- 1): the
demonstrations are imperfect, so the SFT policy learns the format and a spread of plausible answers and is right
only part of the time (about ``1 - label_noise`` of its samples), which is the situation RL improves on.

Plain PyTorch on purpose: a few hundred tiny steps, no Trainer start-up cost. The result is saved (model, tokenizer,
``cold_start.json`` with the settings and the measured accuracy) under a folder named by a hash of every setting, so
a second run with the same settings loads it instead of training again.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
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

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or self.learning_rate <= 0:
            raise ValueError(f"invalid cold-start settings: {self}")
        if not 0.0 <= self.label_noise <= 1.0:
            raise ValueError(f"label_noise must be in [0, 1], got {self.label_noise}")
        if "{}" not in self.answer_template.replace("{{", "").replace("}}", ""):
            raise ValueError(f"answer_template needs one '{{}}' for the solution, got {self.answer_template!r}")


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """A prompt's ids as TRL's GRPO trainer makes them: chat template + generation prompt for conversational
    prompts, plain tokenization for strings."""
    if isinstance(prompt, str):
        return tokenizer(text=prompt)["input_ids"]
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def _near_miss(solution: str, rng: random.Random) -> str:
    try:
        value = int(solution)
    except ValueError:
        return solution  # only integer answers get a noisy twin
    return str(value + rng.choice([-1, 1]) if value > 0 else value + 1)


def _batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` and ``labels`` (-100 on prompt and padding)."""
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[i, :n] = torch.tensor(prompt + completion)
        attention_mask[i, :n] = 1
        labels[i, len(prompt) : n] = torch.tensor(completion)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def cold_start_sft(model, tokenizer, dataset: Dataset, config: ColdStartConfig, log: Callable[[str], None] = print):
    """Train ``model`` in place for ``config.steps`` steps on ``dataset`` (``prompt``, ``solution``); returns a dict
    with the final loss and the sampled accuracy (temperature 1) on ``config.eval_samples`` rows."""
    if config.steps and len(dataset) == 0:
        raise ValueError("the cold-start dataset is empty")
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    eos = tokenizer.eos_token or ""
    prompts, solutions = list(dataset["prompt"]), [str(s) for s in dataset["solution"]]
    prompt_ids = [prompt_token_ids(tokenizer, p) for p in prompts]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    loss_value = float("nan")
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        rows = []
        for _ in range(config.batch_size):
            i = rng.randrange(len(prompts))
            answer = _near_miss(solutions[i], rng) if rng.random() < config.label_noise else solutions[i]
            completion = tokenizer(text=config.answer_template.format(answer) + eos, add_special_tokens=False)
            rows.append((prompt_ids[i], completion["input_ids"]))
        batch = _batch(rows, tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 100 == 0 or step == config.steps:
            log(f"cold-start SFT step {step}/{config.steps}: loss {loss_value:.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    accuracy = sampled_accuracy(model, tokenizer, prompts, solutions, config.eval_samples, config.seed)
    return {"final_loss": loss_value, "sampled_accuracy": accuracy, "seconds": time.perf_counter() - start}


@torch.no_grad()
def sampled_accuracy(model, tokenizer, prompts, solutions, num_samples: int, seed: int, max_new_tokens: int = 16):
    """Mean :func:`accuracy_reward` of one temperature-1 sample for each of ``num_samples`` rows."""
    if num_samples <= 0 or not prompts:
        return float("nan")
    rng = random.Random(seed + 1)
    picks = [rng.randrange(len(prompts)) for _ in range(num_samples)]
    rows = [prompt_token_ids(tokenizer, prompts[i]) for i in picks]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for j, r in enumerate(rows):  # left padding for generation
        input_ids[j, width - len(r) :] = torch.tensor(r)
        attention_mask[j, width - len(r) :] = 1
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    output = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), do_sample=True, temperature=1.0,
        top_k=0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    rewards = accuracy_reward(texts, [solutions[i] for i in picks])
    scored = [r for r in rewards if r is not None]
    return sum(scored) / len(scored) if scored else float("nan")


def settings_key(settings: dict[str, Any]) -> str:
    """A short stable hash of JSON-serialisable settings."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_cold_start(
    cache_dir: str | Path,
    settings: dict[str, Any],
    build: Callable[[], tuple[Any, Any, dict]],
    log: Callable[[str], None] = print,
) -> tuple[Path, dict]:
    """The folder holding the cold-started model for ``settings``, building it with ``build()`` if absent.

    ``build`` returns ``(model, tokenizer, report)``; both are saved with ``save_pretrained`` next to
    ``cold_start.json`` (``settings`` + ``report``). The folder is written under a temporary name and renamed, so
    an interrupted build never leaves a half-written cache entry. Returns ``(folder, record)``.
    """
    folder = Path(cache_dir) / settings_key(settings)
    record_path = folder / COLD_START_FILE
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        log(f"cold start: reusing {folder} (sampled accuracy {record['report'].get('sampled_accuracy', float('nan')):.2f})")
        return folder, record
    model, tokenizer, report = build()
    partial = folder.with_name(folder.name + f".partial-{random.getrandbits(32):08x}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    record = {"settings": settings, "report": report}
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

