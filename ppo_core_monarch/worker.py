"""``WorkerActor``: the one generic Monarch actor per process; the user's worker is a plain object it owns.

Life of a rank:

1. ``__init__`` (sent to the whole spawn mesh, so ``current_rank()`` is the *global* rank) records the rank
   and its mesh coordinates; nothing heavy happens here, because a failing ``__init__`` only surfaces later as a
   supervision event.
2. rank 0 only: ``host_store`` starts the ``torch.distributed`` TCPStore on a port the OS picks (or a
   configured one, retried on collision) and returns ``(hostname, port)``.
3. ``setup`` checks that the controller's topology puts this process where Monarch does, exports the
   torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
   ``MASTER_PORT``; ``TORCHELASTIC_USE_AGENT_STORE`` so every rank joins rank 0's store as a client), selects
   the CUDA device of its local rank, and builds the worker inside ``worker_context``. Its exceptions come back
   as :class:`~ppo_core_monarch.errors.RemoteWorkerError` naming the rank.
4. ``run`` calls one method; ``close`` releases the worker and the store.

Exceptions never escape an endpoint: they are returned as a :class:`Failed` value, so a failing rank cannot
hide the answers of the others and never counts as an actor failure.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import traceback
from dataclasses import dataclass
from typing import Any

from monarch.actor import Actor, current_rank, current_size, endpoint

from ppo_core.workers.base import WorkerSpec, resolve_method, worker_context
from ppo_core.workers.errors import RankLocation
from ppo_core_monarch.errors import RemoteWorkerError
from ppo_core_monarch.liveness import process_namespace
from ppo_core_monarch.topology import MeshTopology
from ppo_core_monarch.transport import Encoded, decode_borrowed, encode

__all__ = ["Answer", "Failed", "RankInfo", "SetupArgs", "WorkerActor"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """What a worker process reports after ``setup``: who and where it is."""

    rank: int
    coords: tuple[int, ...]
    host: str
    pid: int
    local_rank: int
    device: str
    shared_memory: bool
    process_namespace: str | None = None
    """Kernel boot id and pid namespace of the process (:func:`~ppo_core_monarch.liveness.process_namespace`)."""


@dataclass(frozen=True)
class SetupArgs:
    """Everything ``WorkerActor.setup`` needs (one message, the same for every rank)."""

    spec: WorkerSpec
    topology: MeshTopology
    master_addr: str
    master_port: int
    device: str
    shm_dir: str | None
    shm_token: str | None
    shm_threshold_bytes: int
    torch_threads: int
    env: dict[str, str]


@dataclass(frozen=True)
class Answer:
    """The output of a call whose arguments came through shared memory, and whether their file was released."""

    value: Any
    released: bool


@dataclass(frozen=True)
class Failed:
    """An exception raised on a rank, carried back as a value (``cause``: the pickled original, if picklable)."""

    error: RemoteWorkerError
    cause: bytes | None

    def to_exception(self) -> RemoteWorkerError:
        """The error to raise on the controller, chained to the original exception when it unpickles."""
        err = self.error
        if self.cause is not None:
            try:
                err.__cause__ = pickle.loads(self.cause)
            except Exception:
                err.__cause__ = None
        return err


class WorkerActor(Actor):
    """One per process: owns the user's worker and runs its methods (see the module docstring)."""

    def __init__(self) -> None:
        point = current_rank()
        self._rank = int(point.rank)
        self._sizes = dict(current_size())
        self._coords = tuple(int(point[label]) for label in self._sizes)
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._worker: Any = None
        self._store: Any = None
        self._shm: tuple[str, int] | None = None

    def _fail(self, method: str, exc: BaseException) -> Failed:
        try:
            cause = pickle.dumps(exc)
        except Exception:
            cause = None
        error = RemoteWorkerError(
            rank=self._rank,
            host=self._host,
            pid=self._pid,
            method=method,
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            remote_traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )
        return Failed(error=error, cause=cause)

    @endpoint
    def host_store(self, port: int, retries: int) -> tuple[str, int] | Failed:
        """Start the rendezvous TCPStore here; returns ``(hostname, port)`` (port 0: the OS picks one)."""
        try:
            from torch.distributed import TCPStore

            candidates = [0] if port == 0 else [port + i for i in range(retries + 1)]
            last: BaseException | None = None
            for candidate in candidates:
                try:
                    self._store = TCPStore("0.0.0.0", candidate, is_master=True, wait_for_workers=False)
                    return self._host, int(self._store.port)
                except (RuntimeError, OSError) as exc:  # EADDRINUSE: another job took the port
                    logger.warning(
                        "rank %d: port %d is taken (%s); trying the next one", self._rank, candidate, exc
                    )
                    last = exc
            raise RuntimeError(f"no free port in {candidates}") from last
        except Exception as exc:
            return self._fail("host_store", exc)

    @endpoint
    def setup(self, args: SetupArgs) -> RankInfo | Failed:
        """Check the rank view, export the distributed environment, pick the device, build the worker."""
        try:
            return self._setup(args)
        except Exception as exc:
            return self._fail(f"setup[{args.spec.cls.__qualname__}]", exc)

    def _setup(self, args: SetupArgs) -> RankInfo:
        topo = args.topology
        mine = MeshTopology(labels=tuple(self._sizes), sizes=tuple(self._sizes.values()))
        if mine != topo or topo.coords(self._rank) != self._coords:
            raise RuntimeError(
                f"rank view mismatch: Monarch places this process at rank {self._rank}, coords {self._coords} "
                f"of {mine}; the controller's topology {topo} puts rank {self._rank} at "
                f"{topo.coords(self._rank) if self._rank < topo.world_size else 'nowhere'}"
            )
        env = topo.dist_env(self._rank, args.master_addr, args.master_port)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        env.update(args.env)
        os.environ.update(env)
        local_rank = topo.local_rank_of(self._rank)
        threads = _torch_threads(args.torch_threads, topo.local_size)
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        device = _select_device(args.device, local_rank)
        self._shm = _probe_shared_memory(args.shm_dir, args.shm_token, args.shm_threshold_bytes)
        with worker_context(rank=self._rank, world_size=topo.world_size, local_rank=local_rank):
            self._worker = args.spec.build()
        return RankInfo(
            rank=self._rank,
            coords=self._coords,
            host=self._host,
            pid=self._pid,
            local_rank=local_rank,
            device=device,
            shared_memory=self._shm is not None,
            process_namespace=process_namespace(),
        )

    @endpoint
    def run(self, method: str, payload: Encoded | tuple[tuple, dict]) -> Any:
        """Run ``method`` (``"role.name"`` reaches a colocated role) on ``(args, kwargs)``; returns its output.

        Shared-memory arguments are mapped privately and unmapped after the call; the answer says whether that
        worked (nothing kept a reference), so the controller knows whether it may reuse the file.
        """
        lease = None
        try:
            if isinstance(payload, Encoded):
                (args, kwargs), lease = decode_borrowed(payload)
            else:
                args, kwargs = payload
            del payload
            if self._worker is None:
                raise RuntimeError("the worker was not set up (or was closed)")
            out = resolve_method(self._worker, method)(*args, **kwargs)
            del args, kwargs
            if self._shm is not None:
                shm_dir, threshold = self._shm
                enc = encode(out, shm_dir, threshold)
                if enc.path is not None:
                    out = enc
            return out if lease is None else Answer(value=out, released=lease.release())
        except Exception as exc:
            if lease is not None:
                lease.release()
            return self._fail(method, exc)

    @endpoint
    def location(self) -> RankLocation:
        """This process's rank, host name and pid (asked once at start-up, for error messages)."""
        return RankLocation(self._rank, self._host, self._pid)

    @endpoint
    def ping(self) -> int:
        """Empty round trip (health check and benchmarks); returns the rank."""
        return self._rank

    @endpoint
    def close(self) -> Failed | None:
        """Close the worker (its ``close()``) and the store; idempotent."""
        worker, self._worker = self._worker, None
        try:
            close = getattr(worker, "close", None)
            if callable(close):
                close()
            return None
        except Exception as exc:
            return self._fail("close", exc)
        finally:
            self._store = None


def _torch_threads(requested: int, local_size: int) -> int:
    """Intra-op threads for this worker (``MonarchConfig.torch_threads``); 0 leaves torch as it is.

    Automatic (``requested == 0``): a positive ``OMP_NUM_THREADS`` in the environment (``worker_env``
    included) wins; else the usable cores are shared by the ``local_size`` workers of this host (torchrun
    likewise sets one thread per process when it starts several).
    """
    if requested > 0:
        return requested
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_size))


def _select_device(device: str, local_rank: int) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        if device == "cuda":
            raise RuntimeError("device='cuda' but CUDA is not available in this worker process")
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _probe_shared_memory(shm_dir: str | None, token: str | None, threshold: int) -> tuple[str, int] | None:
    """Whether this process sees the controller's tmpfs directory (same host): the token file must match."""
    if shm_dir is None or token is None:
        return None
    try:
        with open(os.path.join(shm_dir, "token"), encoding="utf-8") as f:
            return (shm_dir, threshold) if f.read() == token else None
    except OSError:
        return None
