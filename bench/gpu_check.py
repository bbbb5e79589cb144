"""The GPU check: what holds for routing replay on one CUDA GPU, in one command (``make gpu-check``).

Parts (methods of the first GPU run, kept here so that the next run measures the same things):

  exactness  Per published width (Qwen3-30B-A3B, OLMoE-1B-7B: 2 decoder layers; Mixtral-8x7B: 1) and per experts
             implementation the installed transformers offers: max abs(logit diff) of replaying the routes a
             natural no-grad forward recorded (must be 0), and of replaying shifted routes (a control: must differ).
  syncs      Host synchronisations over one forward+backward, natural vs replay (``torch.cuda.set_sync_debug_mode``
             counting its warnings), per width.
  timing     replay/natural for the forward (no_grad) and forward+backward, per width: ABBA rounds
             (``_harness.interleaved_ratio``), ``cuda.synchronize()`` closing each timed call; median (min-max).
             Replay as the trainer does it: each call replays a micro-batch's rows of ``CheckedRoutes`` (no host
             pass; the routes copied to the GPU per call).
  generate   ``generate`` inside ``RouterReplay.record()`` vs plain (sampled, ABBA), and host syncs per call.
  sampler    Sampler vs trainer at depth: transformers ``generate`` in bf16 is the sampler (its raw logits,
             ``output_logits=True``), one full forward over prompt+completion is the trainer, natural (none) or
             replaying the recorded routes (R3). Router decisions that differ, tokens with any differing layer,
             KL k3 and max abs(d logp), d = trainer - sampler log-prob of the sampled token.
  grpo       A few GRPO steps of ``MoEReplayGRPOTrainer`` (transformers generate, bf16), routing_replay none vs r3
             in ABBA order; median step time of the steps after the first, and the ratio r3/none.
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
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, real_shapes (also when imported by a test)

from _harness import bench_moe, interleaved_ratio, timer  # noqa: E402
from real_shapes import MODELS  # noqa: E402

from trl_moe_replay.routing import RouterReplay  # noqa: E402
from trl_moe_replay.routing.routes import has_route  # noqa: E402
from trl_moe_replay.testing import TINY_VOCAB_SIZE, tiny_moe_model, tiny_tokenizer  # noqa: E402
from trl_moe_replay.trainer.metrics import logprob_mismatch_sums, routing_agreement_sums  # noqa: E402

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
    gen_new_tokens: int
    sampler_depths: tuple
    sampler_new_tokens: int
    grpo_batch: int
    grpo_generations: int
    grpo_completion: int
    grpo_steps: int
    dtype: torch.dtype  # of the models (the GRPO trainer's precision: bf16 when bfloat16)
    grpo_runs: tuple  # routing_replay of each GRPO run, in order (ABBA)
    budgets: dict  # seconds per part


FULL = Sizes(
    width_dims={key: {} for key in MODELS}, width_layers={"qwen3": 2, "olmoe": 2, "mixtral": 1},
    batch=4, seq=4096, rounds=6,
    gen_model=(1024, 8, 64, 8), gen_prompts=64, gen_prompt_len=12, gen_new_tokens=64,
    sampler_depths=(8, 24, 48), sampler_new_tokens=128,
    grpo_batch=64, grpo_generations=8, grpo_completion=64, grpo_steps=6, dtype=torch.bfloat16,
    grpo_runs=("none", "r3", "r3", "none"),
    budgets=dict(exactness=40, syncs=15, timing=60, generate=25, sampler=70, grpo=70, expert_parallel=240),
)
_TINY_WIDTH = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                   moe_intermediate_size=32, intermediate_size=64)
SMOKE = Sizes(
    width_dims={"qwen3": {**_TINY_WIDTH, "num_experts": 8}, "olmoe": {**_TINY_WIDTH, "num_experts": 8},
                "mixtral": {**_TINY_WIDTH, "num_local_experts": 8}},
    width_layers={"qwen3": 2, "olmoe": 2, "mixtral": 1},
    batch=2, seq=32, rounds=2,
    gen_model=(64, 2, 8, 2), gen_prompts=4, gen_prompt_len=6, gen_new_tokens=6,
    sampler_depths=(2, 4), sampler_new_tokens=8,
    grpo_batch=8, grpo_generations=4, grpo_completion=6, grpo_steps=2, dtype=torch.float32,
    grpo_runs=("none", "r3"),
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

    @contextlib.contextmanager
    def charge(self):
        start = time.monotonic()
        try:
            yield
        finally:
            self.used += time.monotonic() - start

    def spent(self) -> bool:
        self.ran_out = self.ran_out or self.used > self.seconds
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


def count_syncs(fn, device) -> int | None:
    """Host synchronisations ``fn`` causes (CUDA's sync debug mode warns once per sync); None off CUDA."""
    if device.type != "cuda":
        fn()
        return None
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
        model = tiny_moe_model(model_type, num_hidden_layers=sizes.width_layers[key], max_position_embeddings=32768,
                               router_aux_loss_coef=0.0, attn_implementation="sdpa", dtype=sizes.dtype,
                               **{**dims, **sizes.width_dims[key]})
    return name, model


def generation_model(sizes: Sizes, layers: int, device, **overrides):
    """The generate / sampler / GRPO model: at full size a 430M-parameter Qwen3-MoE at 8 layers (hidden 1,024,
    64 experts top-8, experts 256 wide, 8 attention heads), as in the first GPU run."""
    hidden, _layers, experts, top_k = sizes.gen_model
    with torch.device(device):
        return bench_moe(hidden, layers, experts, top_k, moe_intermediate_size=hidden // 4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=hidden // 8, **overrides)


def tokens(batch: int, length: int, device, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(6, TINY_VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


def fmt(value, digits=3):
    return "n/a" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------------------- parts
def exactness_rows(name: str, model, rr: RouterReplay, x: torch.Tensor) -> list[dict]:
    """Per experts implementation: max abs(logit diff) of replaying the model's own routes, and other routes."""
    rows = []
    model.eval()
    for impl in experts_implementations():
        row = {"width": name, "experts_impl": impl}
        try:  # only the implementation's own natural forward decides whether this machine can run it
            model.set_experts_implementation(impl)
            with torch.no_grad(), rr.record() as rec:
                natural = model(x).logits
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
        row.update(own_routes_max_diff=(own - natural).abs().max().item(),
                   other_routes_max_diff=(other - natural).abs().max().item())
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
        out["timing"] = {"width": name, "experts_impl": DEFAULT_EXPERTS, "tokens": x.numel(), "fwd_bwd": fb._asdict(),
                         "fwd": fo._asdict()}
    model.zero_grad(set_to_none=True)
    return out


def part_widths(sizes: Sizes, device, budgets: dict, results: dict) -> None:
    """exactness, syncs and timing share one model per width (building Mixtral's layer is the costly bit)."""
    clocks = {part: Budget(budgets[part]) for part in ("exactness", "syncs", "timing")}
    for part in clocks:
        results[part] = {"rows": []}
    for key in MODELS:
        if all(clock.spent() for clock in clocks.values()):
            break
        with clocks["exactness"].charge():  # building the model is charged to the first part that uses it
            name, model = width_model(key, sizes, device)
            rr = RouterReplay(model)
            x = tokens(sizes.batch, sizes.seq, device)
        if not clocks["exactness"].spent():
            with clocks["exactness"].charge():
                results["exactness"]["rows"] += exactness_rows(name, model, rr, x)
        for part, row in replay_costs(name, model, rr, x, device, sizes.rounds, clocks).items():
            results[part]["rows"].append(row)
        del model, rr
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for part, clock in clocks.items():
        results[part]["timed_out"] = clock.ran_out


def part_generate(sizes: Sizes, device, budget: Budget) -> dict:
    hidden, layers, experts, top_k = sizes.gen_model
    model = generation_model(sizes, layers, device, dtype=sizes.dtype)
    rr = RouterReplay(model)
    prompts = tokens(sizes.gen_prompts, sizes.gen_prompt_len, device)
    kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=sizes.gen_new_tokens,
                  min_new_tokens=sizes.gen_new_tokens, do_sample=True)

    def plain():
        with torch.no_grad():
            model.generate(prompts, **kwargs)

    def recorded():
        with torch.no_grad(), rr.record():
            model.generate(prompts, **kwargs)

    with budget.charge():
        ratio = interleaved_ratio(timer(synced(plain, device)), timer(synced(recorded, device)), sizes.rounds)
    return {"model": dict(hidden=hidden, layers=layers, experts=experts, top_k=top_k,
                          parameters=sum(p.numel() for p in model.parameters())),
            "prompts": sizes.gen_prompts, "new_tokens": sizes.gen_new_tokens, "recording_over_plain": ratio._asdict(),
            "syncs_plain": count_syncs(plain, device), "syncs_recorded": count_syncs(recorded, device),
            "timed_out": budget.spent()}


def sampler_vs_trainer(model, rr: RouterReplay, prompts: torch.Tensor, new_tokens: int) -> dict:
    """One sampled batch: the sampler's raw-logit log-probs and routes vs a full forward, natural and replaying."""
    width = prompts.shape[1]
    with torch.no_grad(), rr.record() as rec:
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True)
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
        with torch.no_grad(), rr.record() as trainer_rec, \
                rr.replay(rec.checked) if side == "r3" else contextlib.nullcontext():
            logits = model(sequences).logits[:, width - 1 : -1].float()
        trainer = torch.log_softmax(logits, dim=-1).gather(-1, completion[..., None]).squeeze(-1)
        d = trainer - sampler
        sums = logprob_mismatch_sums(sampler, trainer, mask, extreme_threshold=2.0)
        row[side] = {"kl_k3": (sums["kl_k3"] / sums["tokens"]).item(), "mean_abs_dlogp": d.abs().mean().item(),
                     "max_abs_dlogp": d.abs().max().item()}
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
            row = sampler_vs_trainer(model, rr, tokens(sizes.gen_prompts, sizes.gen_prompt_len, device, seed=depth),
                                     sizes.sampler_new_tokens)
        rows.append({"layers": depth, **row})
        del model, rr
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"model": dict(hidden=hidden, experts=experts, top_k=top_k), "rows": rows, "timed_out": budget.ran_out}


def completion_length(completions, **kwargs) -> list[float]:
    """A reward that needs no answer key: the GRPO part times steps, it does not teach anything."""
    return [float(len(completion)) for completion in completions]


def grpo_run(sizes: Sizes, device, mode: str) -> list[float]:
    """Step durations (seconds, device-synchronised) of one short MoEReplayGRPOTrainer run."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.ends:
                sync(device)
                self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            self.ends.append(time.perf_counter())

    model = generation_model(sizes, sizes.gen_model[1], device, router_aux_loss_coef=0.0)
    output_dir = tempfile.TemporaryDirectory()  # save_strategy "no": the folder holds the run's lock only
    config = MoEReplayGRPOConfig(
        output_dir=output_dir.name, use_cpu=device.type == "cpu", bf16=sizes.dtype == torch.bfloat16,
        report_to="none", routing_replay=mode, max_steps=sizes.grpo_steps,
        per_device_train_batch_size=sizes.grpo_batch,
        num_generations=sizes.grpo_generations, max_completion_length=sizes.grpo_completion, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0,
    )
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    clock = StepClock()
    trainer = MoEReplayGRPOTrainer(model=model, reward_funcs=completion_length, args=config,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}),
                                   processing_class=tiny_tokenizer(), callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # the check prints one table, not the training log
    trainer.train()
    trainer.end()  # releases the output_dir lock before the folder goes
    output_dir.cleanup()
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return steps


def part_grpo(sizes: Sizes, device, budget: Budget) -> dict:
    runs = {"none": [], "r3": []}
    for mode in sizes.grpo_runs:
        if budget.spent():
            break
        with budget.charge():
            steps = grpo_run(sizes, device, mode)
        if steps:  # the first step (warm-up) is left out when there are others
            runs[mode].append(statistics.median(steps[1:]) if len(steps) > 1 else steps[0])
    medians = {mode: statistics.median(times) for mode, times in runs.items() if times}
    ratio = medians["r3"] / medians["none"] if len(medians) == 2 else None
    hidden, layers, experts, top_k = sizes.gen_model
    return {"model": dict(hidden=hidden, layers=layers, experts=experts, top_k=top_k), "batch": sizes.grpo_batch,
            "completion": sizes.grpo_completion, "steps": sizes.grpo_steps, "median_step_s": runs,
            "r3_over_none": ratio, "timed_out": budget.ran_out}


EP_SCRIPT = Path(__file__).resolve().parent / "ep_overhead.py"


def part_expert_parallel(smoke: bool, budget_s: float) -> dict:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if smoke or gpus < 2:
        why = f"needs at least 2 GPUs, this machine has {gpus}"
        return {"skipped": why + ("; smoke mode (bench/ep_overhead.py measures EP on CPU processes)" if smoke else ""),
                "gpus": gpus}
    processes = min(gpus, 8)
    out = Path(tempfile.mkdtemp()) / "ep_overhead.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(EP_SCRIPT), "--device", "cuda", "--hidden", "1024", "--layers", "8", "--experts", "64",
               "--top-k", "8", "--completion", "64", "--batch", "16", "--steps", "4", "--rounds", "2",
               "--json", str(out)]
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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "trl": trl.__version__, "accelerate": accelerate.__version__, "trl_moe_replay": trl_moe_replay.__version__,
        "python": platform.python_version(), "command": " ".join(sys.argv),
    }


def table(results: dict) -> list[tuple[str, str, str]]:
    rows = []
    for row in results.get("exactness", {}).get("rows", []):
        result = row.get("unavailable") or (f"own routes {fmt(row['own_routes_max_diff'])}, other routes "
                                            f"{fmt(row['other_routes_max_diff'])}")
        rows.append(("exactness", f"{row['width']} {row['experts_impl']}", result))
    for row in results.get("syncs", {}).get("rows", []):
        rows.append(("syncs", f"{row['width']} fwd+bwd",
                     f"natural {fmt(row['natural'])}, replay {fmt(row['replay'])}"))
    for row in results.get("timing", {}).get("rows", []):
        for kind, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
            r = row[kind]
            rows.append(("timing", f"{row['width']} {label} replay/natural",
                         f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f}); {r['baseline'] * 1e3:.1f}/"
                         f"{r['candidate'] * 1e3:.1f} ms"))
    gen = results.get("generate", {})
    if "recording_over_plain" in gen:
        r = gen["recording_over_plain"]
        rows.append(("generate", "recording/plain", f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f}); syncs "
                                                    f"{fmt(gen['syncs_plain'])} -> {fmt(gen['syncs_recorded'])}"))
    for row in results.get("sampler", {}).get("rows", []):
        rows.append(("sampler", f"{row['layers']} layers",
                     f"routers differ {row['router_decisions_differ']:.2%}, "
                     f"tokens {row['tokens_any_layer_differs']:.1%}"
                     f"; KL k3 {row['none']['kl_k3']:.3g} -> {row['r3']['kl_k3']:.3g}; max abs(dlogp) "
                     f"{row['none']['max_abs_dlogp']:.3f} -> {row['r3']['max_abs_dlogp']:.3f}"))
    grpo = results.get("grpo", {})
    if grpo.get("r3_over_none") is not None:
        med = grpo["median_step_s"]
        rows.append(("grpo", "step r3/none", f"{grpo['r3_over_none']:.3f}; none "
                     + "/".join(f"{t * 1e3:.0f}" for t in med["none"]) + " ms, r3 "
                     + "/".join(f"{t * 1e3:.0f}" for t in med["r3"]) + " ms"))
    ep = results.get("expert_parallel", {})
    if "skipped" in ep:
        rows.append(("expert_parallel", "skipped", ep["skipped"]))
    elif "ep_over_ddp" in ep:
        r = ep["ep_over_ddp"]
        rows.append(("expert_parallel", f"R3 step EP/DDP, {ep['processes']} GPUs",
                     f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f})"))
    for part, value in results.items():
        if isinstance(value, dict) and value.get("error"):
            rows.append((part, "ERROR", value["error"]))
        elif isinstance(value, dict) and value.get("timed_out"):
            rows.append((part, "timed out", f"budget spent; {part} is partial"))
    return rows


def print_table(results: dict, env: dict) -> None:
    print(f"\nGPU check, {env['device']}; torch {env['torch']}, transformers {env['transformers']}, TRL {env['trl']}; "
          f"{env['date']}")
    print("| part | case | result |\n|---|---|---|")
    for part, case, result in table(results):
        print(f"| {part} | {case} | {result} |")


def failures(results: dict) -> list[str]:
    problems = [f"{part}: {value['error']}" for part, value in results.items()
                if isinstance(value, dict) and value.get("error")]
    rows = results.get("exactness", {}).get("rows", [])
    for width in sorted({row["width"] for row in rows}):
        if all("unavailable" in row for row in rows if row["width"] == width):
            problems.append(f"no experts implementation could run {width}")
    for row in rows:
        if "unavailable" in row:
            continue
        if row["own_routes_max_diff"] != 0:
            problems.append(f"replaying its own routes changed {row['width']} {row['experts_impl']}'s logits")
        if not row["other_routes_max_diff"] > 0:
            problems.append(f"other routes left {row['width']} {row['experts_impl']}'s logits unchanged")
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
        (("generate",), lambda: results.__setitem__("generate",
                                                    part_generate(sizes, device, Budget(sizes.budgets["generate"])))),
        (("sampler",), lambda: results.__setitem__("sampler",
                                                   part_sampler(sizes, device, Budget(sizes.budgets["sampler"])))),
        (("grpo",), lambda: results.__setitem__("grpo", part_grpo(sizes, device, Budget(sizes.budgets["grpo"])))),
        (("expert_parallel",), lambda: results.__setitem__("expert_parallel", part_expert_parallel(
            args.smoke, sizes.budgets["expert_parallel"]))),
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
