"""``python -m trl_moe_replay.cli``: the ``trl-moe-replay`` command."""

import sys

from .commands import main


sys.exit(main())
