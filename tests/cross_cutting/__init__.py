"""Tests that belong to no one module: themes that run across the package (drop-in and golden TRL, fail-safe and
hostile inputs, combinations of features, model paths, health, the real vLLM engines end to end) and checks of the
project around it (docs, examples, recipes, bench scripts, install, dependency ranges, layout, source strings, the
test map). A test of one module goes to ``tests/<package>/test_<module>.py`` instead."""
