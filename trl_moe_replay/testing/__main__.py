"""Save a tiny random MoE checkpoint (model and tokenizer), for offline runs of scripts that take a model path:

    python -m trl_moe_replay.testing runs/tiny-moe [--model_type qwen3_moe] [--seed 0]
    python examples/swap_imports.py runs/tiny-moe

The model is :func:`~trl_moe_replay.testing.tiny_moe_model` (0.2M parameters, seeded), the tokenizer
:func:`~trl_moe_replay.testing.tiny_tokenizer` (character level, ChatML chat template).
"""

import argparse

from .tiny_models import supported_model_types, tiny_moe_model, tiny_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trl_moe_replay.testing", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="where to save the checkpoint (created)")
    parser.add_argument("--model_type", default="qwen3_moe", choices=supported_model_types())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tiny_moe_model(args.model_type, seed=args.seed).save_pretrained(args.folder)
    tiny_tokenizer().save_pretrained(args.folder)
    print(f"saved a tiny {args.model_type} checkpoint in {args.folder}")


if __name__ == "__main__":
    main()
