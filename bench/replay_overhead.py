"""Replay overhead: forward+backward with replayed routes vs natural routing, and generate with vs without recording.

Both sides run on the same model in one process, interleaved, and the script prints the median of the per-pair
ratios (target: both <= 1.03; replay skips nothing expensive and adds a gather). CPU timings here are only
meaningful as ratios.

    python bench/replay_overhead.py            # hidden 512, 8 layers, 64 experts, top-8, batch 8x512
    python bench/replay_overhead.py --quick    # a smaller model, for a smoke run
"""

from __future__ import annotations

import argparse

import torch
from _harness import bench_moe, interleaved_ratio, report, timer

from trl_moe_replay.routing import RouterReplay
from trl_moe_replay.testing import TINY_VOCAB_SIZE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 4 layers, 16 experts, batch 4x128")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.experts, args.batch, args.seq, args.repeats = 128, 4, 16, 4, 128, 5

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
    x = torch.randint(6, TINY_VOCAB_SIZE, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), rr.record() as rec:
        model(x)
    routes = rec.checked  # CheckedRoutes, as the trainers replay them (a plain tensor would be checked on each entry)

    def step_natural():
        model.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()

    def step_replay():
        model.zero_grad(set_to_none=True)
        with rr.replay(routes):
            model(x, labels=x).loss.backward()

    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.experts} experts, top-{args.top_k}; "
        f"batch {args.batch}x{args.seq}; torch threads {torch.get_num_threads()}"
    )
    result = interleaved_ratio(timer(step_natural), timer(step_replay), args.repeats)
    print(
        f"forward+backward  natural {result.baseline:.3f}s  replay {result.candidate:.3f}s  "
        f"ratio replay/natural = {result.median:.3f}"
    )
    report("replay fwd+bwd / natural (tiny model)", result.median, 1.00)

    model.eval()
    prompts = x[:, :64]
    generate_kwargs = dict(
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
    )

    def generate_plain():
        with torch.no_grad():
            model.generate(prompts, **generate_kwargs)

    def generate_recorded():
        with torch.no_grad(), rr.record():
            model.generate(prompts, **generate_kwargs)

    result = interleaved_ratio(timer(generate_plain), timer(generate_recorded), args.repeats)
    print(
        f"generate          plain {result.baseline:.3f}s  recording {result.candidate:.3f}s  "
        f"ratio recording/plain = {result.median:.3f}"
    )
    report("HF generate recording / plain", result.median, 1.03)


if __name__ == "__main__":
    main()
