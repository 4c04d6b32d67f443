"""``python -m rollout_fleet.engine``."""

import sys

from rollout_fleet.engine.main import main

sys.exit(main())
