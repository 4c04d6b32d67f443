import sys

from learner.main import main

sys.exit(main())
