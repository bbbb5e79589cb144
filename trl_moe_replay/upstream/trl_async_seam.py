"""The TRL async part of the seam: what ``MoEReplayAsyncGRPOTrainer`` (trl_moe_replay/async_grpo/async_grpo_trainer.py)
and its rollout worker (trl_moe_replay/async_grpo/async_rollout_worker.py) rely on in TRL's experimental
``trl/experimental/async_grpo/`` beyond its public API, each one named entry (read from TRL 1.16.0).

:func:`check_async_trl` verifies the entries by signature, by the names that must exist, and by behavioural probes
where a stand-in suffices (the copy of the packing trie's fits/add against TRL's own, the batchers' row class,
the attention kernel lookup); the trainer calls it when it is built.
What needs a running worker and trainer (the dataset yielding the sample it last took, the padding stripped in
``compute_loss``, the version bump in ``_sync_weight``) is probed by the scripted-worker tests of
``tests/async_grpo/test_async_grpo_trainer.py``, among them the bit-for-bit comparison with TRL's own trainer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import itertools
import types
from collections.abc import Iterator
from typing import Any

import torch

from .entries import Entry, Finding, UpstreamChangedError, entry, installed_versions, method_finding
from .torch_seam import check_torch
from .transformers_seam import check_transformers
from .trl_seam import TRL_READ, TRL_VERIFIED


ASYNC_PACKAGE = "trl.experimental.async_grpo"


def _async_module(name: str) -> Any:
    return importlib.import_module(f"{ASYNC_PACKAGE}.{name}")


# ---------------------------------------------------------------------------------------------------------------
# async_rollout_worker: trl/experimental/async_grpo/async_rollout_worker.py.
#    _AsyncRolloutLoop is subclassed: _post(path, payload, timeout, max_retries) returns the whole response JSON,
#    _generate_one(prompt, tool_dict, tools, group_id) returns the conversation's TrainingSequence rows at index 2,
#    _score_group(group) emits one RolloutSample per row of group.completions_sequences in order,
#    _retry(coro_factory, *, label, max_attempts), _counters/_rates (the loop's metric sinks). AsyncRolloutWorker:
#    _loop_cls, _process, _failed_event, _stop_event_mp (our stop() sets it itself), _heartbeat_value,
#    _model_version_value (mp.Values with their default RLock), _loop_kwargs (forwarded to the loop:
#    max_request_attempts, model_name). RolloutSample: a slots dataclass, subclassed.
# ---------------------------------------------------------------------------------------------------------------
LOOP_METHODS: dict[str, tuple[str, ...]] = {
    "_post": ("self", "path", "payload", "timeout", "max_retries"),
    "_generate_one": ("self", "prompt", "tool_dict", "tools", "group_id"),
    "_score_group": ("self", "group"),
    "_retry": ("self", "coro_factory", "label", "max_attempts"),
}
WORKER_ATTRIBUTES = (
    "_counters",
    "_rates",
    "_process",
    "_failed_event",
    "_stop_event_mp",
    "_heartbeat_value",
    "_model_version_value",
    "_loop_kwargs",
)
ASYNC_ROLLOUT_WORKER = entry(
    "async_rollout_worker", "trl", TRL_READ, TRL_VERIFIED, inherited=(*LOOP_METHODS, *WORKER_ATTRIBUTES)
)


def async_worker_classes() -> tuple[Any, Any, Any]:
    """``(_AsyncRolloutLoop, AsyncRolloutWorker, RolloutSample)`` of TRL's async rollout worker (``Any``: our classes
    derive from them, and a type checker takes an ``Any`` as a base class, not a ``type``)."""
    worker = _async_module("async_rollout_worker")
    return worker._AsyncRolloutLoop, worker.AsyncRolloutWorker, worker.RolloutSample


def worker_loop_kwargs(worker: Any) -> dict:
    """The keyword arguments ``AsyncRolloutWorker`` builds its rollout loop with (a live dict: entries set here
    reach the loop; empty for a worker that is not TRL's)."""
    return getattr(worker, "_loop_kwargs", None) or {}


# ---------------------------------------------------------------------------------------------------------------
# async_trainer_globals: trl/experimental/async_grpo/async_grpo_trainer.py.
#    The module globals AsyncRolloutWorker (built by AsyncGRPOTrainer.__init__), get_peak_flops_per_device (called by
#    __init__; it asks CUDA for the device name), RolloutQueueDataset, FixedCountBatcher, TokenBudgetBatcher and
#    DataCollatorForRollout (built by get_train_dataloader) are replaced while the trainer builds them (once each, in
#    __init__ and get_train_dataloader: never while it trains). RolloutQueueDataset.__iter__ yields right after its
#    last `self.queue.get(`, and the dataset keeps .model_version_fn and .metrics (the trainer's metric sink);
#    compute_loss strips the collator's padding with inputs["attention_mask"]; _sync_weight publishes the weights and
#    bumps model_version; AsyncGRPOTrainer._lora_sync says whether __init__ chose adapter-only vLLM sync (a PEFT model
#    and a server started with --enable-lora) instead of merged weights; _metrics is the metric sink log() averages.
# ---------------------------------------------------------------------------------------------------------------
TRAINER_GLOBALS = (
    "AsyncRolloutWorker",
    "get_peak_flops_per_device",
    "RolloutQueueDataset",
    "FixedCountBatcher",
    "TokenBudgetBatcher",
    "DataCollatorForRollout",
)
ASYNC_TRAINER_GLOBALS = entry(
    "async_trainer_globals", "trl", TRL_READ, TRL_VERIFIED, inherited=("_sync_weight", "_metrics")
)


@contextlib.contextmanager
def async_trainer_globals(**values: Any) -> Iterator[None]:
    """Within the context, the async trainer module's globals ``values`` (``AsyncRolloutWorker``,
    ``get_peak_flops_per_device``, the data pipeline's classes) are replaced; restored on exit."""
    module = _async_module("async_grpo_trainer")
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# ---------------------------------------------------------------------------------------------------------------
# async_batcher_rows: trl/experimental/async_grpo/async_grpo_trainer.py.
#    FixedCountBatcher.__iter__ and TokenBudgetBatcher.__iter__ build every row as `TreeRow()`, the module global,
#    looked up when that line runs; TRL 1.16 takes no row class (no argument, no attribute, no factory method).
#    batcher_rows() runs TRL's own __iter__ code with a globals dict of its own in which that one name is our row
#    class: TRL's module is never written to, so nothing is swapped per item (the swap this replaced was redone on
#    every next()), and any other batcher, in this thread or another, still builds TRL's rows. The probe runs both
#    batchers so and checks that every row they yield is the class given.
# ---------------------------------------------------------------------------------------------------------------
ASYNC_BATCHER_ROWS = entry("async_batcher_rows", "trl", TRL_READ, TRL_VERIFIED)


def batcher_rows(iterate: Any, row_class: type) -> Iterator[Any]:
    """Iterate a TRL batcher, given its bound ``__iter__`` (``super().__iter__`` in a subclass), with every row it
    builds a ``row_class()``: TRL's code as it is, run with its module's globals (as they are now) but for
    ``TreeRow``."""
    function = iterate.__func__
    scope = {**function.__globals__, "TreeRow": row_class}
    rebound = types.FunctionType(
        function.__code__, scope, function.__name__, function.__defaults__, function.__closure__
    )
    return rebound(iterate.__self__)


def async_adapter_only_sync(trainer: Any) -> bool:
    """Whether TRL's async trainer syncs a LoRA adapter to vLLM as an adapter (``--enable-lora``), not merged."""
    return bool(getattr(trainer, "_lora_sync", False))


# ---------------------------------------------------------------------------------------------------------------
# async_grpo_classes: the classes the async trainer subclasses or hands TRL in place of its own, loaded here and only
#    here (tests/cross_cutting/test_layout.py), on first use (importing trl.experimental warns): AsyncGRPOTrainer and
#    AsyncGRPOConfig (exported by trl.experimental.async_grpo), RolloutQueueDataset, FixedCountBatcher,
#    TokenBudgetBatcher and DataCollatorForRollout (module globals of async_grpo_trainer the package does not export;
#    their replacement is entry async_trainer_globals).
# ---------------------------------------------------------------------------------------------------------------
ASYNC_GRPO_CLASSES = entry("async_grpo_classes", "trl", TRL_READ, TRL_VERIFIED)
CLASS_MODULES = {
    "AsyncGRPOTrainer": "async_grpo_trainer",
    "AsyncGRPOConfig": "async_grpo_config",
    **dict.fromkeys(
        ("RolloutQueueDataset", "FixedCountBatcher", "TokenBudgetBatcher", "DataCollatorForRollout"),
        "async_grpo_trainer",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in CLASS_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_async_module(CLASS_MODULES[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


# ---------------------------------------------------------------------------------------------------------------
# async_packing: trl/experimental/async_grpo/packing.py.
#    TreeRow.fits and TreeRow.add key the prefix trie on (token, next token), computed inline in both bodies; TRL 1.16
#    has no hook for the key (no method, no argument), and none narrower than the two bodies can change it: a sample
#    whose input_ids folded its routes into the tokens would reach TRL's add(), which stores key[0] as the node's token
#    and the sample itself for pack() to read its tokens from, so folded ids would end in the packed row; the trie's
#    child dicts are `{}` literals inside add(). So keyed_tree_row_class() is TreeRow with fits/add copied from TRL
#    1.16 and the key taken out into one method, trie_keys(sample): the hook async_grpo/packing.py's RoutedTreeRow
#    overrides to add the route. The copy is what this entry declares; its probe runs the copy and TRL's own TreeRow
#    on the same samples and compares every answer of fits() and every attribute after each add(), so any change to
#    TRL's two bodies or the state they keep is a finding. pack() lays nodes out in DFS pre-order (RoutedTreeRow.pack
#    checks that on every row it packs). tree_attention looks the module global _flash_attn up at call time (FA3
#    through kernels.get_kernel; replaced on CPU).
# ---------------------------------------------------------------------------------------------------------------
ASYNC_PACKING = entry("async_packing", "trl", TRL_READ, TRL_VERIFIED)


def async_tree_row_class() -> Any:  # Any: a base class of ours (see async_worker_classes)
    """TRL's ``TreeRow``."""
    return _async_module("packing").TreeRow


@functools.cache
def keyed_tree_row_class() -> Any:  # Any: a base class of ours
    """TRL's ``TreeRow`` with its trie key as a method, ``trie_keys(sample)`` (see the entry above)."""

    tree_row: Any = async_tree_row_class()

    class KeyedTreeRow(tree_row):
        """``TreeRow``; ``fits``/``add`` are TRL 1.16's, keyed on ``trie_keys(sample)`` (seam entry
        ``async_packing``)."""

        def trie_keys(self, sample: dict[str, Any]) -> list[tuple]:
            """One trie key per token of ``sample``: TRL's (token, next token), the last token's next ``None``."""
            input_ids = sample["input_ids"].tolist()
            return list(zip(input_ids, [*input_ids[1:], None], strict=True))

        def fits(self, sample: dict[str, Any], budget: int) -> bool:
            keys = self.trie_keys(sample)
            children, shared = self.roots, 0
            for key in keys:
                if key not in children:
                    break
                children = self.children[children[key]]
                shared += 1
            novel = len(keys) - shared
            return len(self.tokens) + novel <= budget and self.trained + int(sample["completion_mask"].sum()) <= budget

        def add(self, sample: dict[str, Any]) -> None:
            children = self.roots
            nodes = []
            for depth, key in enumerate(self.trie_keys(sample)):
                if key not in children:
                    children[key] = len(self.tokens)
                    self.tokens.append(key[0])
                    self.children.append({})
                    self.load += depth + 1
                nodes.append(children[key])
                children = self.children[nodes[-1]]
            self.samples.append(sample)
            self.sample_nodes.append(nodes)
            self.groups.add(sample["group_id"])
            self.trained += int(sample["completion_mask"].sum())

    return KeyedTreeRow


@contextlib.contextmanager
def tree_attention_kernel(kernel: Any) -> Iterator[None]:
    """Within the context, TRL's packed tree attention calls ``kernel.flash_attn_varlen_func`` instead of
    FlashAttention-3; TRL's kernel lookup is restored on exit."""
    packing = _async_module("packing")
    saved = packing._flash_attn
    packing._flash_attn = lambda: kernel
    try:
        yield
    finally:
        packing._flash_attn = saved


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------
@functools.cache
def check_async_trl() -> tuple[Finding, ...]:
    """The entries above against the installed TRL; returns what no longer holds (empty: all good)."""
    findings: list[Finding] = []

    def expect(declared: Entry, condition: bool, problem: str) -> None:
        if not condition:
            findings.append(Finding(declared, problem))

    worker = _async_module("async_rollout_worker")
    trainer = _async_module("async_grpo_trainer")
    packing = _async_module("packing")
    loop = getattr(worker, "_AsyncRolloutLoop", None)
    findings.extend(
        finding
        for name, params in LOOP_METHODS.items()
        if (finding := method_finding(ASYNC_ROLLOUT_WORKER, loop, "_AsyncRolloutLoop", name, params, exact=True))
    )
    expect(
        ASYNC_ROLLOUT_WORKER,
        getattr(worker.AsyncRolloutWorker, "_loop_cls", None) is loop,
        "AsyncRolloutWorker._loop_cls is no longer _AsyncRolloutLoop",
    )
    expect(
        ASYNC_ROLLOUT_WORKER, "__slots__" in vars(worker.RolloutSample), "RolloutSample is no longer a slots dataclass"
    )
    for name, module_name in CLASS_MODULES.items():
        expect(
            ASYNC_GRPO_CLASSES,
            isinstance(getattr(_async_module(module_name), name, None), type),
            f"{ASYNC_PACKAGE}.{module_name}.{name} is no longer a class",
        )
    for name in TRAINER_GLOBALS:
        expect(
            ASYNC_TRAINER_GLOBALS, hasattr(trainer, name), f"async_grpo_trainer no longer has the module global {name}"
        )
    dataset_params = tuple(inspect.signature(trainer.RolloutQueueDataset.__init__).parameters)
    expect(
        ASYNC_TRAINER_GLOBALS,
        {"model_version_fn", "metrics"} <= set(dataset_params),
        f"RolloutQueueDataset{dataset_params} no longer takes model_version_fn and metrics",
    )
    findings.extend(
        finding
        for name, params in {"compute_loss": ("self", "model", "inputs"), "_sync_weight": ("self",)}.items()
        if (
            finding := method_finding(
                ASYNC_TRAINER_GLOBALS, trainer.AsyncGRPOTrainer, "AsyncGRPOTrainer", name, params
            )
        )
    )
    expect(ASYNC_PACKING, callable(getattr(packing, "_flash_attn", None)), "packing._flash_attn no longer exists")
    probes = (
        (ASYNC_PACKING, "the copy of fits/add", lambda: _probe_keyed_tree_row(packing)),
        (ASYNC_PACKING, "the kernel lookup", lambda: _probe_tree_attention_kernel(packing)),
        (ASYNC_BATCHER_ROWS, "the batchers' rows", lambda: _probe_batcher_rows(trainer, packing)),
    )
    for declared, name, probe in probes:
        try:
            problem = probe()
        except Exception as error:  # TRL's code now reads or does something the probe's stand-in lacks
            problem = f"the probe of {name} failed ({type(error).__name__}: {error}); re-read the entry"
        expect(declared, problem is None, problem or "")
    return tuple(findings)


def _probe_samples() -> list[dict[str, Any]]:
    """Samples that share a prompt, fork, repeat one another, and overrun small budgets (stand-ins for the queue's)."""

    def sample(ids, group, trained):
        return {
            "input_ids": torch.tensor(ids),
            "completion_mask": torch.tensor([0] * (len(ids) - trained) + [1] * trained),
            "group_id": group,
        }

    return [
        sample([1, 2, 3, 4], 0, 2),
        sample([1, 2, 3, 5], 0, 2),
        sample([1, 2, 6], 1, 1),
        sample([1, 2, 3, 4], 0, 2),
        sample([7, 8], 2, 1),
        sample([1, 9, 9, 9, 9, 9], 1, 5),
    ]


def _probe_keyed_tree_row(packing: Any) -> str | None:
    """The copy of fits/add answers and keeps exactly what TRL's own does, sample by sample."""
    theirs, ours = packing.TreeRow(), keyed_tree_row_class()()
    for index, sample in enumerate(_probe_samples()):
        for budget in (3, 4, 6, 8, 64):
            if theirs.fits(sample, budget) != ours.fits(sample, budget):
                return (
                    f"TreeRow.fits no longer answers as the copy of it (keyed_tree_row_class) does: sample {index}, "
                    f"budget {budget}"
                )
        theirs.add(sample)
        ours.add(sample)
        if vars(theirs) != vars(ours):
            changed = sorted(
                name
                for name in {*vars(theirs), *vars(ours)}
                if vars(theirs).get(name, ...) != vars(ours).get(name, ...)
            )
            return (
                f"TreeRow.add no longer keeps what the copy of it (keyed_tree_row_class) keeps: {changed} differ "
                f"after sample {index}"
            )
    return None


def _global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it (comprehensions: their own code objects before Python 3.12)
    look up."""
    nested = (const for const in code.co_consts if isinstance(const, types.CodeType))
    return set(code.co_names).union(*map(_global_names, nested))


def _probe_batcher_rows(trainer: Any, packing: Any) -> str | None:
    """Both batchers, run by batcher_rows with a marker row class, yield rows of that class only."""
    marker = type("MarkerRow", (packing.TreeRow,), {})
    samples = _probe_samples()[:3]  # the third overruns a budget of 6 after the first two (8 tokens)
    batchers = {
        "FixedCountBatcher": trainer.FixedCountBatcher(samples, num_processes=1, microbatch_size=2),
        "TokenBudgetBatcher": trainer.TokenBudgetBatcher(
            samples, num_processes=1, token_budget=6, metrics=collections.defaultdict(list)
        ),
    }
    for name, batcher in batchers.items():
        if "TreeRow" not in _global_names(vars(type(batcher))["__iter__"].__code__):
            return f"{name}.__iter__ no longer builds its rows by the module global TreeRow"
        # at most 4 micro-batches: a TRL whose rows never fit would yield empty ones forever
        rows = [
            row for micro_batch in itertools.islice(batcher_rows(batcher.__iter__, marker), 4) for row in micro_batch
        ]
        if not rows or not all(type(row) is marker for row in rows):
            return f"{name}.__iter__ yielded rows not built from the row class batcher_rows gave it"
    return None


def _probe_tree_attention_kernel(packing: Any) -> str | None:
    """tree_attention calls the kernel the module global _flash_attn returns at call time."""

    class _Called(Exception):
        pass

    class Kernel:
        @staticmethod
        def flash_attn_varlen_func(*args, **kwargs):
            raise _Called

    x = torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16)  # [batch, heads, tokens, head_dim]; not float32: no dtype search
    with tree_attention_kernel(Kernel):
        try:
            packing.tree_attention(
                torch.nn.Module(),
                x,
                x,
                x,
                None,
                tree_kv_index=torch.arange(2),
                tree_cu_seqlens_q=torch.tensor([0, 2]),
                tree_cu_seqlens_k=torch.tensor([0, 2]),
                tree_max_seqlen_q=2,
                tree_max_seqlen_k=2,
            )
        except _Called:
            return None
    return "tree_attention no longer calls the kernel the module global _flash_attn returns at call time"


def assert_async_trl_compatible() -> None:
    """Raise :class:`UpstreamChangedError` listing every entry the installed TRL (or torch, transformers) breaks."""
    findings = check_async_trl() + check_transformers() + check_torch()
    if findings:
        lines = "\n".join(f"  - {finding}" for finding in findings)
        raise UpstreamChangedError(
            f"trl_moe_replay's async trainer was written against TRL {TRL_READ}'s trl.experimental.async_grpo; the "
            f"installed {installed_versions(findings)} no longer matches it (trl_moe_replay/upstream/, by entry):\n"
            f"{lines}"
        )
