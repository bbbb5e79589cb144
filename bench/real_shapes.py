"""R3's cost at the published widths of real MoE models: a few decoder layers each, projected to the whole model.

For each model (Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B) the script builds a causal LM with the model's own
decoder-layer dimensions (hidden size, attention heads, expert count, top-k, expert width, gate normalisation) and
``--layers`` decoder layers (default 1): the width is never shrunk, the depth is. Vocabulary is the tiny test one
(the embedding and LM head are not part of a decoder layer). Side by side in this process, ABBA-interleaved
(``_harness.interleaved_ratio``; round 0 warms up), on one micro-batch of ``--tokens`` tokens:

  fwd+bwd   natural routing vs replay of the same (natural) routes, loss.backward() included. Gradients stay
            allocated between rounds (zeroed in place outside the timing), so no round re-allocates them.
  fwd       the same, forward only under no_grad (TRL's old-logprob and reference passes).
  hook      the router forward plus our replay hook (timed by hooks around the router module) vs the router alone.
  validate  ``validate_routes`` on the routes of the full-depth model (what ``RouterReplay.replay`` checks once per
            forward), per call.
  align     ``routes_from_engine`` on one sample's engine rows of the full-depth model vs a copy of the same bytes.

Bytes per routed token: engine rows ``L x K`` one-byte ids (uint8 up to 256 experts), 4/3 of that in base64 on the
wire; the compact routes in the batch are the same ``L x K`` bytes.

**Projection** (printed per model, method in docs/benchmarks.md): per token, the training side of a GRPO step
costs ``L x (t_fwdbwd + 2 t_fwd)`` (one training pass, old-logprob and reference passes) with natural routing;
R3 adds ``L x (dt_fwdbwd + 2 dt_fwd)`` (replay minus natural, per layer) plus alignment and validation.
The ratio of the two is R3's training-side overhead ``c_train``. vLLM publishes ~2% for capture on GPU
(``c_gen``); whatever the generation share ``w`` of a step, the whole step's overhead
``w c_gen + (1 - w) c_train`` lies between the two.

Memory: Mixtral-8x7B's layer holds 8 experts of 4096 x 14336 (5.6 GB in fp32); its gradients would double that.
With ``--freeze-experts mixtral`` (the default) the expert weights of Mixtral get no gradient (every other
parameter does): the fwd+bwd baseline then does less work, so its replay ratio is an upper bound.

    python bench/real_shapes.py                        # all three, 1 layer, 4096 tokens (long: minutes per model)
    python bench/real_shapes.py --models qwen3 --layers 2
    python bench/real_shapes.py --quick                # 1,024 tokens, 2 rounds: a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np
import torch
from _harness import interleaved_ratio, report, timer

from trl_moe_replay.routing import RouterReplay, routes_from_engine, validate_routes
from trl_moe_replay.routing.codec import engine_dtype
from trl_moe_replay.testing import TINY_VOCAB_SIZE, tiny_moe_model


# Published decoder-layer dimensions (the models' config.json on the Hub), and their full depth.
MODELS = {
    "qwen3": (
        "Qwen3-30B-A3B",
        "qwen3_moe",
        48,
        dict(
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": (
        "OLMoE-1B-7B",
        "olmoe",
        16,
        dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            num_experts=64,
            num_experts_per_tok=8,
            intermediate_size=1024,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        "Mixtral-8x7B",
        "mixtral",
        32,
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=14336,
        ),
    ),
}
VLLM_PUBLISHED_CAPTURE = 0.02  # vLLM's reported cost of routed-experts capture on GPU


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--layers", type=int, default=1, help="decoder layers built (the width is never shrunk)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (one sequence)")
    parser.add_argument("--rounds", type=int, default=3, help="timed ABBA rounds per comparison")
    parser.add_argument(
        "--freeze-experts",
        nargs="*",
        choices=sorted(MODELS),
        default=["mixtral"],
        help="models whose expert weights get no gradient (memory; see above)",
    )
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.rounds = 1024, 2
    return args


def build(key: str, layers: int, freeze_experts: bool):
    name, model_type, full_depth, dims = MODELS[key]
    model = tiny_moe_model(
        model_type,
        num_hidden_layers=layers,
        max_position_embeddings=32768,
        router_aux_loss_coef=0.0,
        attn_implementation="sdpa",
        **dims,
    ).train()
    if freeze_experts:
        for module_name, param in model.named_parameters():
            if ".experts." in module_name:
                param.requires_grad_(False)
    return name, full_depth, model


def router_timer(replay: RouterReplay):
    """Seconds spent in the routers' forwards including every forward hook on them (replay's among them)."""
    spent = [0.0]
    handles = []
    for router in replay.routers().values():
        starts = []  # this router's own (bound per hook: each router pairs its start with its end)
        handles.append(
            router.register_forward_pre_hook(
                lambda m, a, starts=starts: starts.append(time.perf_counter()), prepend=True
            )
        )
        handles.append(
            router.register_forward_hook(
                lambda m, a, o, starts=starts: spent.__setitem__(0, spent[0] + time.perf_counter() - starts.pop())
            )
        )
    return spent, handles


def measure_model(key: str, args) -> dict:
    name, full_depth, model = build(key, args.layers, key in args.freeze_experts)
    config = model.config
    top_k, experts = config.num_experts_per_tok, getattr(config, "num_experts", None) or config.num_local_experts
    replay = RouterReplay(model)
    x = torch.randint(6, TINY_VOCAB_SIZE, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), replay.record() as recording:
        model(x)
    routes = recording.routes
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n{name}: {args.layers} of {full_depth} layers at full width (hidden {config.hidden_size}, {experts} "
        f"experts top-{top_k}), {params / 1e9:.2f} B parameters fp32, {args.tokens} tokens"
        + ("; expert weights frozen" if key in args.freeze_experts else ""),
        flush=True,
    )

    def fwd_bwd(replayed: bool):
        def run():
            if replayed:
                with replay.replay(routes):
                    model(x, labels=x).loss.backward()
            else:
                model(x, labels=x).loss.backward()

        return run

    def fwd(replayed: bool):
        def run():
            with torch.no_grad():
                if replayed:
                    with replay.replay(routes):
                        model(x)
                else:
                    model(x)

        return run

    def zeroed(fn):  # gradients stay allocated (first call allocates them, in the warm-up round); zeroed untimed
        def run(round_):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            return timer(fn)(round_)

        return run

    result = {"name": name, "L": full_depth, "K": top_k, "E": experts, "layers": args.layers}
    fb = interleaved_ratio(zeroed(fwd_bwd(False)), zeroed(fwd_bwd(True)), args.rounds)
    print(
        f"  fwd+bwd  natural {fb.baseline:.2f}s replay {fb.candidate:.2f}s: replay/natural {fb.median:.3f} "
        f"(min {fb.low:.3f}, max {fb.high:.3f})",
        flush=True,
    )
    report(f"{name} replay fwd+bwd / natural ({args.layers} layer, {args.tokens} tokens)", fb.median, 1.00)
    fo = interleaved_ratio(timer(fwd(False)), timer(fwd(True)), args.rounds)
    print(
        f"  fwd      natural {fo.baseline:.2f}s replay {fo.candidate:.2f}s: replay/natural {fo.median:.3f} "
        f"(min {fo.low:.3f}, max {fo.high:.3f})",
        flush=True,
    )
    model.zero_grad(set_to_none=True)

    spent, handles = router_timer(replay)
    hook_times = {False: [], True: []}
    for round_ in range(2 * args.rounds + 1):
        for replayed in (False, True) if round_ % 2 else (True, False):
            spent[0] = 0.0
            fwd(replayed)()
            if round_:
                hook_times[replayed].append(spent[0] / args.layers)
    for handle in handles:
        handle.remove()
    router_nat, router_rep = (statistics.median(hook_times[r]) for r in (False, True))
    print(
        f"  router per layer (forward): natural {router_nat * 1e3:.2f} ms, with replay hook "
        f"{router_rep * 1e3:.2f} ms: hook {1e3 * (router_rep - router_nat):+.2f} ms",
        flush=True,
    )

    # what one forward validates, and what one sample's alignment costs, at the full model's depth
    full_routes = routes[:, :, :1].expand(-1, -1, full_depth, -1).contiguous()
    validate = statistics.median(
        timer(lambda: validate_routes(full_routes, num_layers=full_depth, top_k=top_k, num_experts=experts))(0)
        for _ in range(5)
    )
    rows = full_routes[0, :-1].numpy().astype(engine_dtype(experts))  # an engine's [p + c - 1, L, K] rows
    out = torch.empty((1, args.tokens, full_depth, top_k), dtype=full_routes.dtype)
    copy_dst = np.empty_like(rows)
    layout = dict(
        prompt_lengths=[1],
        completion_lengths=[args.tokens - 1],
        prompt_width=1,
        completion_width=args.tokens - 1,
        num_layers=full_depth,
        top_k=top_k,
        num_experts=experts,
    )
    align = interleaved_ratio(
        timer(lambda: np.copyto(copy_dst, rows)), timer(lambda: routes_from_engine([rows], **layout, out=out)), 7
    )
    print(
        f"  validate_routes at full depth: {validate * 1e3:.2f} ms per forward; align one sample "
        f"{align.candidate * 1e3:.2f} ms = {align.median:.2f}x a copy",
        flush=True,
    )
    model = replay = None  # frees the model before the next one is built (not del: the closures above share them)
    gc.collect()

    per_token = {  # seconds per token, whole model
        "train": full_depth * (fb.baseline + 2 * fo.baseline) / args.layers / args.tokens,
        "replay": full_depth
        * ((fb.candidate - fb.baseline) + 2 * (fo.candidate - fo.baseline))
        / args.layers
        / args.tokens,
        "align": align.candidate / args.tokens,
        "validate": 3 * validate / args.tokens,
    }
    result.update(
        fb=fb,
        fo=fo,
        hook=router_rep - router_nat,
        router=router_nat,
        validate=validate,
        align=align,
        per_token=per_token,
        bytes=full_depth * top_k,
    )
    return result


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    print(
        f"load average at start: {'/'.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.tokens} tokens per micro-batch, "
        f"{args.rounds} rounds"
    )
    results = [measure_model(key, args) for key in args.models]

    print("\nProjection to the whole model (per token; method in docs/benchmarks.md)")
    print(
        f"{'model':<15}{'L x K':>7}{'B/token':>9}{'fwd+bwd':>9}{'fwd':>7}{'train us':>10}{'replay us':>11}"
        f"{'align us':>10}{'valid. us':>10}{'c_train':>9}{'vLLM c_gen':>11}"
    )
    for r in results:
        t = r["per_token"]
        extra = t["replay"] + t["align"] + t["validate"]
        print(
            f"{r['name']:<15}{r['L']:>4}x{r['K']:<2}{r['bytes']:>9}{r['fb'].median:>9.3f}{r['fo'].median:>7.3f}"
            f"{t['train'] * 1e6:>10.1f}{t['replay'] * 1e6:>11.2f}{t['align'] * 1e6:>10.3f}"
            f"{t['validate'] * 1e6:>10.3f}{extra / t['train']:>9.2%}{VLLM_PUBLISHED_CAPTURE:>11.0%}"
        )
    print(
        "B/token: one-byte route ids per routed token (engine rows and batch routes; x4/3 in base64 on the wire). "
        "fwd+bwd, fwd: replay/natural (target <= 1.00). c_train = (replay + align + validate) / train, per "
        "token; the whole step lies between c_train and vLLM's published capture cost, whatever the "
        "generation share."
    )
    print(f"load average at end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
