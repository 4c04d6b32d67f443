import sys

from streamrl.cli import main

sys.exit(main())
