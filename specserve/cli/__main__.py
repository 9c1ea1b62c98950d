"""`python -m specserve.cli`: the same as the `specserve` command."""

import sys

from specserve.cli import main

sys.exit(main())
