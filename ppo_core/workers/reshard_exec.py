"""Executing a :class:`~ppo_core.workers.reshard.ReshardPlan` worker to worker (the controller sends only the plan).

Rows travel packed: one transfer is one ``uint8`` buffer holding, key after key, the bytes of its ``rows`` rows
(:func:`pack`), unpacked into the consumer's freshly allocated shard (:func:`unpack_into`). Two executors:

- :func:`run_p2p`: ``torch.distributed`` point-to-point inside one group whose ranks run concurrently (one
  process per rank): every rank posts its ``isend`` / ``irecv`` and waits; gloo here (a dedicated gloo group
  when the workers already use another backend), the NCCL variant is the same calls on CUDA buffers.
- :class:`TcpReceiver` + :func:`tcp_send`: across groups (or in a backend whose ranks do not run concurrently):
  each consumer rank listens on a port the OS picks and receives in a background thread; producers connect and
  send. A transfer whose source and destination are the same process (same group, same rank) is a local copy.

Every wait has a deadline (``timeout_s``): the gloo group's timeout, the sockets' timeouts, and the receiver's
join; a missed deadline raises ``TimeoutError`` naming the transfers still missing.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.workers.reshard import ReshardPlan, Transfer
from ppo_core.workers.resident import KeySpec, ResidentStore

__all__ = ["TcpReceiver", "allocate", "pack", "run_p2p", "tcp_send", "unpack_into"]

_HEADER = struct.Struct("<IQ")  # transfer index, payload bytes

Keys = Sequence[tuple[str, KeySpec]]


def allocate(keys: Keys, rows: int) -> TensorDict:
    """An uninitialised ``[rows]`` shard of ``keys``."""
    return TensorDict(
        {k: torch.empty((rows, *spec.shape), dtype=spec.dtype) for k, spec in keys}, batch_size=[rows]
    )


def pack(data: TensorDictBase, keys: Keys, start: int, rows: int) -> torch.Tensor:
    """``[n]`` uint8: rows ``start:start+rows`` of every key, key after key."""
    parts = [data.get(k)[start : start + rows].contiguous().view(torch.uint8).reshape(-1) for k, _ in keys]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def packed_nbytes(keys: Keys, rows: int) -> int:
    """Size of :func:`pack`'s buffer for ``rows`` rows."""
    return sum(rows * spec.row_nbytes() for _, spec in keys)


def unpack_into(out: TensorDictBase, keys: Keys, buf: torch.Tensor, dst_start: int, rows: int) -> None:
    """Write a packed buffer's rows into ``out`` at ``dst_start``."""
    at = 0
    for k, spec in keys:
        n = rows * spec.row_nbytes()
        if n:
            dest = out.get(k)[dst_start : dst_start + rows]
            dest.view(torch.uint8).reshape(-1).copy_(buf[at : at + n])
        at += n


def _local_copy(store: ResidentStore, source_id: str, keys: Keys, t: Transfer, out: TensorDictBase) -> None:
    src = store.get(source_id, [k for k, _ in keys])
    for k, _ in keys:
        out.get(k)[t.dst_start : t.dst_start + t.rows].copy_(src.get(k)[t.src_start : t.src_start + t.rows])


# ----- torch.distributed point-to-point ------------------------------------------------------------------------
_GLOO_GROUPS: dict[float, object] = {}


def _gloo_group(timeout_s: float) -> object | None:
    """The process group to move rows in: the default one when it is gloo (initialised here from the torchrun
    environment if nobody did), else a dedicated gloo group (a collective: every rank of the group calls it)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    if dist.get_backend() == "gloo":
        return None
    if timeout_s not in _GLOO_GROUPS:
        _GLOO_GROUPS[timeout_s] = dist.new_group(backend="gloo", timeout=timeout)
    return _GLOO_GROUPS[timeout_s]


def run_p2p(
    store: ResidentStore, plan: ReshardPlan, source_id: str, keys: Keys, rank: int, timeout_s: float
) -> TensorDict | None:
    """One rank's part of an in-group reshard: send its rows, receive its new shard (None if not a consumer rank)."""
    import torch.distributed as dist

    if not plan.same_group:
        raise ValueError("run_p2p moves rows inside one group; across groups use the TCP executor")
    group = _gloo_group(timeout_s)
    is_consumer = rank < plan.target.layout.world_size
    out = allocate(keys, plan.dst_rows(rank)) if is_consumer else None
    works, received = [], []
    for t in plan.receives_of(rank):
        if t.src_rank == rank:
            _local_copy(store, source_id, keys, t, out)
            continue
        buf = torch.empty(packed_nbytes(keys, t.rows), dtype=torch.uint8)
        works.append(dist.irecv(buf, src=t.src_rank, group=group))
        received.append((t, buf))
    if any(t.dst_rank != rank for t in plan.sends_of(rank)):
        data = store.get(source_id, [k for k, _ in keys])
        for t in plan.sends_of(rank):
            if t.dst_rank != rank:
                works.append(dist.isend(pack(data, keys, t.src_start, t.rows), dst=t.dst_rank, group=group))
    for w in works:
        w.wait(datetime.timedelta(seconds=timeout_s))
    for t, buf in received:
        unpack_into(out, keys, buf, t.dst_start, t.rows)
    return out


# ----- TCP --------------------------------------------------------------------------------------------------------
def _advertised_host(host: str | None) -> str:
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TcpReceiver:
    """A consumer rank's end of a TCP reshard: listens now, receives in a background thread, :meth:`finish` waits.

    Args:
        plan: the reshard.
        rank: this consumer rank.
        keys: the keys moved.
        timeout_s: deadline for every transfer to arrive, from construction.
        host: the address producers connect to (default: this host's address).
    """

    def __init__(
        self, plan: ReshardPlan, rank: int, keys: Keys, timeout_s: float, host: str | None = None
    ) -> None:
        self.plan, self.rank, self.keys = plan, rank, list(keys)
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self.out = allocate(self.keys, plan.dst_rows(rank))
        self._expect = {
            i: t
            for i, t in enumerate(plan.transfers)
            if t.dst_rank == rank and not (plan.same_group and t.src_rank == rank)
        }
        self._got: dict[int, torch.Tensor] = {}
        self._error: BaseException | None = None
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(max(1, len(self._expect)))
        self.address = (_advertised_host(host), self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name=f"ppo-reshard-recv-{rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while len(self._got) < len(self._expect):
                left = self._deadline - time.monotonic()
                if left <= 0:
                    return
                self._sock.settimeout(left)
                conn, _ = self._sock.accept()
                with conn:
                    conn.settimeout(max(0.001, self._deadline - time.monotonic()))
                    while True:
                        head = _recv_exact(conn, _HEADER.size, allow_eof=True)
                        if head is None:
                            break
                        index, n = _HEADER.unpack(head)
                        if index not in self._expect or n != packed_nbytes(
                            self.keys, self._expect[index].rows
                        ):
                            raise ValueError(
                                f"unexpected transfer {index} of {n} bytes at consumer rank {self.rank}"
                            )
                        buf = torch.empty(n, dtype=torch.uint8)
                        _recv_into(conn, memoryview(buf.numpy()))
                        self._got[index] = buf
        except BaseException as exc:  # handed to finish()
            self._error = exc
        finally:
            self._sock.close()

    def finish(self, store: ResidentStore, source_id: str) -> TensorDict:
        """Wait (until the deadline) for every transfer, add the local copies, return the new shard."""
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._error is not None:
            raise RuntimeError(
                f"consumer rank {self.rank}: receiving rows failed: {self._error!r}"
            ) from self._error
        missing = sorted(set(self._expect) - set(self._got))
        if missing:
            raise TimeoutError(
                f"consumer rank {self.rank}: transfers {[self._expect[i] for i in missing]} did not arrive within "
                f"{self._timeout_s} s"
            )
        for i, t in enumerate(self.plan.transfers):
            if t.dst_rank != self.rank:
                continue
            if i in self._got:
                unpack_into(self.out, self.keys, self._got[i], t.dst_start, t.rows)
            else:
                _local_copy(store, source_id, self.keys, t, self.out)
        return self.out

    def close(self) -> None:
        """Stop listening (a reshard abandoned before :meth:`finish`)."""
        self._sock.close()


def tcp_send(
    store: ResidentStore,
    plan: ReshardPlan,
    source_id: str,
    keys: Keys,
    rank: int,
    addresses: Sequence[tuple[str, int] | None],
    timeout_s: float,
) -> int:
    """A producer rank's part of a TCP reshard: one connection per consumer rank it feeds; the bytes sent."""
    deadline = time.monotonic() + timeout_s
    by_dst: dict[int, list[tuple[int, Transfer]]] = {}
    for i, t in enumerate(plan.transfers):
        if t.src_rank == rank and not (plan.same_group and t.dst_rank == rank):
            by_dst.setdefault(t.dst_rank, []).append((i, t))
    if not by_dst:
        return 0
    data = store.get(source_id, [k for k, _ in keys])
    sent = 0
    for dst, items in by_dst.items():
        address = addresses[dst]
        if address is None:
            raise ValueError(f"consumer rank {dst} has no receiver address")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"producer rank {rank}: the reshard passed its {timeout_s} s deadline")
        with socket.create_connection(tuple(address), timeout=left) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i, t in items:
                buf = pack(data, keys, t.src_start, t.rows)
                conn.sendall(_HEADER.pack(i, buf.numel()))
                conn.sendall(memoryview(buf.numpy()))
                sent += buf.numel()
    return sent


def _recv_exact(conn: socket.socket, n: int, allow_eof: bool = False) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(n - got)
        if not chunk:
            if allow_eof and got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n
