"""Tests of trl_moe_replay/rollouts/: one test_<module>.py per module (test_<module>_<aspect>.py where one is not
enough)."""
