"""``python -m rollout_fleet``: one rollout worker (see rollout_fleet.main)."""

import sys

from rollout_fleet.main import main

sys.exit(main())
