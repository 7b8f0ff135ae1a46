"""`python -m pipezero`: the `pipezero` command, as `python -m pipezero.cli` is."""

import sys

from pipezero.cli.command_line import main

sys.exit(main())
