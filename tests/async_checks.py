"""An independent token-by-token check of the routes an async training forward used.

It does not look at the routes the trainer packed: it captures the expert ids every router actually used in the
forward, finds each sample's positions in the packed row from TRL's own tree layout (a sample ends on a leaf segment,
whose root-to-segment path, ``tree_kv_index``, lists the sample's packed positions in order), and compares them with
the rows the engine returned for that sample.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from trl_moe_replay import RouterReplay


@contextlib.contextmanager
def capture_used_experts(model):
    """``{layer: [N, K] ids used}`` of the forwards inside (register after the trainer's RouterReplay: forward hooks
    run in registration order, so these see the replayed ids)."""
    probe = RouterReplay(model)  # only to find the routers; its own hooks stay idle (no context is entered)
    used: dict[int, torch.Tensor] = {}
    handles = [
        router.register_forward_hook(
            lambda module, args, output, layer=layer: used.__setitem__(layer, output[2].detach().cpu())
        )
        for layer, router in probe.routers().items()
    ]
    try:
        yield used
    finally:
        for handle in handles:
            handle.remove()
        probe.remove()


def packed_row(inputs: dict) -> dict:
    """The first row of a collated batch, padding stripped (as compute_loss strips it)."""
    mask = inputs["attention_mask"][0].bool()
    keep = {key: inputs[key][0][inputs[key][0] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_k")}
    return {"input_ids": inputs["input_ids"][0][mask].cpu(), **{k: v.cpu() for k, v in keep.items()}}


def check_row(
    row: dict, used: dict[int, torch.Tensor], engine_rows: dict[tuple, list[np.ndarray]], moe_layers: list[int]
) -> tuple[int, int, int]:
    """``(samples found, positions checked, positions whose used experts differ from the engine's)``.

    ``engine_rows[tuple(input_ids)]`` lists the engine arrays (``[len - 1, L, K]``) of the samples with those tokens;
    a sample matches when one of them agrees (two samples with the same tokens may have been routed differently)."""
    ids = row["input_ids"]
    kv, cu = row["tree_kv_index"].tolist(), row["tree_cu_seqlens_k"].tolist()
    found = checked = mismatched = 0
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        path = kv[start:end]
        candidates = engine_rows.get(tuple(ids[path].tolist()))
        if not candidates:
            continue
        found += 1
        positions = torch.tensor(path[:-1])
        best = None
        for rows in candidates:
            differs = np.zeros(len(positions), dtype=bool)
            for layer in moe_layers:
                got = np.sort(used[layer][positions].numpy(), axis=-1)
                want = np.sort(np.asarray(rows)[: len(positions), layer].astype(np.int64), axis=-1)
                differs |= (got != want).any(axis=-1)
            best = int(differs.sum()) if best is None else min(best, int(differs.sum()))
        checked += len(positions)
        mismatched += best
    return found, checked, mismatched


def recording_trainer(base: type, forwards: list) -> type:
    """``base`` (an async trainer class) whose every training forward appends ``(packed row, experts used)`` to
    ``forwards``, for :func:`check_row` against the engine's rows after training."""

    class RecordingTrainer(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            row = packed_row(inputs)
            with capture_used_experts(self.accelerator.unwrap_model(model)) as used:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            forwards.append((row, used))
            return loss

    return RecordingTrainer
