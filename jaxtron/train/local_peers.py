"""How the local tier's files move between hosts: each process keeps a copy of a peer's file
(the process of the same local rank on the next host), and hands a file it holds to a process
that lost its own. A small TCP server per process, off the devices and the step's path; each
request carries the receiving server's token (jaxtron/train/local_tier.py exchanges the
addresses and tokens with an allgather).
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from pathlib import Path
from typing import Callable

from jaxtron.train.local_files import CHUNK, write

TIMEOUT_S = 120.0  # a peer that takes longer to accept a copy or answer a fetch is not answering


def peers(nodes: tuple[str, ...]) -> list[int | None]:
    """peers[i]: the process that keeps a copy of process i's shards: the one of the same local
    rank on the next host (hosts in order of their first process), None on a single host."""
    hosts = list(dict.fromkeys(nodes))
    if len(hosts) < 2:
        return [None] * len(nodes)
    members = {h: [i for i, n in enumerate(nodes) if n == h] for h in hosts}
    out: list[int | None] = []
    for i, node in enumerate(nodes):
        rank = members[node].index(i)
        following = members[hosts[(hosts.index(node) + 1) % len(hosts)]]
        out.append(following[rank % len(following)])
    return out


class Server:
    """A TCP server in this process: keeps a peer's copies (PUT) in `root`, and hands out a file
    it holds (GET) to a process that lost its own. Each request carries the server's token."""

    def __init__(self, directory: Path, prune: Callable[[int], None]):
        self.root, self.prune = directory, prune
        self.token = secrets.token_hex(16)
        self.sock = socket.create_server(("", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="local-tier", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            try:
                conn.settimeout(TIMEOUT_S)
                request = json.loads(stream.readline())
                if request.get("token") != self.token:
                    return
                path = self.root / str(request["step"]) / f"process_{request['owner']}"
                if request["op"] == "put":
                    write(path, exactly(stream, request["size"]))
                    conn.sendall(b"ok\n")
                    self.prune(request["owner"])
                elif request["op"] == "get":
                    size = path.stat().st_size if path.is_file() else -1
                    conn.sendall(f"{size}\n".encode())
                    if size >= 0:
                        with path.open("rb") as f:
                            conn.sendfile(f)
            except (OSError, ValueError, KeyError):
                return  # the asking side sees the connection close without an answer

    def close(self) -> None:
        self.sock.close()


def exactly(stream, size: int):
    left = size
    while left:
        chunk = stream.read(min(left, CHUNK))
        if not chunk:
            raise OSError("the sender closed the connection early")
        left -= len(chunk)
        yield chunk


def reachable_ip() -> str:
    """This host's address as the other hosts reach it: the interface toward the coordinator."""
    from jax._src import distributed as jax_distributed

    coordinator = getattr(jax_distributed.global_state, "coordinator_address", None) or ""
    host = coordinator.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def request(address: dict, request: dict) -> socket.socket:
    conn = socket.create_connection((address["ip"], address["port"]), timeout=TIMEOUT_S)
    conn.sendall(json.dumps({**request, "token": address["token"]}).encode() + b"\n")
    return conn
