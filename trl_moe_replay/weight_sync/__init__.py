"""How the trainer's weights reach the vLLM engine, and the check that they did, for both trainers.

``weight_reload`` (the reload weight sync: the trainer's weights as a checkpoint, reloaded by vLLM), ``vllm_weights``
(the trainer's weights as vLLM loads them: the checkpoint's names and layout), ``sync_check`` (does the engine hold
the trainer's weights after each sync?) and ``server_requests`` (requests to a vLLM server outside TRL's client).
Depends on :mod:`trl_moe_replay.routing` and :mod:`trl_moe_replay.upstream` only.
"""
