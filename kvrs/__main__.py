"""`python -m kvrs` is the `kvrs` command."""

import sys

from kvrs.cli import main

sys.exit(main())
