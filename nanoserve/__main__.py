"""`python -m nanoserve`: the same command as the `nanoserve` script."""

import sys

from nanoserve.cli import main

sys.exit(main())
