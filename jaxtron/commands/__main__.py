"""`python -m jaxtron.commands COMMAND [ARGS]`: the `jaxtron` console script without its install
(bench runs its rows this way, each in a fresh process)."""

import sys

from jaxtron.commands import main

sys.exit(main())
