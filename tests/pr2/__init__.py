"""Tests of trl_moe_replay/pr2/: one test_<module>.py per module (test_<module>_<aspect>.py where one is not
enough)."""
