"""Small helpers shared by the tests."""

import torch

from trl_moe_replay.testing import TINY_VOCAB_SIZE


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(6, TINY_VOCAB_SIZE, (batch, seq), generator=generator)


def shifted(routes: torch.Tensor, num_experts: int, by: int = 1) -> torch.Tensor:
    """Every route moved to other experts (keeps -1 and keeps each row a set of distinct ids)."""
    return torch.where(routes < 0, routes, (routes + by) % num_experts)


def experts_module(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    """The routed-experts module (3-D expert parameters) of a decoder layer."""
    for name, module in model.named_modules():
        if f"layers.{layer}." in name + "." and name.endswith(".experts") and ".shared" not in name:
            return module
    raise LookupError(f"no experts module in layer {layer}")
