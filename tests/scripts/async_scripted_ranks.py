"""Async R3 on scripted rollout samples, on one process or under ``torchrun --nproc_per_node 2`` (CPU, gloo); run by
tests/async_grpo/test_async_grpo_trainer.py.

    python tests/scripts/async_scripted_ranks.py OUT_DIR CHECKPOINT [ep]

Every rank builds the same script (tests/async_grpo/test_async_grpo_trainer.py's ``script``: groups of 4 samples, the
engine rows from the checkpoint's own routes); rank 0's scripted worker serves it. The micro-batch is 8 samples
whichever the world size (8 on one process, 4 per rank on two), so both runs train on the same samples. Each rank
checks its own training forwards token by token (tests/async_checks.py) and writes ``OUT_DIR/rank<r>.json``; rank 0
also saves the trained weights, ``OUT_DIR/weights.pt``. ``ep`` (two ranks): the model sharded at load time, its
experts split between the ranks (``distributed_config``: ep_size 2, fsdp_size 2).
"""

import json
import os
import sys
from pathlib import Path


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(out: str, checkpoint: str, *mode: str) -> None:
    import torch

    from trl_moe_replay import MoEReplayAsyncGRPOConfig, MoEReplayAsyncGRPOTrainer
    from trl_moe_replay.parallel.sharded import full_tensor
    from trl_moe_replay.testing.async_workers import NoOpWeightTransfer, ScriptedRolloutWorker

    from tests.async_checks import check_row, recording_trainer
    from tests.async_grpo.test_async_grpo_trainer import BATCH, DATASET, STEPS, reward, script, settings

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # version-0 routes for STEPS + 1 micro-batches (accelerate fetches one ahead): step 2 trains on stale routes
    samples, engine_rows = script(checkpoint, [0] * (2 * (STEPS + 1)))
    forwards = []

    CheckedTrainer = recording_trainer(MoEReplayAsyncGRPOTrainer, forwards)

    extra = {}
    if mode == ("ep",):
        extra["model_init_kwargs"] = {
            "dtype": "float32",
            "distributed_config": {"fsdp_size": 2, "ep_size": 2, "ep_implementation": "all_to_all"},
        }
    args = MoEReplayAsyncGRPOConfig(
        **settings(Path(out) / "run", vllm_sync_check=False, per_device_train_batch_size=BATCH // world, **extra)
    )
    trainer = CheckedTrainer(
        model=checkpoint,
        reward_funcs=reward,
        train_dataset=DATASET,
        args=args,
        rollout_worker=ScriptedRolloutWorker(samples),
        weight_transfer=NoOpWeightTransfer(),
    )
    rank = trainer.accelerator.process_index
    trainer.train()
    checks = [check_row(row, used, engine_rows, trainer._route_replay.moe_layers) for row, used in forwards]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    sharded = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "world": world, "checks": checks, "loss": losses, "sharded": sharded})
    )
    weights = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}  # every rank gathers
    if rank == 0:
        torch.save(weights, Path(out, "weights.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
