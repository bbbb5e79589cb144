"""PR2 overhead against R2, side by side in one process, on CPU.

Timed in CPU seconds of this process (``time.process_time``) on one thread, so that other load on a shared machine
does not skew the ratios; absolute times mean little, the ratios are the result.

  old-logprob pass   R2: a no-grad forward that records the routes. PR2: the same forward steered by the predictors
                     (one more evaluation of each router) that also caches router inputs and logits at up to
                     ``--cached`` completion positions per sequence.
  training micro-step  R2: forward + backward under replay. PR2: the same plus the watch of the current router
                     logits at the cached positions and the predictor loss, in the same backward (an off-policy
                     mini-step).
  generate           plain recording vs recording steered by the predictors (``pr2_rollout_prediction``).

Also prints the cache size per cached token. Targets: each ratio <= 1.10 (the router is a small share of an MoE
layer's compute; the predictor loss is one [tokens, hidden] x [hidden, experts] matmul per layer).

    python bench/pr2_overhead.py            # hidden 512, 8 layers, 64 experts, top-8, batch 8x512
    python bench/pr2_overhead.py --quick    # a smaller model, for a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch
from _harness import bench_moe, interleaved_ratio, report, timer

from trl_moe_replay.pr2.state import PredictiveRoutingReplay
from trl_moe_replay.routing import RouterReplay
from trl_moe_replay.testing import TINY_VOCAB_SIZE


def cpu_timer(fn):
    """CPU seconds of this process: other load on a shared machine does not skew them."""
    return timer(fn, time.process_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--cached", type=int, default=2048, help="pr2_cached_tokens_per_sequence")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 4 layers, 16 experts, batch 4x128")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.experts, args.batch, args.seq, args.repeats = 128, 4, 16, 4, 128, 5
    torch.set_num_threads(args.threads)

    model = bench_moe(
        args.hidden,
        args.layers,
        args.experts,
        args.top_k,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
    ).train()
    rr = RouterReplay(model)
    pr2 = PredictiveRoutingReplay(rr, cached_tokens_per_sequence=args.cached, rollout_prediction=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # predictors that actually move routes, as after some training
        for linear in pr2.predictors.layers.values():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.01)
    x = torch.randint(6, TINY_VOCAB_SIZE, (args.batch, args.seq), generator=generator)
    mask = torch.ones_like(x)
    completion = args.seq // 2

    def old_pass_r2():
        with torch.no_grad(), rr.record():
            model(x, attention_mask=mask)

    def old_pass_pr2():
        with torch.no_grad(), pr2.old_pass_chunk(mask, completion, steer=True, cache=True), rr.record():
            model(x, attention_mask=mask)
        pr2.take_old_pass_cache(global_step=0)

    with torch.no_grad(), pr2.old_pass_chunk(mask, completion, steer=True, cache=True), rr.record() as rec:
        model(x, attention_mask=mask)
    routes, cache = rec.routes, pr2.take_old_pass_cache(global_step=0)
    cached_tokens = int((cache["pr2_positions"] >= 0).sum())
    cache_bytes = sum(cache[k].numel() * cache[k].element_size() for k in ("pr2_router_inputs", "pr2_old_logits"))
    optimizer = torch.optim.AdamW(pr2.predictors.parameters(), lr=1e-3)

    def step_r2():
        model.zero_grad(set_to_none=True)
        with rr.replay(routes):
            model(x, labels=x).loss.backward()

    def step_pr2():
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        with rr.replay(routes):
            with pr2.watch_training_forward(cache):
                loss = model(x, labels=x).loss
            predictor_loss, _ = pr2.training_loss(1, grad_scale=1.0)
            (loss + predictor_loss).backward()  # one backward for both losses, as in the trainer
        optimizer.step()

    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.experts} experts, top-{args.top_k}; "
        f"batch {args.batch}x{args.seq} ({completion} completion positions); torch threads {torch.get_num_threads()}"
    )
    print(
        f"cache: {cached_tokens} tokens, {cache_bytes / cached_tokens / 1024:.1f} KiB per cached token "
        f"({args.layers} x (hidden {args.hidden} x fp32 + {args.experts} x fp32))"
    )
    result = interleaved_ratio(cpu_timer(old_pass_r2), cpu_timer(old_pass_pr2), args.repeats)
    print(
        f"old-logprob pass     R2 {result.baseline:.3f}s  PR2 {result.candidate:.3f}s  "
        f"ratio PR2/R2 = {result.median:.3f}"
    )
    report("PR2 old-logprob pass / R2", result.median, 1.10)
    result = interleaved_ratio(cpu_timer(step_r2), cpu_timer(step_pr2), args.repeats)
    print(
        f"training micro-step  R2 {result.baseline:.3f}s  PR2 {result.candidate:.3f}s  "
        f"ratio PR2/R2 = {result.median:.3f}"
    )
    report("PR2 training micro-step / R2", result.median, 1.10)

    model.eval()
    prompts = x[:, :64]
    generate_kwargs = dict(
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
    )

    def generate_recorded():
        with torch.no_grad(), rr.record():
            model.generate(prompts, **generate_kwargs)

    def generate_steered():
        with torch.no_grad(), pr2.steering(), rr.record():
            model.generate(prompts, **generate_kwargs)

    result = interleaved_ratio(cpu_timer(generate_recorded), cpu_timer(generate_steered), args.repeats)
    print(
        f"generate             recording {result.baseline:.3f}s  steered {result.candidate:.3f}s  "
        f"ratio steered/recording = {result.median:.3f}"
    )
    report("PR2 steered generate / recording", result.median, 1.10)


if __name__ == "__main__":
    main()
