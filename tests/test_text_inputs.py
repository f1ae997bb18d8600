"""tools/text_inputs.py, the inputs of tools/prepare_data.py: an INPUT that names no file says
why, and a named pipe or a device is bad input rather than a read that waits for ever."""

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # as the tool imports it
from text_inputs import find_sources, read_documents  # noqa: E402

from jaxtron.config import ConfigError  # noqa: E402


@pytest.mark.parametrize("name, why", [
    ("empty", "the directory holds no files (names starting with '.' are skipped)"),
    ("out", "this is the --out directory; name the raw text to tokenize"),
    ("nowhere", "no such file or directory, or no file matches"),
    ("empty/*.txt", "no such file or directory, or no file matches"),
])
def test_an_input_that_names_no_file_says_why(tmp_path, name, why):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("skipped")
    with pytest.raises(ConfigError) as error:
        find_sources([str(tmp_path / name)], tmp_path / "out")
    assert str(error.value) == f"INPUT {tmp_path / name}: {why}"


def test_a_named_pipe_is_bad_input_not_a_wait_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    items, path = [], tmp_path / "pipe"
    reader = threading.Thread(target=lambda: items.extend(read_documents(path, "")), daemon=True)
    reader.start()  # without the check it stays blocked in open(), waiting for a writer
    reader.join(10)
    assert items == [(-1, {}, None, "not a regular file (a pipe or a device)", 0)]
