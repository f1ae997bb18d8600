"""Which rows of the global batch a process builds, and how it builds them from the batch's packing.

Every process computes the same packing of each global batch: the first-fit packer run on
placeholders that stand for the stream's chunks (a chunk's length of one code), which needs only
the chunks' lengths. A code is `item * FAN_OUT + chunk`: the item's key in the stream and the
chunk's number in it. The process then reads only the chunks that land in its own rows, and puts
their tokens where the packer put their codes, so its rows equal those of the global batch
element for element.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxtron import parallel

FAN_OUT = 1 << 20  # chunks one item may have (a document of up to 2**20 x seq_len tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
    """The global rows (sorted) a process builds, out of `total` rows a step."""

    indices: np.ndarray
    total: int

    def __len__(self) -> int:
        return len(self.indices)

    def positions(self, index: slice) -> np.ndarray:
        """Where the global rows `index` (a device's shard) lie in this process's rows."""
        wanted = np.arange(self.total)[index]
        at = np.minimum(np.searchsorted(self.indices, wanted), len(self.indices) - 1)
        if (self.indices[at] != wanted).any():
            raise ValueError(f"rows {wanted[self.indices[at] != wanted]} of the global batch are "
                             "not among this process's rows")
        return at


@functools.lru_cache(maxsize=16)  # asked at every step
def local_rows(mesh: Mesh, batch_size: int, seq_len: int,
               devices: tuple[jax.Device, ...] | None = None) -> Rows:
    """The rows of a [batch_size, seq_len] global batch that `devices` (by default this process's
    devices in the mesh) hold: the union of their shards, also where a shard spans processes."""
    sharding = NamedSharding(mesh, parallel.batch_spec())
    mine = ({d for d in mesh.devices.flat if d.process_index == jax.process_index()}
            if devices is None else set(devices))
    rows = set()
    for device, index in sharding.devices_indices_map((batch_size, seq_len)).items():
        if device in mine:
            rows.update(range(*index[0].indices(batch_size)))
    return Rows(np.array(sorted(rows), np.int64), batch_size)


class Recent:
    """The items read last, up to `budget` tokens: the packer reads every document for its length,
    and the rows built from its packing a few batches later take theirs from here, not the disk."""

    def __init__(self, budget: int):
        self.budget, self.tokens, self.items = budget, 0, collections.OrderedDict()

    def put(self, key: int, item: np.ndarray) -> np.ndarray:
        """Keep `item`, dropping the oldest beyond the budget; returns it."""
        if key in self.items:
            self.tokens -= len(self.items.pop(key))
        self.items[key] = item
        self.tokens += len(item)
        while self.tokens > self.budget and len(self.items) > 1:
            self.tokens -= len(self.items.popitem(last=False)[1])
        return item

    def get(self, key: int) -> np.ndarray | None:
        return self.items.get(key)


def placeholder(length: int, code: int) -> dict[str, np.ndarray]:
    """What the packer packs in place of a chunk: its length, filled with its code (a
    read-only view of one number: nothing allocated)."""
    return {"tokens": np.broadcast_to(np.int64(code), (length,))}


@dataclasses.dataclass(frozen=True)
class PackDocument(grain.experimental.FlatMapTransform):
    """(a document's key, its length) -> a placeholder per chunk, cut as data.SplitDocument cuts
    bos + document + eos: chunk i starts at i x seq_len and has up to seq_len tokens."""

    seq_len: int
    max_fan_out: int = FAN_OUT

    def flat_map(self, key_and_length: tuple[int, int]) -> list[dict[str, np.ndarray]]:
        key, length = key_and_length
        starts = np.arange(0, length + 1, self.seq_len)  # ceil((length + 1) / seq_len) chunks
        if len(starts) > FAN_OUT:
            raise ValueError(f"a document of {length:,} tokens has more than {FAN_OUT:,} chunks")
        lengths = np.minimum(self.seq_len, length + 1 - starts)
        return [placeholder(int(n), key * FAN_OUT + i) for i, n in enumerate(lengths)]


def assemble(packing: dict[str, np.ndarray], rows: np.ndarray | None,
             fetch: Callable[[int], object], cut: Callable[[object, int], dict]) -> dict:
    """Rows `rows` (all when None) of a batch from its packing: each chunk (`cut` from the
    item `fetch` returns for its key) where the packer put its code. "items" counts the stream
    items the whole batch begins (the chunks numbered 0), for the iterator's position."""
    codes, seg, pos = packing["tokens"], packing["tokens_segment_ids"], packing["tokens_positions"]
    starts = (pos == 0) & (seg != 0)
    begun = int((codes[starts] % FAN_OUT == 0).sum())
    if rows is not None:
        codes, seg, pos, starts = codes[rows], seg[rows], pos[rows], starts[rows]
    tokens, targets = np.zeros(seg.shape, np.int32), np.zeros(seg.shape, np.int32)
    items = {}  # an item with several chunks here is read once
    for row, col in zip(*np.nonzero(starts)):
        key, number = divmod(int(codes[row, col]), FAN_OUT)
        if key not in items:
            items[key] = fetch(key)
        chunk = cut(items[key], number)
        end = col + len(chunk["tokens"])
        tokens[row, col:end], targets[row, col:end] = chunk["tokens"], chunk["targets"]
    return {"tokens": tokens, "targets": targets, "segment_ids": seg, "positions": pos,
            "items": begun}
