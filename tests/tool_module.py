"""Import a command-line tool of tools/ as a module, under a name of its own (`<stem>_tool`), so
that tests call its functions and `main` in-process; registered in sys.modules first, as
dataclasses defined in the tool look their module up there."""

import importlib.util
import sys
from pathlib import Path


def import_tool(path: Path):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_tool", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
