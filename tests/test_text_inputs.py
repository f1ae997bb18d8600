"""jaxtron/data/text_inputs.py, the inputs of tools/prepare_data.py: an INPUT that names no file says
why, and a named pipe or a device is bad input rather than a read that waits for ever."""

import os
import threading

import pytest

from jaxtron.config import ConfigError
from jaxtron.data.text_inputs import find_sources, read_documents


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


def test_a_json_array_over_the_size_read_whole_names_the_conversion(tmp_path, monkeypatch):
    """A JSON array is parsed whole; past JSON_ARRAY_MAX_BYTES it is one bad item naming the jq
    command that makes it JSON Lines, never a parse that fills the host's memory."""
    from jaxtron.data import text_inputs

    path = tmp_path / "big.json"
    path.write_text('[{"text": "a"}, {"text": "b"}]')
    assert [item[2] for item in read_documents(path, "text")] == ["a", "b"]
    monkeypatch.setattr(text_inputs, "JSON_ARRAY_MAX_BYTES", 16)
    assert list(read_documents(path, "text")) == [(-1, {}, None, (
        "one JSON array of 0 MiB, more than the 0 MiB read whole; convert it to JSON Lines: "
        "jq -c '.[]' big.json > big.jsonl"), 30)]
