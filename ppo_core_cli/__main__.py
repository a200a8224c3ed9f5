"""``python -m ppo_core_cli ...``: the ``ppo-core`` command."""

from __future__ import annotations

import sys

from ppo_core_cli.main import main

if __name__ == "__main__":
    sys.exit(main())
