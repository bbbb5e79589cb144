"""The GPU check: what holds for routing replay on one CUDA GPU, in one command (``make gpu-check``).

Parts (methods of the first GPU run, kept here so that the next run measures the same things):

  exactness  Per published width (Qwen3-30B-A3B, OLMoE-1B-7B: 2 decoder layers; Mixtral-8x7B: 1) and per experts
             implementation the installed transformers offers: max abs(logit diff) of replaying the routes a
             natural no-grad forward recorded (must be 0), and of replaying shifted routes (a control: must differ).
             An implementation whose estimated allocation exceeds the device's free memory (``batched_mm`` gathers
             every (token, expert) pair's weights: 768 GiB to 7 TiB here) is not run and reads "does not fit at this
             size", as does one that raises ``torch.OutOfMemoryError``. On CUDA with transformers >= 5.25 (and
             ``kernels``, ``USE_HUB_KERNELS`` not off) the rows run both ways: Hub kernels off, then on
             (``set_use_kernels(True)`` in inference mode, what ``from_pretrained`` does by default there; reset
             after). Every other part runs with them off (its models are built from configs, not loaded).
  syncs      Host synchronisations over one forward+backward, natural vs replay (``torch.cuda.set_sync_debug_mode``
             counting its warnings), per width. Off CUDA (smoke) the ``HostReads`` proxy counts instead.
  timing     replay/natural for the forward (no_grad) and forward+backward, per width: ABBA rounds
             (``_harness.interleaved_ratio``), ``cuda.synchronize()`` closing each timed call; median (min-max).
             Replay as the trainer does it: each call replays a micro-batch's rows of ``CheckedRoutes`` (no host
             pass; the routes copied to the GPU per call).
  generate   ``generate`` inside ``RouterReplay.record()`` vs plain: sampled with the same seed on both sides,
             ``min_new_tokens`` = ``max_new_tokens`` (the same lengths), warm-up calls, garbage collection paused
             and the device synchronised around each call; ABBA pairs (``_harness.abba_pairs``), the median ratio
             with its min-max and interquartile range; host syncs per call.
  sampler    Sampler vs trainer at depth: transformers ``generate`` in bf16 is the sampler (its raw logits,
             ``output_logits=True``), one full forward over prompt+completion is the trainer, natural (none) or
             replaying the recorded routes (R3). Router decisions that differ, tokens with any differing layer,
             KL k3 and max abs(d logp), d = trainer - sampler log-prob of the sampled token.
  grpo       ``MoEReplayGRPOTrainer`` cycles (transformers generate, bf16 weights, on-policy: generation, the passes
             the config runs, loss and backward; no optimizer step), three trainers side by side in ABBA pairs:
             "none" and "r3" both without routing metrics and without the importance-sampling correction (no extra
             forward on either side: like with like), and "r3 + correction" (its old-logprob forward). Rows: r3/none,
             and the correction's cost, r3 + correction / r3 (``GRPO_SIDES``).
  expert_parallel  With at least 2 GPUs: R3 step time with expert parallelism (transformers' distributed_config,
             fsdp = ep = the GPU count, all_to_all) against DDP, ABBA rounds (``bench/ep_overhead.py`` under
             torchrun, one process per GPU). With fewer GPUs, or in smoke mode, it says it skipped (the CPU
             figure is ``bench/ep_overhead.py`` on CPU processes).

Each part has its own time budget: it starts no new unit (a width, a round, a depth, a run) once its budget is
spent, records what it has and is marked ``timed_out``; an error in one part is recorded and the others still run.
The full mode fits 5 minutes on one H100/H200. Prints ONE table and writes the JSON (``--out``).

    python bench/gpu_check.py --out gpu_check.json    # full sizes, one CUDA GPU (make gpu-check)
    python bench/gpu_check.py --smoke --out x.json    # the same code at tiny sizes on CPU (the suite runs it)

Exit status: 0 when every part ran and replay was exact; 1 when a part failed or replaying a model's own routes
changed its logits (or other routes did not); 2 without CUDA in full mode (one line says so; use --smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode


sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, real_shapes (also when imported by a test)

from _harness import abba_pairs, bench_moe, interleaved_ratio, one_cycle, pair_spread, timer  # noqa: E402
from real_shapes import MODELS  # noqa: E402

from trl_moe_replay.core.metrics import logprob_mismatch_sums, routing_agreement_sums  # noqa: E402
from trl_moe_replay.routing import RouterReplay  # noqa: E402
from trl_moe_replay.routing.routes import has_route  # noqa: E402
from trl_moe_replay.testing import TINY_VOCAB_SIZE, tiny_moe_model, tiny_tokenizer  # noqa: E402
from trl_moe_replay.upstream.transformers_seam import hub_kernel_layers  # noqa: E402


NO_CUDA_EXIT = 2
DEFAULT_EXPERTS = "grouped_mm"  # transformers' default experts implementation, timed and sync-counted


@dataclass(frozen=True)
class Sizes:
    """Every size the parts use; ``FULL`` on one GPU, ``SMOKE`` on CPU."""

    width_dims: dict  # per MODELS key: overrides of the published decoder-layer dimensions ({} = published)
    width_layers: dict  # decoder layers built per MODELS key
    batch: int
    seq: int
    rounds: int
    gen_model: tuple  # hidden, layers, experts, top_k of the generate / GRPO model
    gen_prompts: int
    gen_prompt_len: int
    gen_new_tokens: int  # max_new_tokens = min_new_tokens: every call generates exactly this many
    gen_pairs: int  # ABBA pairs of generate calls (after gen_warmup untimed calls of each side)
    gen_warmup: int
    sampler_depths: tuple
    sampler_new_tokens: int
    grpo_batch: int
    grpo_generations: int
    grpo_completion: int
    grpo_pairs: int  # ABBA pairs of GRPO cycles (each side warmed up by one untimed cycle)
    dtype: torch.dtype  # of the models (the GRPO trainer's precision: bf16 when bfloat16)
    budgets: dict  # seconds per part


FULL = Sizes(
    width_dims={key: {} for key in MODELS},
    width_layers={"qwen3": 2, "olmoe": 2, "mixtral": 1},
    batch=4,
    seq=4096,
    rounds=6,
    gen_model=(1024, 8, 64, 8),
    gen_prompts=64,
    gen_prompt_len=12,
    gen_new_tokens=64,
    gen_pairs=8,
    gen_warmup=2,
    sampler_depths=(8, 24, 48),
    sampler_new_tokens=128,
    grpo_batch=64,
    grpo_generations=8,
    grpo_completion=64,
    grpo_pairs=4,
    dtype=torch.bfloat16,
    budgets=dict(exactness=40, syncs=15, timing=60, generate=40, sampler=70, grpo=80, expert_parallel=240),
)
_TINY_WIDTH = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=64,
)
SMOKE = Sizes(
    width_dims={
        "qwen3": {**_TINY_WIDTH, "num_experts": 8},
        "olmoe": {**_TINY_WIDTH, "num_experts": 8},
        "mixtral": {**_TINY_WIDTH, "num_local_experts": 8},
    },
    width_layers={"qwen3": 2, "olmoe": 2, "mixtral": 1},
    batch=2,
    seq=32,
    rounds=2,
    gen_model=(64, 2, 8, 2),
    gen_prompts=4,
    gen_prompt_len=6,
    gen_new_tokens=6,
    gen_pairs=2,
    gen_warmup=1,
    sampler_depths=(2, 4),
    sampler_new_tokens=8,
    grpo_batch=8,
    grpo_generations=4,
    grpo_completion=6,
    grpo_pairs=1,
    dtype=torch.float32,
    # a few seconds of work: budgets no busy CI machine reaches, so the suite's smoke run is never partial
    budgets=dict(exactness=600, syncs=300, timing=300, generate=300, sampler=300, grpo=600, expert_parallel=0),
)


class Budget:
    """A part's time budget: the time spent inside ``charge()``; ``spent()`` once it is over (checked before each
    new unit of work, so a unit in flight finishes)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.used = 0.0
        self.ran_out = False
        self._since: float | None = None  # the start of the charge in progress

    @contextlib.contextmanager
    def charge(self):
        self._since = time.monotonic()
        try:
            yield
        finally:
            self.used += time.monotonic() - self._since
            self._since = None

    def spent(self) -> bool:
        """Whether the budget is over, counting the charge in progress (a part asks between its units)."""
        running = time.monotonic() - self._since if self._since is not None else 0.0
        self.ran_out = self.ran_out or self.used + running > self.seconds
        return self.ran_out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn, device):
    """``fn`` followed by a device synchronisation, so a timer around it sees the device's work."""

    def run():
        fn()
        sync(device)

    return run


class HostReads(TorchFunctionMode):
    """Off CUDA, the calls that would make the host wait for an accelerator if their tensor lived on one:
    ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, a blocking ``.to()`` to the CPU, ``nonzero``, ``bool()``/
    ``int()``/``float()`` of a tensor and indexing by a boolean tensor. On a CPU every such call counts, whether or not
    its tensor would live on the device, and syncs inside an operator's C++ are not seen: a proxy, read as recorded
    minus plain (or replay minus natural), not as CUDA's count."""

    NAMES = frozenset({"item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (
            name in self.NAMES
            or (name == "to" and self._to_host(args, kwargs))
            or (name == "__getitem__" and self._bool_index(args))
        ):
            self.count += 1
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(args, kwargs) -> bool:
        if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
            return False
        target = kwargs.get("device")
        for arg in args[1:]:
            if isinstance(arg, (str, torch.device)):
                target = arg
        return target is not None and torch.device(target).type == "cpu"

    @staticmethod
    def _bool_index(args) -> bool:
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


SYNC_COUNTERS = {"cuda": "torch.cuda.set_sync_debug_mode warnings", "cpu": "HostReads (a proxy, see its docstring)"}


def count_syncs(fn, device) -> int:
    """Host synchronisations ``fn`` causes: on CUDA, sync debug mode's warnings (one per sync); elsewhere the
    ``HostReads`` proxy."""
    if device.type != "cuda":
        with HostReads() as reads:
            fn()
        return reads.count
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def experts_implementations() -> list[str]:
    """Every experts implementation the installed transformers offers: ``eager`` plus its experts registry."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.valid_keys())]


def shifted(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Other routes of the same layout: each id moved to the next expert (rows stay sets; "no route" stays)."""
    moved = ((routes.long() + 1) % num_experts).to(routes.dtype)
    return torch.where(has_route(routes)[..., None], moved, routes)


def width_model(key: str, sizes: Sizes, device):
    name, model_type, _depth, dims = MODELS[key]
    with torch.device(device):
        model = tiny_moe_model(
            model_type,
            num_hidden_layers=sizes.width_layers[key],
            max_position_embeddings=32768,
            router_aux_loss_coef=0.0,
            attn_implementation="sdpa",
            dtype=sizes.dtype,
            **{**dims, **sizes.width_dims[key]},
        )
    return name, model


def generation_model(sizes: Sizes, layers: int, device, **overrides):
    """The generate / sampler / GRPO model: at full size a 430M-parameter Qwen3-MoE at 8 layers (hidden 1,024,
    64 experts top-8, experts 256 wide, 8 attention heads), as in the first GPU run."""
    hidden, _layers, experts, top_k = sizes.gen_model
    with torch.device(device):
        return bench_moe(
            hidden,
            layers,
            experts,
            top_k,
            moe_intermediate_size=hidden // 4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=hidden // 8,
            **overrides,
        )


def tokens(batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(6, TINY_VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


def fmt(value, digits=3):
    return "n/a" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------------------- parts
def experts_bytes(model, impl: str, tokens: int, top_k: int) -> int | None:
    """The largest tensor ``impl`` allocates in one MoE block for ``tokens`` tokens, where it grows with the weights:
    ``batched_mm`` gathers each (token, expert) pair's up-projection weights, tokens x top_k x one expert's
    ``gate_up_proj`` (or ``up_proj``). None for the implementations that index the weights without copying them."""
    if impl != "batched_mm":
        return None
    for module in model.modules():
        weights = getattr(module, "gate_up_proj", None)
        if weights is None:
            weights = getattr(module, "up_proj", None)
        if isinstance(weights, torch.Tensor) and weights.dim() == 3:  # [experts, out, in]: a fused experts module
            return tokens * top_k * weights[0].numel() * weights.element_size()
    return None


def free_memory(device) -> int | None:
    """Bytes the device can still allocate (CUDA); None elsewhere (no limit the check knows of)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def gib(n: int) -> str:
    return f"{n / 2**30:,.0f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def exactness_rows(name: str, model, rr: RouterReplay, x: torch.Tensor, memory: int | None = None) -> list[dict]:
    """Per experts implementation: max abs(logit diff) of replaying the model's own routes, and other routes.

    An implementation whose estimated allocation (``experts_bytes``) exceeds ``memory`` (bytes; None: no limit) is
    not run, and one that runs out of memory anyway is caught: both read "does not fit at this size"."""
    rows = []
    model.eval()
    for impl in experts_implementations():
        row = {"width": name, "experts_impl": impl}
        need = experts_bytes(model, impl, x.numel(), rr.top_k)
        if need is not None and memory is not None and need > memory:
            row["does_not_fit"] = {"needs_bytes": need, "memory_bytes": memory, "estimated": True}
            rows.append(row)
            continue
        try:  # only the implementation's own natural forward decides whether this machine can run it
            model.set_experts_implementation(impl)
            with torch.no_grad(), rr.record() as rec:
                natural = model(x).logits
        except torch.OutOfMemoryError as exc:  # the estimate missed it: the allocator's own figure
            row["does_not_fit"] = {
                "needs_bytes": need,
                "memory_bytes": memory,
                "estimated": False,
                "message": str(exc).splitlines()[0][:160],
            }
            rows.append(row)
            if x.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        except Exception as exc:  # an implementation this machine cannot run (a missing kernel, a dtype it lacks)
            row["unavailable"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append(row)
            continue
        # what fails from here on is replay under an implementation that runs: the check's error, not "unavailable"
        with torch.no_grad():
            with rr.replay(rec.checked):
                own = model(x).logits
            with rr.replay(shifted(rec.routes, rr.num_experts)):
                other = model(x).logits
        row.update(
            own_routes_max_diff=(own - natural).abs().max().item(),
            other_routes_max_diff=(other - natural).abs().max().item(),
        )
        del natural, own, other
        rows.append(row)
    model.set_experts_implementation(DEFAULT_EXPERTS)
    return rows


def replay_costs(name: str, model, rr: RouterReplay, x: torch.Tensor, device, rounds: int, clocks: dict) -> dict:
    """Host syncs over one forward+backward and replay/natural timings, under the default experts implementation."""
    model.train()
    with torch.no_grad(), rr.record() as rec:
        model(x)
    checked = rec.checked  # CheckedRoutes, as the trainer holds them

    def micro_batch():  # what the trainer replays per micro-batch: its rows of the held routes (copied to the device)
        return rr.replay(checked.rows(slice(None)))

    def fwd_bwd(replayed):
        def run():
            with micro_batch() if replayed else contextlib.nullcontext():
                model(x, labels=x).loss.backward()

        return run

    def fwd(replayed):
        def run():
            with torch.no_grad(), micro_batch() if replayed else contextlib.nullcontext():
                model(x)

        return run

    def zeroed(fn):  # gradients stay allocated between rounds, zeroed outside the timing
        def run(round_):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            return timer(synced(fn, device))(round_)

        return run

    out = {}
    if not clocks["syncs"].spent():
        with clocks["syncs"].charge():
            fwd_bwd(False)()  # warm: the first call allocates, and may sync for reasons of its own
            natural, replayed = count_syncs(fwd_bwd(False), device), count_syncs(fwd_bwd(True), device)
            out["syncs"] = {"width": name, "experts_impl": DEFAULT_EXPERTS, "natural": natural, "replay": replayed}
    if not clocks["timing"].spent():
        with clocks["timing"].charge():
            fb = interleaved_ratio(zeroed(fwd_bwd(False)), zeroed(fwd_bwd(True)), rounds)
            fo = interleaved_ratio(timer(synced(fwd(False), device)), timer(synced(fwd(True), device)), rounds)
        out["timing"] = {
            "width": name,
            "experts_impl": DEFAULT_EXPERTS,
            "tokens": x.numel(),
            "fwd_bwd": fb._asdict(),
            "fwd": fo._asdict(),
        }
    model.zero_grad(set_to_none=True)
    return out


def hub_kernels_env_on() -> bool:
    """Whether ``from_pretrained`` would kernelize by default: ``USE_HUB_KERNELS`` unset or true (transformers 5.25
    reads it with ``is_env_variable_true(..., default="YES")``)."""
    return os.environ.get("USE_HUB_KERNELS", "YES").lower() in ("true", "1", "y", "yes", "on")


def hub_kernels_plan(device) -> dict:
    """Hub kernels in this check: which parts run with them, and whether the exactness rows also run with them on
    (``why_not`` says why not)."""
    import transformers

    try:
        import kernels
    except ImportError:
        kernels = None
    version = getattr(kernels, "__version__", None)
    why = None
    if device.type != "cuda":
        why = "no CUDA: transformers' kernel mapping has no kernel for a CPU (nothing would be replaced)"
    elif not hasattr(transformers.PreTrainedModel, "set_use_kernels"):
        why = f"transformers {transformers.__version__} has no set_use_kernels"
    elif kernels is None:
        why = "the kernels package is not installed"
    elif not hub_kernels_env_on():
        why = f"USE_HUB_KERNELS={os.environ['USE_HUB_KERNELS']} turns them off"
    return {
        "USE_HUB_KERNELS": os.environ.get("USE_HUB_KERNELS"),
        "kernels": version,
        "from_pretrained_default": hub_kernels_env_on() and hasattr(transformers.PreTrainedModel, "set_use_kernels"),
        "other_parts": "off (their models are built from configs: from_pretrained's default does not apply)",
        "both_ways": why is None,
        "why_not": why,
    }


def exactness_rows_with_kernels(name: str, model, rr: RouterReplay, x: torch.Tensor, memory: int | None) -> list[dict]:
    """The exactness rows again with transformers' Hub kernels on (``set_use_kernels(True)`` in inference mode, as
    ``from_pretrained`` does by default on CUDA from 5.25), then off again. Each row says how many layers a kernel
    replaced (None: the installed ``kernels`` cannot tell). Kernels that cannot load (no Hub access and none cached)
    give one "unavailable" row."""
    model.eval()
    try:
        model.set_use_kernels(True)
    except Exception as exc:
        return [
            {
                "width": name,
                "experts_impl": "every",
                "hub_kernels": True,
                "unavailable": f"Hub kernels did not load: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
            }
        ]
    try:
        replaced = hub_kernel_layers(model)
        rows = exactness_rows(name, model, rr, x, memory)
    finally:
        model.reset_kernels()
    for row in rows:
        row.update(hub_kernels=True, kernelized_layers=None if replaced is None else len(replaced))
    return rows


def part_widths(sizes: Sizes, device, budgets: dict, results: dict) -> None:
    """exactness, syncs and timing share one model per width (building Mixtral's layer is the costly bit)."""
    clocks = {part: Budget(budgets[part]) for part in ("exactness", "syncs", "timing")}
    for part in clocks:
        results[part] = {"rows": []}
    kernels = results["hub_kernels"] = hub_kernels_plan(device)
    for key in MODELS:
        if all(clock.spent() for clock in clocks.values()):
            break
        with clocks["exactness"].charge():  # building the model is charged to the first part that uses it
            name, model = width_model(key, sizes, device)
            rr = RouterReplay(model)
            x = tokens(sizes.batch, sizes.seq, device)
        if not clocks["exactness"].spent():
            with clocks["exactness"].charge():
                off = exactness_rows(name, model, rr, x, free_memory(device))
                results["exactness"]["rows"] += [{**row, "hub_kernels": False} for row in off]
                if kernels["both_ways"]:
                    results["exactness"]["rows"] += exactness_rows_with_kernels(
                        name, model, rr, x, free_memory(device)
                    )
        for part, row in replay_costs(name, model, rr, x, device, sizes.rounds, clocks).items():
            results[part]["rows"].append(row)
        del model, rr
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for part, clock in clocks.items():
        results[part]["timed_out"] = clock.ran_out


def quiet_timer(fn, device):
    """``fn`` as an ``abba_pairs`` side: seeded with the round, garbage collected before and collection paused during
    the call, the device synchronised before and after (the clock sees the device's work and only this call's)."""

    def run(round_: int) -> float:
        torch.manual_seed(1000 + round_)
        gc.collect()
        sync(device)
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            sync(device)
            return time.perf_counter() - start
        finally:
            gc.enable()

    return run


def part_generate(sizes: Sizes, device, budget: Budget) -> dict:
    """``generate`` inside ``record()`` vs plain: the same seed per round on both sides and ``min_new_tokens`` =
    ``max_new_tokens``, so both sample the same tokens and lengths; ABBA pairs, the median ratio and its spread."""
    hidden, layers, experts, top_k = sizes.gen_model
    model = generation_model(sizes, layers, device, dtype=sizes.dtype)
    rr = RouterReplay(model)
    prompts = tokens(sizes.gen_prompts, sizes.gen_prompt_len, device)
    kwargs = dict(
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=sizes.gen_new_tokens,
        min_new_tokens=sizes.gen_new_tokens,
        do_sample=True,
    )
    lengths = {"plain": set(), "recorded": set()}

    def plain():
        with torch.no_grad():
            lengths["plain"].add(model.generate(prompts, **kwargs).shape[1] - prompts.shape[1])

    def recorded():
        with torch.no_grad(), rr.record():
            lengths["recorded"].add(model.generate(prompts, **kwargs).shape[1] - prompts.shape[1])

    with budget.charge():
        times = abba_pairs(
            {"plain": quiet_timer(plain, device), "recorded": quiet_timer(recorded, device)},
            sizes.gen_pairs,
            warmup=sizes.gen_warmup,
            keep_going=lambda: not budget.spent(),
        )
        syncs_plain, syncs_recorded = count_syncs(plain, device), count_syncs(recorded, device)
    out = {
        "model": dict(
            hidden=hidden,
            layers=layers,
            experts=experts,
            top_k=top_k,
            parameters=sum(p.numel() for p in model.parameters()),
        ),
        "prompts": sizes.gen_prompts,
        "new_tokens": sizes.gen_new_tokens,
        "new_tokens_seen": {side: sorted(seen) for side, seen in lengths.items()},
        "warmup": sizes.gen_warmup,
        "sync_counter": SYNC_COUNTERS["cuda" if device.type == "cuda" else "cpu"],
        "syncs_plain": syncs_plain,
        "syncs_recorded": syncs_recorded,
        "timed_out": len(times["plain"]) < sizes.gen_pairs,
    }
    if times["plain"]:
        out["recording_over_plain"] = pair_spread(times, "plain", "recorded")._asdict()
    return out


def sampler_vs_trainer(model, rr: RouterReplay, prompts: torch.Tensor, new_tokens: int) -> dict:
    """One sampled batch: the sampler's raw-logit log-probs and routes vs a full forward, natural and replaying."""
    width = prompts.shape[1]
    with torch.no_grad(), rr.record() as rec:
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    sequences = out.sequences
    completion = sequences[:, width:]
    raw = torch.stack(out.logits, dim=1).float()  # [B, N, V], before any logits processor
    sampler = torch.log_softmax(raw, dim=-1).gather(-1, completion[..., None]).squeeze(-1)
    engine_routes = rec.routes  # [B, P + N, L, K]; the last column ("never fed forward") holds no route
    mask = torch.ones_like(completion)
    positions = torch.zeros(sequences.shape, dtype=torch.bool)
    positions[:, width - 1 : -1] = True  # the positions whose logits chose a completion token
    row = {"tokens": completion.numel()}
    for side in ("none", "r3"):
        with (
            torch.no_grad(),
            rr.record() as trainer_rec,
            rr.replay(rec.checked) if side == "r3" else contextlib.nullcontext(),
        ):
            logits = model(sequences).logits[:, width - 1 : -1].float()
        trainer = torch.log_softmax(logits, dim=-1).gather(-1, completion[..., None]).squeeze(-1)
        d = trainer - sampler
        sums = logprob_mismatch_sums(sampler, trainer, mask, extreme_threshold=2.0)
        row[side] = {
            "kl_k3": (sums["kl_k3"] / sums["tokens"]).item(),
            "mean_abs_dlogp": d.abs().mean().item(),
            "max_abs_dlogp": d.abs().max().item(),
        }
        if side == "none":  # the trainer's natural top-k vs the sampler's, where the sampler chose a token
            agree = routing_agreement_sums(trainer_rec.routes, engine_routes, positions, rr.moe_layers)
            row["router_decisions_differ"] = (agree["mismatch_pairs"] / agree["pairs"]).item()
            row["tokens_any_layer_differs"] = (agree["tokens_any_mismatch"] / agree["tokens"]).item()
    return row


def part_sampler(sizes: Sizes, device, budget: Budget) -> dict:
    hidden, _layers, experts, top_k = sizes.gen_model
    rows = []
    for depth in sizes.sampler_depths:
        if budget.spent():
            break
        with budget.charge():
            model = generation_model(sizes, depth, device, dtype=sizes.dtype)
            rr = RouterReplay(model)
            torch.manual_seed(depth)
            row = sampler_vs_trainer(
                model,
                rr,
                tokens(sizes.gen_prompts, sizes.gen_prompt_len, device, seed=depth),
                sizes.sampler_new_tokens,
            )
        rows.append({"layers": depth, **row})
        del model, rr
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"model": dict(hidden=hidden, experts=experts, top_k=top_k), "rows": rows, "timed_out": budget.ran_out}


def completion_length(completions, **kwargs) -> list[float]:
    """A reward that needs no answer key: the GRPO part times steps, it does not teach anything."""
    return [float(len(completion)) for completion in completions]


# The GRPO sides, like for like. On the transformers path with this on-policy config (num_iterations=1, one step per
# generation) plain TRL runs no old-logprob pass; R3's default importance-sampling correction makes TRL run one (the
# trainer's log-probs to weigh the sampler's), and routing_metrics without the correction runs a metrics pass of the
# same size. So "none" and "r3" run neither (metrics off, correction off), and "r3 + correction" adds the correction
# alone: r3/none is what replay costs a step, r3 + correction / r3 what the correction costs.
GRPO_SIDES = {
    "none": dict(routing_replay="none", routing_metrics=False),
    "r3": dict(routing_replay="r3", routing_metrics=False, transformers_importance_sampling_correction=False),
    "r3_correction": dict(
        routing_replay="r3", routing_metrics=False, transformers_importance_sampling_correction=True
    ),
}
GRPO_RATIOS = {  # row name: (baseline, candidate)
    "r3_over_none": ("none", "r3"),
    "correction_cost": ("r3", "r3_correction"),
}


def grpo_trainer(sizes: Sizes, device, options: dict):
    """A ``MoEReplayGRPOTrainer`` set up for ``_harness.one_cycle`` (outside ``Trainer.train``), its first batch and
    its output folder. Every side gets the same weights (seeded) in ``sizes.dtype``."""
    from datasets import Dataset

    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer

    torch.manual_seed(0)
    model = generation_model(sizes, sizes.gen_model[1], device, router_aux_loss_coef=0.0, dtype=sizes.dtype)
    output_dir = tempfile.TemporaryDirectory()  # save_strategy "no": the folder holds the run's lock only
    config = MoEReplayGRPOConfig(
        output_dir=output_dir.name,
        use_cpu=device.type == "cpu",
        bf16=sizes.dtype == torch.bfloat16,
        report_to="none",
        per_device_train_batch_size=sizes.grpo_batch,
        num_generations=sizes.grpo_generations,
        max_completion_length=sizes.grpo_completion,
        num_iterations=1,
        gradient_accumulation_steps=1,
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **options,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    trainer = MoEReplayGRPOTrainer(
        model=model,
        reward_funcs=completion_length,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which is bypassed
    return trainer, next(iter(trainer.get_train_dataloader())), output_dir


def whole_sequence_pass(args, kwargs) -> bool:
    """A forward outside autograd over more than one position: generate's prefill, or a scoring pass (TRL's
    old-logprob pass, the routing-metrics pass); decode steps feed one position, the training forward has grad."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return not torch.is_grad_enabled() and ids is not None and ids.shape[-1] > 1


def part_grpo(sizes: Sizes, device, budget: Budget) -> dict:
    """One GRPO cycle per side and round (generation, the passes its config runs, loss and backward; no optimizer
    step, so every side's model stays the same), the sides alive side by side and timed in ABBA pairs."""
    built = {}
    try:
        with budget.charge():
            for name, options in GRPO_SIDES.items():
                built[name] = grpo_trainer(sizes, device, options)
            passes = {name: [] for name in built}  # no-grad forwards over whole sequences per cycle, per side

            def synced_clock() -> float:
                sync(device)
                return time.perf_counter()

            def side(name):
                trainer, batch, _ = built[name]
                seen = []
                trainer.model.register_forward_pre_hook(
                    lambda module, args, kwargs: seen.append(whole_sequence_pass(args, kwargs)), with_kwargs=True
                )

                def run(round_: int) -> float:
                    gc.collect()
                    seen.clear()
                    took = one_cycle(trainer, batch, 1000 + round_, clock=synced_clock)
                    passes[name].append(sum(seen) - 1)  # less generate's prefill
                    return took

                return run

            times = abba_pairs(
                {name: side(name) for name in built}, sizes.grpo_pairs, keep_going=lambda: not budget.spent()
            )
    finally:
        for trainer, _, output_dir in built.values():
            trainer.end()  # releases the output_dir lock before the folder goes
            output_dir.cleanup()
        built.clear()  # drops the trainers before the cache empties
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hidden, layers, experts, top_k = sizes.gen_model
    result = {
        "model": dict(hidden=hidden, layers=layers, experts=experts, top_k=top_k),
        "batch": sizes.grpo_batch,
        "completion": sizes.grpo_completion,
        "sides": {name: {**GRPO_SIDES[name], "extra_forwards": max(passes[name])} for name in GRPO_SIDES},
        "cycle_s": times,
        "timed_out": len(times["none"]) < sizes.grpo_pairs,
    }
    if times["none"]:
        for row, (baseline, candidate) in GRPO_RATIOS.items():
            result[row] = pair_spread(times, baseline, candidate)._asdict()
    return result


EP_SCRIPT = Path(__file__).resolve().parent / "ep_overhead.py"


def part_expert_parallel(smoke: bool, budget_s: float) -> dict:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if smoke or gpus < 2:
        why = f"needs at least 2 GPUs, this machine has {gpus}"
        return {
            "skipped": why + ("; smoke mode (bench/ep_overhead.py measures EP on CPU processes)" if smoke else ""),
            "gpus": gpus,
        }
    processes = min(gpus, 8)
    out = Path(tempfile.mkdtemp()) / "ep_overhead.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        str(EP_SCRIPT),
        "--device",
        "cuda",
        "--hidden",
        "1024",
        "--layers",
        "8",
        "--experts",
        "64",
        "--top-k",
        "8",
        "--completion",
        "64",
        "--batch",
        "16",
        "--steps",
        "4",
        "--rounds",
        "2",
        "--json",
        str(out),
    ]
    import subprocess

    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"gpus": gpus, "timed_out": True}
    if run.returncode != 0 or not out.is_file():
        return {"gpus": gpus, "error": f"bench/ep_overhead.py exited {run.returncode}: {run.stderr[-300:]}"}
    return {"gpus": gpus, "timed_out": False, **json.loads(out.read_text())}


# ----------------------------------------------------------------------------- report
def environment(device) -> dict:
    import accelerate
    import transformers
    import trl

    import trl_moe_replay

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "trl_moe_replay": trl_moe_replay.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "USE_HUB_KERNELS": os.environ.get("USE_HUB_KERNELS"),
    }


def table(results: dict) -> list[tuple[str, str, str]]:
    rows = []
    kernels = results.get("hub_kernels")
    if kernels:
        env = kernels["USE_HUB_KERNELS"]
        rows.append(
            (
                "hub_kernels",
                "state",
                f"exactness: {'off and on' if kernels['both_ways'] else 'off'}"
                f"{'' if kernels['both_ways'] else ' (' + kernels['why_not'] + ')'}; other parts "
                f"{kernels['other_parts']}; USE_HUB_KERNELS={'unset' if env is None else env}, kernels "
                f"{kernels['kernels'] or 'not installed'}",
            )
        )
    for row in results.get("exactness", {}).get("rows", []):
        if "does_not_fit" in row:
            result = does_not_fit(row["does_not_fit"])
        else:
            result = row.get("unavailable") or (
                f"own routes {fmt(row['own_routes_max_diff'])}, other routes {fmt(row['other_routes_max_diff'])}"
            )
        on = ", hub kernels on" + (
            f" ({row['kernelized_layers']} layers replaced)" if row.get("kernelized_layers") is not None else ""
        )
        rows.append(
            ("exactness", f"{row['width']} {row['experts_impl']}{on if row.get('hub_kernels') else ''}", result)
        )
    proxy = "" if results.get("mode") == "full" else " (host reads, CPU proxy)"
    for row in results.get("syncs", {}).get("rows", []):
        rows.append(
            ("syncs", f"{row['width']} fwd+bwd", f"natural {fmt(row['natural'])}, replay {fmt(row['replay'])}{proxy}")
        )
    for row in results.get("timing", {}).get("rows", []):
        for kind, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
            r = row[kind]
            rows.append(
                (
                    "timing",
                    f"{row['width']} {label} replay/natural",
                    f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f}); {r['baseline'] * 1e3:.1f}/"
                    f"{r['candidate'] * 1e3:.1f} ms",
                )
            )
    gen = results.get("generate", {})
    if "recording_over_plain" in gen:
        r = gen["recording_over_plain"]
        rows.append(
            (
                "generate",
                "recording/plain",
                f"{spread(r)}; {r['baseline'] * 1e3:.0f}/{r['candidate'] * 1e3:.0f} ms; syncs per call "
                f"{fmt(gen['syncs_plain'])} -> {fmt(gen['syncs_recorded'])}{proxy}",
            )
        )
    for row in results.get("sampler", {}).get("rows", []):
        rows.append(
            (
                "sampler",
                f"{row['layers']} layers",
                f"routers differ {row['router_decisions_differ']:.2%}, "
                f"tokens {row['tokens_any_layer_differs']:.1%}"
                f"; KL k3 {row['none']['kl_k3']:.3g} -> {row['r3']['kl_k3']:.3g}; max abs(dlogp) "
                f"{row['none']['max_abs_dlogp']:.3f} -> {row['r3']['max_abs_dlogp']:.3f}",
            )
        )
    grpo = results.get("grpo", {})
    for key, case in (
        ("r3_over_none", "cycle r3/none, no correction"),
        ("correction_cost", "IS correction: r3 with/without"),
    ):
        if key in grpo:
            r = grpo[key]
            rows.append(("grpo", case, f"{spread(r)}; {r['baseline'] * 1e3:.0f}/{r['candidate'] * 1e3:.0f} ms"))
    ep = results.get("expert_parallel", {})
    if "skipped" in ep:
        rows.append(("expert_parallel", "skipped", ep["skipped"]))
    elif "ep_over_ddp" in ep:
        r = ep["ep_over_ddp"]
        rows.append(
            (
                "expert_parallel",
                f"R3 step EP/DDP, {ep['processes']} GPUs",
                f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f})",
            )
        )
    for part, value in results.items():
        if isinstance(value, dict) and value.get("error"):
            rows.append((part, "ERROR", value["error"]))
        elif isinstance(value, dict) and value.get("timed_out"):
            rows.append((part, "timed out", f"budget spent; {part} is partial"))
    return rows


def spread(r: dict) -> str:
    """A ``PairSpread``: median (min-max, interquartile range) over n ABBA pairs."""
    return (
        f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f}, IQR {r['q1']:.3f}-{r['q3']:.3f}, {r['pairs']} ABBA pairs)"
    )


def does_not_fit(row: dict) -> str:
    if row["estimated"]:
        return (
            f"does not fit at this size: needs {gib(row['needs_bytes'])} for one tensor, "
            f"{gib(row['memory_bytes'])} free"
        )
    return f"does not fit at this size: {row['message']}"


def print_table(results: dict, env: dict) -> None:
    print(
        f"\nGPU check, {env['device']}; torch {env['torch']}, transformers {env['transformers']}, TRL {env['trl']}; "
        f"{env['date']}"
    )
    print("| part | case | result |\n|---|---|---|")
    for part, case, result in table(results):
        print(f"| {part} | {case} | {result} |")


def failures(results: dict) -> list[str]:
    problems = [
        f"{part}: {value['error']}"
        for part, value in results.items()
        if isinstance(value, dict) and value.get("error")
    ]
    rows = results.get("exactness", {}).get("rows", [])
    for width in sorted({row["width"] for row in rows}):
        if all("unavailable" in row or "does_not_fit" in row for row in rows if row["width"] == width):
            problems.append(f"no experts implementation could run {width}")
    for row in rows:
        if "unavailable" in row or "does_not_fit" in row:
            continue
        which = f"{row['width']} {row['experts_impl']}{' (hub kernels on)' if row.get('hub_kernels') else ''}"
        if row["own_routes_max_diff"] != 0:
            problems.append(f"replaying its own routes changed {which}'s logits")
        if not row["other_routes_max_diff"] > 0:
            problems.append(f"other routes left {which}'s logits unchanged")
    return problems


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: proves the code path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; the full check needs one GPU (run --smoke for the tiny CPU run)")
        return NO_CUDA_EXIT
    device = torch.device("cpu" if args.smoke else "cuda")
    sizes = SMOKE if args.smoke else FULL
    torch.manual_seed(0)
    started = time.monotonic()
    results: dict = {"mode": "smoke" if args.smoke else "full", "sizes": asdict(sizes)}
    parts = [
        (("exactness", "syncs", "timing"), lambda: part_widths(sizes, device, sizes.budgets, results)),
        (
            ("generate",),
            lambda: results.__setitem__("generate", part_generate(sizes, device, Budget(sizes.budgets["generate"]))),
        ),
        (
            ("sampler",),
            lambda: results.__setitem__("sampler", part_sampler(sizes, device, Budget(sizes.budgets["sampler"]))),
        ),
        (("grpo",), lambda: results.__setitem__("grpo", part_grpo(sizes, device, Budget(sizes.budgets["grpo"])))),
        (
            ("expert_parallel",),
            lambda: results.__setitem__(
                "expert_parallel", part_expert_parallel(args.smoke, sizes.budgets["expert_parallel"])
            ),
        ),
    ]
    for names, run in parts:
        part_start = time.monotonic()
        try:
            run()
        except Exception as exc:  # recorded; the other parts still run
            traceback.print_exc()
            for name in names:
                results.setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"[:300]
        for name in names:
            results.setdefault(name, {})["seconds"] = round(time.monotonic() - part_start, 1)
        print(f"gpu_check: {'/'.join(names)} done in {time.monotonic() - part_start:.0f} s", flush=True)
    results["seconds"] = round(time.monotonic() - started, 1)
    env = results["environment"] = environment(device)
    problems = results["failures"] = failures(results)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print_table(results, env)
    print(f"total {results['seconds']:.0f} s; JSON: {args.out}" + "".join(f"\nFAILED: {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
