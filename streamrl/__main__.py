"""``python -m streamrl``: the command line, and the entry path of every role process ``up`` starts."""

import sys

from common.lifecycle import exit_process
from streamrl.cli import main

code = main()
if isinstance(code, int) or code is None:
    exit_process(code or 0)
sys.exit(code)
