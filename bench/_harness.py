"""Pieces the overhead benches share: side-by-side timing, the benchmark MoE, and one trainer cycle.

Imported as ``from _harness import ...`` by the scripts in this folder (``python bench/<script>.py`` puts the folder
on ``sys.path``).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from datasets import Dataset

from trl_moe_replay.testing import tiny_moe_model, tiny_tokenizer


class Ratio(NamedTuple):
    """Per-round candidate/baseline ratios (median, min, max) and the median time of each side."""

    median: float
    low: float
    high: float
    baseline: float
    candidate: float


def timer(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> Callable[[int], float]:
    """``fn`` as a round function for ``interleaved_ratio``: it ignores the round and returns ``fn``'s duration."""

    def run(_round: int) -> float:
        start = clock()
        fn()
        return clock() - start

    return run


def interleaved_ratio(baseline: Callable[[int], float], candidate: Callable[[int], float], rounds: int) -> Ratio:
    """Round 0 warms both up; rounds 1..``rounds`` alternate which side goes first (to cancel drift).

    Each side is called with the round number (a seed, where it wants one) and returns its own duration.
    """
    baseline(0), candidate(0)
    ratios, base_times, cand_times = [], [], []
    for round_ in range(1, rounds + 1):
        if round_ % 2:
            b, c = baseline(round_), candidate(round_)
        else:
            c, b = candidate(round_), baseline(round_)
        ratios.append(c / b)
        base_times.append(b)
        cand_times.append(c)
    return Ratio(
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        statistics.median(base_times),
        statistics.median(cand_times),
    )


class PairSpread(NamedTuple):
    """Candidate/baseline ratios per ABBA pair: median, min, max, quartiles, how many pairs, and each side's median
    time per call over the pairs."""

    median: float
    low: float
    high: float
    q1: float
    q3: float
    pairs: int
    baseline: float
    candidate: float


def abba_pairs(
    sides: dict[str, Callable[[int], float]],
    pairs: int,
    warmup: int = 1,
    keep_going: Callable[[], bool] = lambda: True,
) -> dict[str, list[float]]:
    """Each side's mean time per call in each ABBA pair: ``warmup`` untimed calls of every side, then pairs of
    rounds, the first round in the sides' order and the second reversed (A B C | C B A), so that a drift linear in
    time cancels within each pair for every two sides. Every side is called with the round number (the same seed for
    all sides in a round). ``keep_going()`` is asked before each pair (a time budget); fewer pairs may come back."""
    for round_ in range(-warmup, 0):
        for side in sides.values():
            side(round_)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for pair in range(pairs):
        if not keep_going():
            break
        spent = dict.fromkeys(sides, 0.0)
        for round_, order in ((2 * pair + 1, list(sides)), (2 * pair + 2, list(sides)[::-1])):
            for name in order:
                spent[name] += sides[name](round_)
        for name in sides:
            times[name].append(spent[name] / 2)
    return times


def pair_spread(times: dict[str, list[float]], baseline: str, candidate: str) -> PairSpread:
    """``candidate``/``baseline`` over the pairs ``abba_pairs`` timed (per pair: the ratio of the two sides' times)."""
    ratios = [c / b for b, c in zip(times[baseline], times[candidate], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return PairSpread(
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        q1,
        q3,
        len(ratios),
        statistics.median(times[baseline]),
        statistics.median(times[candidate]),
    )


def report(name: str, value: float, target: float, op: str = "<=") -> None:
    """Print one measured ratio and its target in the line format ``bench/run_all.py`` collects."""
    print(f"ratio: {name} = {value:.3f} (target {op} {target:g})", flush=True)


def bench_moe(hidden: int, layers: int, experts: int, top_k: int, **overrides):
    """The benchmark model: a tiny-family qwen3_moe scaled to ``hidden``/``layers``/``experts``/``top_k`` (experts
    ``hidden // 2`` wide unless ``overrides`` say otherwise)."""
    widths = dict(moe_intermediate_size=hidden // 2, intermediate_size=hidden * 2)
    return tiny_moe_model(
        "qwen3_moe",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_experts=experts,
        num_experts_per_tok=top_k,
        **{**widths, **overrides},
    )


def _reward_len(completions, **kwargs):
    return [-abs(12 - len(c)) for c in completions]


def build_trainer(trainer_cls, config_cls, args, **config_extra):
    """A GRPO trainer (``args``: hidden, layers, experts, top_k, completion) on 16 completions of math prompts, set up
    for ``one_cycle`` outside ``Trainer.train``, and its first batch."""
    # the aux loss is off under replay: keep every side doing the same work
    model = bench_moe(args.hidden, args.layers, args.experts, args.top_k, router_aux_loss_coef=0.0)
    config = config_cls(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=args.completion,
        num_iterations=2,
        gradient_accumulation_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1000,
        **config_extra,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = trainer_cls(
        model=model,
        reward_funcs=_reward_len,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we bypass
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer, batch


def one_cycle(trainer, batch, seed: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Duration of one generation cycle: generation, old-logprob pass and ``num_iterations`` training micro-steps
    with backward (no optimizer step, so compared models stay identical). Gradients are cleared outside the timing."""
    torch.manual_seed(seed)
    start = clock()
    for _ in range(trainer.args.num_iterations):
        trainer.training_step(trainer.model, batch, None)
    elapsed = clock() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed
