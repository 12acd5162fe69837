"""`python -m atom.cli ...`: the `atom` command from a checkout."""

import sys

from atom.cli import main

sys.exit(main())
