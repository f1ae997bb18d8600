"""safetensors files read and written one tensor at a time, bfloat16 included.

The `safetensors` package's numpy API loads whole files and has no bfloat16 (numpy lacks the
type), while published checkpoints are mostly bfloat16 and larger than a host's memory. The format
is simple (an 8-byte little-endian header size, a JSON header naming each tensor's dtype, shape and
byte range, then the raw bytes), so tensors are read here through a memory map, one at a time, and
files are written by streaming tensors into place as they are produced.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
NAMES = {np.dtype(t): name for name, t in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the reference reader's limit: a bigger size is not a header


class TensorFileError(ValueError):
    """A file that is not a readable safetensors file, or a tensor it does not hold."""


def header(path: Path) -> tuple[dict, int]:
    """(the JSON header without its metadata, the offset where tensor bytes start). A file shorter
    than its header says (an interrupted download) is refused here, before any tensor is mapped."""
    with open(path, "rb") as f:
        actual = f.seek(0, 2)
        f.seek(0)
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        if len(raw) < 8 or size > MAX_HEADER:
            raise TensorFileError(f"{path} is not a safetensors file "
                                  f"({'too short' if len(raw) < 8 else 'no header size'})")
        if actual < 8 + size:
            raise TensorFileError(f"{path} is truncated ({actual} bytes, shorter than its "
                                  f"{8 + size}-byte header); download it again")
        try:
            entries = json.loads(f.read(size))
            entries.pop("__metadata__", None)
            promised = 8 + size + max((int(e["data_offsets"][1]) for e in entries.values()),
                                      default=0)
        except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError):
            raise TensorFileError(f"{path} is not a safetensors file (unreadable header)") from None
    if actual < promised:
        raise TensorFileError(f"{path} is truncated ({actual} of {promised} bytes the header "
                              "promises); download it again")
    return entries, 8 + size


def read(path: Path, name: str, entries: dict, start: int) -> np.ndarray:
    """One tensor of the file, memory-mapped (pages are read as the array is used)."""
    if name not in entries:
        raise TensorFileError(f"{path} has no tensor {name}")
    entry = entries[name]
    if entry["dtype"] not in DTYPES:
        raise TensorFileError(f"{path}: tensor {name} has dtype {entry['dtype']}, which is not "
                              f"one of {', '.join(DTYPES)}")
    begin, end = entry["data_offsets"]
    dtype = np.dtype(DTYPES[entry["dtype"]])
    if end - begin != dtype.itemsize * int(np.prod(entry["shape"], dtype=np.int64)):
        raise TensorFileError(f"{path}: tensor {name}'s byte range does not match its shape")
    if end == begin:
        return np.zeros(entry["shape"], dtype)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return data.view(dtype).reshape(entry["shape"])


def write(path: Path, names: list[str], specs: dict[str, tuple[tuple[int, ...], np.dtype]],
          produce: Callable[[str], np.ndarray]) -> None:
    """Write the tensors `names` (shapes and dtypes from `specs`) to `path`, asking `produce`
    for each in turn, so that only one is in memory at a time."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        shape, dtype = specs[name]
        size = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        entries[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensor bytes start 8-aligned, as the reference writer does
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            value = np.ascontiguousarray(produce(name))
            if (value.shape, value.dtype) != (tuple(specs[name][0]), np.dtype(specs[name][1])):
                raise TensorFileError(f"{name}: produced {value.shape} {value.dtype}, "
                                      f"planned {specs[name][0]} {np.dtype(specs[name][1])}")
            f.write(value.reshape(-1).view(np.uint8))
    tmp.replace(path)


def plan_shards(sizes: Iterable[tuple[str, int]], limit: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most `limit` bytes (a bigger tensor
    alone)."""
    shards: list[list[str]] = [[]]
    total = 0
    for name, size in sizes:
        if shards[-1] and total + size > limit:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += size
    return shards
