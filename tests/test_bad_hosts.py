"""jaxtron/train/bad_hosts.py: the hosts of a run's processes (hosts.json) and the hosts that lost
one (bad_hosts), as the supervisor writes them and scripts/slurm/train.sbatch reads them."""

import subprocess
import sys

from jaxtron.train import bad_hosts


def test_a_process_host_is_read_back_and_missing_ones_are_none(tmp_path):
    assert bad_hosts.host_of(tmp_path, 0) is None  # no hosts.json yet
    bad_hosts.write_hosts(tmp_path, ["node3", "node7"])
    assert (tmp_path / bad_hosts.HOSTS).read_text() == '["node3", "node7"]\n'
    assert [p.name for p in tmp_path.iterdir()] == [bad_hosts.HOSTS]  # no tmp file left
    assert [bad_hosts.host_of(tmp_path, i) for i in (0, 1, 2, -1)] == ["node3", "node7", None, None]
    bad_hosts.write_hosts(tmp_path, ["node4"])  # the next attempt's, on other nodes
    assert [bad_hosts.host_of(tmp_path, i) for i in (0, 1)] == ["node4", None]


def test_an_unreadable_hosts_file_names_no_host(tmp_path):
    for text in ('["node3", "no', '{"0": "node3"}', '[3]', '[""]'):
        (tmp_path / bad_hosts.HOSTS).write_text(text)
        assert bad_hosts.host_of(tmp_path, 0) is None, text
    (tmp_path / bad_hosts.HOSTS).write_bytes(b'["\xff"]')
    assert bad_hosts.host_of(tmp_path, 0) is None


def test_each_survivor_adds_the_host_and_read_gives_it_once(tmp_path):
    """Two survivors each add node7; a later attempt loses node2, then node7 again."""
    assert bad_hosts.read(tmp_path) == []
    for host, why in [("node7", "process 1 stopped answering"),
                      ("node7", "process 1 stopped answering"),
                      ("node2", "process 0 stopped\nanswering"), ("node7", "again")]:
        bad_hosts.add(tmp_path, host, why)
    assert (tmp_path / bad_hosts.BAD).read_text().splitlines() == [
        "node7\tprocess 1 stopped answering", "node7\tprocess 1 stopped answering",
        "node2\tprocess 0 stopped answering", "node7\tagain"]  # one line each, newline or not
    assert bad_hosts.read(tmp_path) == ["node7", "node2"]


def test_a_line_without_a_reason_still_names_its_host(tmp_path):
    """What an admin might write by hand: the host alone, blank lines, stray spaces."""
    (tmp_path / bad_hosts.BAD).write_text("node5\n\n  node6 \t why\nnode5\tagain\n")
    assert bad_hosts.read(tmp_path) == ["node5", "node6"]


def test_adding_never_raises_and_skips_what_is_no_host_name(tmp_path):
    bad_hosts.add(tmp_path / "missing", "node7", "lost")  # no such directory: nothing, no error
    (tmp_path / bad_hosts.BAD).mkdir()  # a directory where the file should be
    bad_hosts.add(tmp_path, "node7", "lost")
    assert bad_hosts.read(tmp_path) == []
    (tmp_path / bad_hosts.BAD).rmdir()
    for host in ("", "node 7", "node7\n", "\tnode7"):
        bad_hosts.add(tmp_path, host, "lost")
    assert not (tmp_path / bad_hosts.BAD).exists()


def test_it_needs_nothing_but_the_standard_library():
    """The module alone, loaded from its file without the jaxtron package (which imports jax),
    works: a tool that reads bad_hosts needs no jax."""
    code = ("import importlib.util, sys, tempfile, pathlib\n"
            f"spec = importlib.util.spec_from_file_location('bad_hosts', {bad_hosts.__file__!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "d = pathlib.Path(tempfile.mkdtemp()); module.add(d, 'node7', 'lost')\n"
            "assert module.read(d) == ['node7']\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxtron')]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
