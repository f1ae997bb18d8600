"""The local checkpoint tier: each process's shards on its own host's disk, and a peer's copy.

checkpoint.local_dir (node-local NVMe or /dev/shm; `$VARS` in it are expanded on each host) holds
`<run>/<step>/process_<i>`: process i's shards of the train state (each distinct shard of its
devices once), its input's position and the step's metadata, in one file whose header carries a
CRC of the payload. Every checkpoint.local_every steps each process copies its shards to host
memory (the only part the loop waits for) and a background thread writes the file and sends the
same bytes over TCP to its peer: the process of the same local rank on the next host, which keeps
them in its own local_dir. Losing one host, its disk with it, loses nothing: the peer holds a copy.

A start asks every process what its local_dir holds (a collective) and resumes from the newest
step whose every process's file is on some host, when that is not older than the persistent
tier's newest checkpoint (run.dir/checkpoints). A process whose file is elsewhere fetches it from
the holder's server. The shards are the exact bytes saved, so the resume is bit-exact. When a
process's file is on no host (it and its peer were both lost), or the files were written by
another layout or process count, the start says so in one line and resumes from the persistent
tier. Nothing here goes through the devices: the copies are host to host, off the step's path.
The file is local_files.py's; the copies between hosts go through local_peers.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax

from jaxtron.checkpoint.checkpoints import CheckpointSaveError
from jaxtron.config import CheckpointConfig, ConfigError
from jaxtron.plan import memory
from jaxtron.train import local_files, local_peers


def root(local_dir: str, run_dir: Path) -> Path:
    """This host's local directory of the run: local_dir (variables expanded) / the run's name
    and a hash of run.dir's absolute path, so that runs sharing a node's disk stay apart."""
    where = Path(os.path.expandvars(os.path.expanduser(local_dir)))
    key = hashlib.sha1(str(run_dir.absolute()).encode()).hexdigest()[:8]
    return where / f"{run_dir.absolute().name}-{key}"


# ------------------------------------------------------------------ the tier
def _allgather(value: Any) -> list:
    """Every process's JSON-able `value`, in process order (a collective)."""
    if jax.process_count() == 1:
        return [value]
    from jaxtron.train.distributed import allgather_text

    return [json.loads(text) for text in allgather_text(json.dumps(value))]


class LocalTier:
    """checkpoint.local_dir for this process: saves every local_every steps, replicated to the
    peer host; the restore at start. Made by every process at once (a collective)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, nodes: tuple[str, ...],
                 warn: Callable[[str], None]):
        self.every, self.keep, self.warn = cfg.local_every, cfg.local_keep, warn
        self.root, self.index = root(cfg.local_dir, run_dir), jax.process_index()
        self.nodes = nodes
        problem = _unwritable(self.root)
        problems = _allgather(problem)
        if any(problems):  # every process stops with the same line
            i = next(i for i, p in enumerate(problems) if p)
            raise ConfigError(f"checkpoint.local_dir={cfg.local_dir} cannot be written on host "
                              f"{nodes[i]} (process {i}: {problems[i]}); point it at node-local "
                              "storage every host can write, or set checkpoint.local_dir=\"\"")
        self.server = local_peers.Server(self.root, self._prune_owner)
        self.addresses = _allgather({"ip": local_peers.reachable_ip(), "port": self.server.port,
                                     "token": self.server.token})
        self.peer = local_peers.peers(nodes)[self.index]
        # One writer thread for the run, started here: a thread started at each save waited
        # tens of ms for a core on a busy host (CPU runs: XLA's pool spinning after the step).
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        threading.Thread(target=self._writer, name="local-save", daemon=True).start()
        self.error: BaseException | None = None
        self.print = ""  # this process's fingerprint, set by restore (every start calls it)
        self.saves, self.blocked_s = 0, 0.0  # local saves, and the loop's time blocked on them
        self.written_s = 0.0  # the background's time writing them and sending the peer's copy

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def describe(self) -> str:
        copy = ("no peer copy: the run has one host, so a lost host's shards are lost with it"
                if self.peer is None else "each host keeps a copy of the next host's shards")
        return (f"local checkpoints: every {self.every} steps into {self.root} on each host, the "
                f"newest {self.keep} kept; {copy}")

    # -------------------------------------------------------------- saving
    def save(self, step: int, state: Any, data: dict, meta: dict) -> None:
        """Copy this process's shards to host memory, then write them and send them to the peer
        in the background. Waits for the previous local save first."""
        self.wait()
        payload = local_files.gather(step, self.index, state, data, meta, self.print)
        self.saves += 1
        self.queue.put(payload)

    def _writer(self) -> None:
        while True:
            payload = self.queue.get()
            step = payload.header["step"]
            try:
                self._write(payload)
            except Exception as e:  # noqa: BLE001 - the loop raises it, as one line
                self.error = CheckpointSaveError(f"local checkpoint {step} was not saved: {e}")
            finally:
                del payload
                self.queue.task_done()

    def _write(self, payload: local_files.Payload) -> None:
        start = time.perf_counter()
        try:
            self._write_and_send(payload)
            self.written_s += time.perf_counter() - start
        finally:
            payload.buffers.clear()
            memory.release_freed()  # the host copies' pages, back to the OS off the loop's path

    def _write_and_send(self, payload: local_files.Payload) -> None:
        step = payload.header["step"]
        payload.seal()
        try:
            local_files.write(self.root / str(step) / f"process_{self.index}", payload.chunks())
        except OSError as e:
            self.error = CheckpointSaveError(
                f"local checkpoint {step} was not saved: {e.strerror or e} ({self.root})")
            return
        self._prune_owner(self.index)
        if self.peer is not None:
            try:
                self._send(payload, self.peer)
            except (OSError, ValueError) as e:  # a lost peer ends the run by itself: said once
                self.warn(f"warning: local checkpoint {step}: the copy to process {self.peer} "
                          f"(host {self.nodes[self.peer]}) failed ({e}); this host keeps its own")

    def _send(self, payload: local_files.Payload, to: int) -> None:
        request = {"op": "put", "step": payload.header["step"], "owner": self.index,
                   "size": payload.size()}
        with local_peers.request(self.addresses[to], request) as conn:
            for chunk in payload.chunks():
                conn.sendall(chunk)
            if conn.makefile("rb").readline() != b"ok\n":
                raise OSError("the peer did not confirm the copy")

    def check(self) -> None:
        """Raise now if the last local save's write failed (waits for nothing)."""
        if self.error is not None:
            self.wait()

    def wait(self) -> None:
        """Wait for the save in the background; CheckpointSaveError if its write failed."""
        self.queue.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.server.close()

    def _prune_owner(self, owner: int) -> None:
        """Keep the newest local_keep files of `owner` in this host's directory."""
        steps = sorted((s for s in _steps(self.root) if (self.root / str(s) /
                                                          f"process_{owner}").is_file()),
                       reverse=True)
        for step in steps[self.keep:]:
            (self.root / str(step) / f"process_{owner}").unlink(missing_ok=True)
            try:
                (self.root / str(step)).rmdir()
            except OSError:
                pass

    # -------------------------------------------------------------- restoring
    def inventory(self) -> list[list]:
        """[step, owner, fingerprint, processes] of every whole file in this host's directory."""
        found = []
        for step in _steps(self.root):
            for path in (self.root / str(step)).iterdir():
                header = local_files.FILE.match(path.name) and local_files.read_header(path)
                if header:
                    found.append([step, header["owner"], header["fingerprint"],
                                  header["processes"]])
        return found

    def restore(self, abstract: Any, shardings: Any, persistent: int | None,
                info: Callable[[str], None]) -> tuple[int, Any, dict, dict] | None:
        """(step, state, input state, meta) from the newest local step that every process can
        read, when not older than the persistent tier's newest (`persistent`); else None, having
        said why in one line when local checkpoints were there but not used. A collective."""
        self.print = mine = local_files.fingerprint(abstract, shardings)
        everyone = _allgather({"have": self.inventory(), "print": mine,
                               "room": self._no_room(abstract, shardings)})
        if short := [(i, e["room"]) for i, e in enumerate(everyone) if e["room"]]:
            i, why = short[0]
            raise ConfigError(f"checkpoint.local_dir on host {self.nodes[i]} (process {i}) {why}; "
                              "free space there, lower checkpoint.local_keep, or point "
                              "checkpoint.local_dir at a larger disk")
        prints = [e["print"] for e in everyone]
        holders: dict[tuple[int, int], list[int]] = {}
        other_layout = set()
        for process, entry in enumerate(everyone):
            for step, owner, print_, count in entry["have"]:
                if count == len(prints) and owner < len(prints) and print_ == prints[owner]:
                    holders.setdefault((step, owner), []).append(process)
                else:
                    other_layout.add((step, count))
        steps = sorted({s for s, _ in holders} | {s for s, _ in other_layout}, reverse=True)
        complete = [s for s in sorted({s for s, _ in holders}, reverse=True)
                    if all((s, o) in holders for o in range(len(prints)))]
        chosen = complete[0] if complete else None
        fallback = _fallback_line(steps, chosen, complete, holders, other_layout, len(prints),
                                  persistent)
        if chosen is None or (persistent is not None and persistent > chosen):
            if fallback:
                info(fallback)
            self._clear()
            return None
        problem = ""
        try:
            if self.index not in holders[(chosen, self.index)]:  # its own host's file is gone
                self._fetch(chosen, self.index, holders[(chosen, self.index)])
            state, data, meta = local_files.load(
                self.root / str(chosen) / f"process_{self.index}", abstract, shardings)
        except (OSError, ValueError) as e:
            problem, state, data, meta = str(e), None, None, None
        problems = _allgather(problem)
        if any(problems):
            i = next(i for i, p in enumerate(problems) if p)
            info(f"local checkpoint {chosen} could not be read on process {i} ({problems[i]}); "
                 f"resuming from the persistent tier ({_persistent(persistent)})")
            self._clear()
            return None
        moved = [o for o in range(len(prints)) if o not in holders[(chosen, o)]]
        self._clear(keep=chosen)
        info(f"resumed from local checkpoint {chosen} in checkpoint.local_dir"
             + (f" ({_processes(moved)} took {'its' if len(moved) == 1 else 'their'} shards from "
                "a peer's copy)" if moved else ""))
        return chosen, state, data, meta

    def _no_room(self, abstract: Any, shardings: Any) -> str:
        """Why this host's disk cannot hold the tier ("" when it can): local_keep + 1 files (a new
        one is written before the oldest goes) of each of its processes and of their peers'
        copies, against its free space and what the tier holds there already."""
        own = 0
        for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
            places = {local_files.key(i, leaf.shape) for i in
                      sharding.addressable_devices_indices_map(leaf.shape).values()}
            own += len(places) * math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        copies = 1 if self.peer is None else 2
        need = (self.keep + 1) * copies * own * self.nodes.count(self.nodes[self.index])
        held = sum(p.stat().st_size for p in self.root.rglob("process_*") if p.is_file())
        free = shutil.disk_usage(self.root).free + held
        if free >= need:
            return ""
        return (f"has {free / 2**30:.2f} GiB free, less than the local tier needs "
                f"({need / 2**30:.2f} GiB: {self.keep + 1} saves of this host's shards"
                + (" and its peer's copies)" if copies == 2 else ")"))

    def _fetch(self, step: int, owner: int, holders: list[int]) -> None:
        """This process's file of `step`, from a process on another host that keeps a copy."""
        for holder in holders:
            with local_peers.request(self.addresses[holder], {"op": "get", "step": step,
                                                   "owner": owner}) as conn:
                stream = conn.makefile("rb")
                size = int(stream.readline() or -1)
                if size >= 0:
                    local_files.write(self.root / str(step) / f"process_{owner}",
                                      local_peers.exactly(stream, size))
                    return
        raise OSError(f"no host handed out process {owner}'s file of step {step}")

    def _clear(self, keep: int | None = None) -> None:
        """Drop local steps other than `keep` (the one resumed from): the steps of a timeline
        this run has left, or of another layout, must never be taken for this run's newest."""
        for step in _steps(self.root):
            if step != keep:
                shutil.rmtree(self.root / str(step), ignore_errors=True)
        for leftover in self.root.glob("*/.*.tmp"):
            leftover.unlink(missing_ok=True)


def newest_here(run_dir: Path) -> int | None:
    """The newest local step this host holds a file of, for run_dir's checkpoint.local_dir (as
    its config.yaml says); None when there is none or no local tier."""
    import yaml

    try:
        local_dir = yaml.safe_load((run_dir / "config.yaml").read_text())["checkpoint"]["local_dir"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    if not local_dir:
        return None
    here = root(local_dir, run_dir)
    steps = [s for s in _steps(here)
             if any(local_files.FILE.match(p.name) for p in (here / str(s)).iterdir())]
    return steps[-1] if steps else None


def _steps(directory: Path) -> list[int]:
    try:
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    except OSError:
        return []


def _processes(ids: list[int]) -> str:
    return (f"process {ids[0]}" if len(ids) == 1 else
            "processes " + ", ".join(map(str, ids)))


def _persistent(step: int | None) -> str:
    return "none yet: starting from scratch" if step is None else f"step {step}"


def _fallback_line(steps: list[int], chosen: int | None, complete: list[int],
                   holders: dict, other_layout: set, processes: int,
                   persistent: int | None) -> str | None:
    """Why local checkpoints that are there are not resumed from, in one line (None: none are
    there, or the persistent tier's is newer and that is all)."""
    where = f"resuming from the persistent tier ({_persistent(persistent)})"
    if not steps:  # a fresh run says nothing; a resume says where from
        return (None if persistent is None else
                f"checkpoint.local_dir: no local checkpoint on any host; {where}")
    if chosen is not None:
        return (f"local checkpoint {chosen} is older than the persistent tier's; {where}"
                if persistent is not None and persistent > chosen else None)
    newest = steps[0]
    if any(s == newest for s, _ in other_layout):
        counts = sorted({c for s, c in other_layout if s == newest})
        by = (f"{counts[0]} processes" if counts != [processes] else "another layout")
        return (f"local checkpoint {newest} was saved by {by} and this run has {processes} "
                f"processes in its own layout; {where}")
    lost = [o for o in range(processes) if (newest, o) not in holders]
    return (f"local checkpoint {newest} lacks {_processes(lost)}'s shards on every host (a host "
            f"and the peer that kept its copy were both lost); {where}")


def _unwritable(directory: Path) -> str:
    """Why `directory` cannot hold local checkpoints, in a few words ("" when it can)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
        return ""
    except OSError as e:
        return e.strerror or str(e)
