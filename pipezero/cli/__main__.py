"""`python -m pipezero.cli`: how the launcher (torchrun, srun) starts every rank."""

import sys

from pipezero.cli.command_line import main

sys.exit(main())
