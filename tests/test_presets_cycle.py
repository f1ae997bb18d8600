"""A `base:` cycle among presets is refused in one line naming every file of the cycle, in the
order each names the next (it named only the one it came back to)."""

import os

import pytest
from helpers import assert_refused

import launch
from jaxtron import config


def _presets(folder, **bases: str) -> None:
    for name, base in bases.items():
        (folder / f"{name}.yaml").write_text(f"base: {base}.yaml\ntrain:\n  steps: 1\n")


@pytest.mark.parametrize("given, cycle", [
    ("a", "a.yaml -> b.yaml -> a.yaml"),  # the file given is in the cycle
    ("c", "b.yaml -> a.yaml -> b.yaml"),  # c leads into it: only the cycle is named
    ("s", "s.yaml -> s.yaml"),  # a preset that names itself
])
def test_a_cycle_names_each_file_of_it(tmp_path, monkeypatch, given, cycle):
    _presets(tmp_path, a="b", b="a", c="b", s="s")
    monkeypatch.chdir(tmp_path)  # files under the working directory are named relative to it
    with pytest.raises(config.ConfigError) as e:
        config.load([f"{given}.yaml"])
    assert f"in a cycle: {cycle} (" in str(e.value)
    assert "c.yaml" not in str(e.value)  # leading into the cycle is not part of it


def test_a_cycle_ends_a_launch_in_one_line_writing_nothing(tmp_path, capsys):
    _presets(tmp_path, a="b", b="a")
    rc = launch.main(["--config", str(tmp_path / "a.yaml"), f"run.dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert_refused(rc, err, f"{tmp_path}/a.yaml -> {tmp_path}/b.yaml -> {tmp_path}/a.yaml",
                   "base:")
    assert sorted(os.listdir(tmp_path)) == ["a.yaml", "b.yaml"]
