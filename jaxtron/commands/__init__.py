"""jaxtron's commands, one module each, and the dispatcher (dispatch.py) that runs the one asked
for: `jaxtron COMMAND [ARGS]` installed, `python tools/COMMAND.py [ARGS]` from a checkout."""

from jaxtron.commands.dispatch import (  # noqa: F401 - the names callers take from the package
    COMMANDS,
    main,
    run,
)
