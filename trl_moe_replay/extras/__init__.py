"""Product pieces built on the library, not needed to train with it: see :mod:`trl_moe_replay.extras.math`."""
