"""`python -m staticrt.cli`: the console script, for environments without it on PATH."""

import sys

from .main import main

sys.exit(main())
