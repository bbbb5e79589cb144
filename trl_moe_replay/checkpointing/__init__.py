"""Checkpoints both trainers save and resume: the resume pre-flight of every file (``checkpoint_files.py``), every
weight restored or a one-line refusal (``checkpoint_weights.py``, whose functions the trainers' base calls), the shards of a
model sharded at load time (``distributed_checkpoint.py``), and runs that survive Ctrl-C and SIGTERM
(``checkpoints.py``). Below the trainers: they import it; it imports the seam, ``parallel`` and ``bounded_json``."""
