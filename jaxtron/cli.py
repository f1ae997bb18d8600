"""What every command line shares: bad input ends in one line on stderr and exit status 2, never a
traceback; other expected failures end the same way with their own status."""

from __future__ import annotations

import os
import sys
from typing import Callable

from jaxtron.config import ConfigError

EXIT_USAGE = 2  # bad input: the line says what to change


def one_line_errors(run: Callable[[], int | None], prefix: str = "error",
                    statuses: dict[type[BaseException], int] | None = None) -> int:
    """run()'s exit status; a ConfigError (status 2), or an exception of a type in `statuses`,
    becomes one line `<prefix>: <message>` on stderr and that status."""
    handled = {ConfigError: EXIT_USAGE, **(statuses or {})}
    try:
        return run() or 0
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 0
    except tuple(handled) as e:
        print(f"{prefix}: {e}", file=sys.stderr)
        return next(code for kind, code in handled.items() if isinstance(e, kind))
