"""Meshes over several hosts: tensor and fsdp stay within a host when they fit, data and stage
cross hosts, and a layout whose fsdp or tensor groups span hosts is named with the HSDP layout
that keeps them on NVLink. Checked on the layout arithmetic, on 8 CPU devices presented as
2 hosts x 4, and on the program compiled for 2 H100 hosts x 8."""

import re
from pathlib import Path

import jax
import pytest
from helpers import TINY

from jaxtron import config as config_lib
from jaxtron import parallel
from jaxtron.parallel import mesh as mesh_lib
from jaxtron.program import aot, hlo

ROOT = Path(__file__).resolve().parent.parent


def _sizes(**axes) -> dict[str, int]:
    return {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1} | axes


@pytest.mark.parametrize("axes,per_host,crossing", [
    ({"fsdp": 4, "data": 2}, 4, ["data"]),
    ({"fsdp": 8}, 4, ["fsdp"]),
    ({"tensor": 2, "fsdp": 4}, 4, ["fsdp"]),  # tensor fills half a host, fsdp the rest and more
    ({"tensor": 4, "fsdp": 2}, 4, ["fsdp"]),
    ({"tensor": 8, "fsdp": 2, "stage": 8}, 8, ["stage", "fsdp"]),
    ({"tensor": 8, "fsdp": 4}, 32, []),  # all on one 32-device host
    ({"tensor": 8, "fsdp": 4, "data": 4}, 32, ["data"]),
    ({"tensor": 8, "stage": 8, "data": 2}, 8, ["data", "stage"]),
])
def test_axes_that_cross_hosts(axes, per_host, crossing):
    assert parallel.crossing_axes(_sizes(**axes), per_host) == crossing


def test_fsdp_across_hosts_warns_with_the_hsdp_layout():
    lines = parallel.describe_hosts(_sizes(fsdp=16), 8)
    assert lines[0] == "mesh across 2 hosts of 8 devices: fsdp (2 hosts) crosses hosts"
    assert "warning: mesh.fsdp=16 spans 2 hosts" in lines[1]
    assert "mesh.data=2 mesh.fsdp=8" in lines[1]
    assert parallel.describe_hosts(_sizes(data=2, fsdp=8), 8) == [
        "mesh across 2 hosts of 8 devices: data (2 hosts) crosses hosts"]
    tensor = parallel.describe_hosts(_sizes(tensor=16), 8)
    assert "warning: mesh.tensor=16 spans 2 hosts" in tensor[1]
    assert parallel.describe_hosts(_sizes(fsdp=8), 8) == []  # one host: nothing to say


def _hosts_of_groups(mesh, axis: str, per_host: int) -> list[set[int]]:
    """For every group of devices along `axis`, the hosts its devices are on."""
    devices = mesh.devices
    moved = devices.transpose([i for i, a in enumerate(mesh.axis_names) if a != axis]
                              + [mesh.axis_names.index(axis)])
    return [{d.id // per_host for d in group} for group in moved.reshape(-1, moved.shape[-1])]


def test_eight_cpu_devices_as_two_hosts_of_four():
    """mesh.fsdp=4 mesh.data=2: every fsdp group within one host, every data group across both;
    mesh.fsdp=8: the fsdp group spans both hosts, and the log says so with the fix."""
    devices = jax.devices()
    hsdp = parallel.make_mesh(config_lib.MeshConfig(data=2, fsdp=4), devices, per_host=4)
    assert all(len(hosts) == 1 for hosts in _hosts_of_groups(hsdp, "fsdp", 4))
    assert all(hosts == {0, 1} for hosts in _hosts_of_groups(hsdp, "data", 4))
    flat = parallel.make_mesh(config_lib.MeshConfig(fsdp=8), devices, per_host=4)
    assert _hosts_of_groups(flat, "fsdp", 4) == [{0, 1}]
    assert "mesh.data=2 mesh.fsdp=4" in parallel.describe_hosts(dict(flat.shape), 4)[1]


class _Device:
    def __init__(self, id: int, process_index: int):
        self.id, self.process_index = id, process_index


def test_devices_are_ordered_host_major():
    """Devices listed in any order go host by host, so a host's devices are neighbours."""
    shuffled = [_Device(i, p) for i, p in [(5, 1), (0, 0), (7, 1), (2, 0), (4, 1), (1, 0),
                                           (6, 1), (3, 0)]]
    assert [d.id for d in mesh_lib._host_major(shuffled)] == list(range(8))
    assert parallel.devices_per_host(shuffled) == 4


def _compile(*overrides) -> dict:
    cfg = config_lib.load([TINY], ["train.batch_size=16", "train.seq_len=256", *overrides])
    compiled, plan, seconds = aot.compile_step_for(cfg, "h100", 16, 8)
    return aot.report(cfg, plan, compiled.memory_analysis(), hlo.parse(compiled.as_text()),
                      "h100", seconds, gpus_per_host=8)


def test_h100_program_keeps_hsdp_gathers_on_one_host():
    """The compiled program for 2 hosts x 8 H100: with mesh.data=2 mesh.fsdp=8 every weight
    gather and gradient scatter stays within a host and only the all-reduce over data crosses;
    with mesh.fsdp=16 the per-layer gathers cross hosts, and the report warns."""
    hsdp = _compile("mesh.data=2", "mesh.fsdp=8")
    over_fsdp = [r for r in hsdp["collectives"] if r["axes"] == ["fsdp"]]
    assert over_fsdp and not any(r["crosses_hosts"] for r in over_fsdp)
    assert all(r["crosses_hosts"] for r in hsdp["collectives"] if "data" in r["axes"])
    assert not any(line.startswith("warning") for line in hsdp["hosts_layout"])
    flat = _compile("mesh.fsdp=16")
    gathers = [r for r in flat["collectives"] if r["op"] == "all-gather" and r["axes"] == ["fsdp"]]
    assert gathers and all(r["crosses_hosts"] for r in gathers)
    assert any("mesh.data=2 mesh.fsdp=8" in line for line in flat["hosts_layout"])
    assert any("mesh.data=2 mesh.fsdp=8" in line for line in aot.format_report(flat))


def test_a_layout_within_a_node_is_proposed_only_where_it_fits():
    """llama3_70b, TP8 x FSDP8 on 64 H100s: keeping fsdp within a node (data=8, fsdp=1) would
    need 176 GiB per GPU, so the log says fsdp must cross hosts instead of proposing it (the
    warning used to propose it), and the doctor finds no problem in it; an 8B model on 16 GPUs
    fits within a node, and the warning stands."""
    from jaxtron.config import load
    from jaxtron.plan import autofit
    from jaxtron.train import doctor

    usable = int(aot.capacity_bytes("h100") * 0.9)
    big = aot.for_gpus(load([ROOT / "configs/llama3_70b.yaml"], ["mesh.tensor=8"]))
    sizes = _sizes(fsdp=8, tensor=8)
    need = autofit.layout_need(big, 64, usable)
    lines = parallel.describe_hosts(sizes, 8, need)
    assert not any(line.startswith("warning") for line in lines), lines
    assert re.search(r"^note: mesh.fsdp=8 spans 8 hosts .*and must: within a node \(mesh.data=8 "
                     r"mesh.fsdp=1\) it needs 1\d\d\.\d GiB per GPU at the least, over the 71.2 "
                     r"GiB usable", lines[1]), lines
    assert doctor.check_crossing(sizes, 8, need) == []
    assert doctor.check_crossing(sizes, 8) != []  # without the memory check: the old advice
    small = aot.for_gpus(load([ROOT / "configs/llama3_8b.yaml"]))
    lines = parallel.describe_hosts(_sizes(fsdp=16), 8, autofit.layout_need(small, 16, usable))
    assert lines[1].startswith("warning: mesh.fsdp=16 spans 2 hosts")
    assert "mesh.data=2 mesh.fsdp=8" in lines[1]


@pytest.mark.parametrize("nodes,says", [
    (("node-a", "node-b"), "mesh across 2 hosts of 4 devices: fsdp (2 hosts) crosses hosts"),
    (("node-a", "node-a"), None),  # two processes of one machine: one host of 8
])
def test_the_run_log_counts_hosts_as_the_preflight_found_them(tmp_path, capsys, nodes, says):
    """The log's hosts are the ones the preflight counted (launch.py passes them on): two
    processes on one machine were 2 hosts in the log but one to the doctor."""
    from helpers import tiny_config

    from jaxtron.train import doctor
    from jaxtron.train.loop import train

    hosts = doctor.Hosts(devices=(4, 4), nodes=nodes)
    train(tiny_config("mesh.fsdp=8", "train.steps=1", "model.num_layers=1", run_dir=tmp_path),
          hosts=hosts)
    out = capsys.readouterr().out
    if says:
        assert says in out, out
    else:
        assert "crosses hosts" not in out, out
