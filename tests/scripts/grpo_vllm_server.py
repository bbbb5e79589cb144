"""R3 in TRL's vLLM server mode on 2 CPU processes, against the vLLM-contract stand-in server (rank 0 hosts it).

Run by tests/rollouts/test_vllm_routes.py under `torchrun --nproc_per_node 2` (`accelerate launch --cpu --num_processes 2`
starts a single process unless MPI is set up); `use_cpu=True` makes accelerate use gloo. Each rank prints one
`REPORT {json}` line: what route rows it received per generation batch (count, bytes, sha256), and on rank 0
what the server sent, cut into the two ranks' shares, plus the logged metrics.
"""

import hashlib
import json
import os
import tempfile

import numpy as np
from datasets import Dataset

from trl_moe_replay import MoEReplayGRPOConfig, MoEReplayGRPOTrainer
from trl_moe_replay.routing.codec import decode_routed_experts
from trl_moe_replay.testing import FakeVLLMServer, tiny_moe_model, tiny_tokenizer, trl_vllm_transport_stub


PER_RANK = 8  # per_device_train_batch_size x steps_per_generation


def reward_len(completions, **kwargs):
    return [-abs(6 - len(c)) for c in completions]


def digest(rows):
    """[sha256, bytes] of a share's route arrays (the server's base64 payloads decoded, as the main process decodes
    them before the scatter)."""
    sha, total = hashlib.sha256(), 0
    for row in rows:
        array = decode_routed_experts(row) if isinstance(row, str) else row
        if array is None:
            sha.update(b"none")
            continue
        sha.update(repr((array.dtype.str, array.shape)).encode())
        sha.update(np.ascontiguousarray(array).tobytes())
        total += array.nbytes
    return [sha.hexdigest(), total]


def main():
    rank = int(os.environ.get("RANK", "0"))  # the trainer's arguments set up accelerate's state (cpu, gloo)
    server = FakeVLLMServer(tiny_moe_model("qwen3_moe")).__enter__() if rank == 0 else None
    try:
        with trl_vllm_transport_stub(server):
            args = MoEReplayGRPOConfig(
                output_dir=tempfile.mkdtemp(),
                use_cpu=True,
                bf16=False,
                report_to="none",
                max_steps=2,
                logging_steps=1,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=6,
                learning_rate=1e-3,
                gradient_accumulation_steps=2,
                save_strategy="no",
                seed=0,
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_url=server.url if server else "http://127.0.0.1:9",
                vllm_weight_sync="trl",  # the stand-in takes TRL's sync, its NCCL transport stubbed
            )
            dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
            trainer = MoEReplayGRPOTrainer(
                model=tiny_moe_model("qwen3_moe"),
                reward_funcs=reward_len,
                args=args,
                train_dataset=dataset,
                processing_class=tiny_tokenizer(),
            )
            received = []
            local_rows = trainer._route_source.local_rows

            def recording_local_rows(num_local):
                rows = local_rows(num_local)
                transfer = trainer._route_source.last_transfer
                sha, _ = digest(rows)
                received.append(
                    {
                        "samples": transfer.samples,
                        "payloads": transfer.payloads,
                        "bytes": transfer.payload_bytes,
                        "sha256": sha,
                    }
                )
                return rows

            trainer._route_source.local_rows = recording_local_rows
            trainer.train()
        world = trainer.accelerator.num_processes
        report = {"rank": trainer.accelerator.process_index, "world": world, "received": received}
        if server is not None:
            report["served"] = [
                [digest(batch.payloads[r * PER_RANK : (r + 1) * PER_RANK]) for r in range(world)]
                for batch in server.batches
            ]
            report["metrics"] = [h for h in trainer.state.log_history if "routing/mismatch_frac" in h]
        print("REPORT " + json.dumps(report), flush=True)
        trainer.end()  # destroys the process group before exit (see MoEReplayGRPOTrainer.end)
    finally:
        if server is not None:
            server.__exit__(None, None, None)


if __name__ == "__main__":
    main()
