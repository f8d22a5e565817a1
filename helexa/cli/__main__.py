"""`python -m helexa.cli ...`: the `helexa` command without its console script."""

import sys

from helexa.cli import main

sys.exit(main())
