"""The local tier's file: one process's shards of the train state, its input's position and the
step's metadata, with a CRC over the payload (jaxtron/train/local_tier.py saves and reads it).

A file is MAGIC, the header's length, the header (JSON: each shard's array, place, dtype, shape
and offset; the input state; the meta; the process count and layout fingerprint) and the shards'
bytes. It is written whole into a hidden temporary file and renamed over, so a file is either
whole or absent unless something damaged it afterwards, which the CRC finds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

MAGIC = b"jaxtron-local-1\n"
FILE = re.compile(r"^process_(\d+)$")
CHUNK = 1 << 22  # bytes per write or send
_SLICE = 1 << 18  # bytes of CRC per call: about 0.2 ms


def key(index: tuple, shape: tuple) -> str:
    """A shard's place in its array, as text: 'start:stop' per dimension."""
    return ",".join(f"{s.start or 0}:{dim if s.stop is None else s.stop}"
                    for s, dim in zip(index, shape))


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path)


def fingerprint(abstract: Any, shardings: Any) -> str:
    """What this process's shards are: every array's name, shape, dtype and the places of this
    process's shards in it, and the process count. Files of another layout do not match."""
    h = hashlib.sha256(str(jax.process_count()).encode())
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings)):
        keys = sorted({key(i, leaf.shape) for i in
                       sharding.addressable_devices_indices_map(leaf.shape).values()})
        h.update(f"{_leaf_name(path)}|{leaf.shape}|{leaf.dtype}|{keys}\n".encode())
    return h.hexdigest()[:16]


@dataclass
class Payload:
    """One process's file: a header (JSON) and its arrays' bytes, kept in host memory."""

    header: dict
    buffers: list[np.ndarray]

    def seal(self) -> None:
        """Put the payload's CRC in the header (in the background: it reads every byte)."""
        crc = 0
        for buffer in self.buffers:  # in slices: zlib holds the GIL, and the loop needs it
            view = memoryview(buffer.reshape(-1).view(np.uint8))
            for start in range(0, len(view), _SLICE):
                crc = zlib.crc32(view[start:start + _SLICE], crc)
        self.header["crc32"] = crc

    def head(self) -> bytes:
        text = json.dumps(self.header).encode()
        return MAGIC + struct.pack("<Q", len(text)) + text

    def chunks(self):
        yield self.head()
        for buffer in self.buffers:
            view = memoryview(buffer.reshape(-1).view(np.uint8))
            for start in range(0, len(view), CHUNK):
                yield view[start:start + CHUNK]

    def size(self) -> int:
        return len(self.head()) + sum(b.nbytes for b in self.buffers)


def gather(step: int, owner: int, state: Any, data: dict, meta: dict, print_: str) -> Payload:
    """This process's distinct shards copied to host memory (what the loop waits for: the next
    step may overwrite the state's buffers), with their places, the input's state and meta."""
    entries, device_arrays = [], []
    for path, arr in jax.tree_util.tree_flatten_with_path(state)[0]:
        seen = set()
        for shard in arr.addressable_shards:
            place = key(shard.index, arr.shape)
            if place not in seen:
                seen.add(place)
                entries.append({"array": _leaf_name(path), "at": place})
                device_arrays.append(shard.data)
    for data_ in device_arrays:
        data_.copy_to_host_async()
    # A CPU array's host view is its own buffer, which the next step's donation then leaves
    # alone (jax copies instead); a GPU array's is a fresh host copy.
    buffers = [np.asarray(d) for d in device_arrays]
    offset = 0
    for entry, buffer in zip(entries, buffers):
        entry.update(dtype=buffer.dtype.name, shape=list(buffer.shape), offset=offset,
                     nbytes=buffer.nbytes)
        offset += buffer.nbytes
    header = {"step": step, "owner": owner, "processes": jax.process_count(),
              "fingerprint": print_, "crc32": None, "arrays": entries, "data": data,
              "meta": meta}
    return Payload(header, buffers)


def read_header(path: Path) -> dict | None:
    """A file's header, or None when it is not a whole local checkpoint file's beginning."""
    try:
        with path.open("rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            size = path.stat().st_size
    except (OSError, ValueError, struct.error):
        return None
    total = len(MAGIC) + 8 + length + sum(e["nbytes"] for e in header["arrays"])
    return header if total == size else None


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def load(path: Path, abstract: Any, shardings: Any) -> tuple[Any, dict, dict]:
    """(state, input state, meta) from a process's file, onto this process's devices; ValueError
    when its bytes fail their CRC or a shard is missing."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8 + length
    header = json.loads(raw[len(MAGIC) + 8:start])
    body = memoryview(raw)[start:]
    if zlib.crc32(body) != header["crc32"]:
        raise ValueError(f"{path} fails its checksum")
    shards = {(e["array"], e["at"]): e for e in header["arrays"]}
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for (path_, leaf), sharding in zip(flat, jax.tree.leaves(shardings)):
        name, buffers = _leaf_name(path_), []
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
            entry = shards.get((name, key(index, leaf.shape)))
            if entry is None:
                raise ValueError(f"{path} lacks a shard of {name}")
            host = np.frombuffer(body, _dtype(entry["dtype"]), count=int(np.prod(entry["shape"])),
                                 offset=entry["offset"]).reshape(entry["shape"])
            buffers.append(jax.device_put(host, device))
        leaves.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, buffers))
    return jax.tree.unflatten(tree, leaves), header["data"], header["meta"]


def write(path: Path, chunks) -> None:
    """Write `chunks` to `path` whole: into a hidden temporary file, then renamed over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        for chunk in chunks:
            f.write(chunk)
    os.replace(tmp, path)
