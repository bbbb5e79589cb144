"""Tests of trl_moe_replay_vllm_plugin, the routed-experts capture vLLM loads in its own processes."""
