"""Sharded training: helpers for parameters sharded by FSDP2, DeepSpeed ZeRO-3 or transformers' own loading-time
sharding (``sharded.py``), and expert parallelism through transformers' ``DistributedConfig`` (``expert_parallel.py``).
Below the trainers: they and the checkpoints import it; it imports only the seam."""
