"""``MonarchWorkerGroup``: the ``WorkerGroup`` protocol on a Monarch proc mesh, one process per rank.

Start-up (every step under ``MonarchConfig.ready_timeout_s``, rolled back on failure): spawn
``procs_per_host`` processes on every host, read the :class:`MeshTopology` from the proc mesh, spawn one
:class:`WorkerActor` per process, start the rendezvous store on rank 0, then ``setup`` every rank (rank check,
torch.distributed environment, device, worker constructor).

Calls (:meth:`_submit`): arguments shared by a range of consecutive ranks go out as **one** Monarch ``call`` on
that slice of the flattened mesh (uniform arguments: one call on the whole mesh); ranks with their own
arguments (data-parallel shards) get one message each, all issued before anything is waited on. Payloads for
processes on the controller's host travel through shared memory (:mod:`ppo_core_monarch.transport`), others
as compact pickles. Results come back in the order of the plan, as a :class:`GroupCall` with a deadline.

Failures: a raising method gives ``RemoteWorkerError`` (rank, host, pid, method, remote traceback); a dead
process or host gives ``WorkerLost``; a passed deadline ``CallTimeout``; each names its ranks' hosts and pids
(learnt from every process right after it starts). After the last two, or when the other ranks of a failed call
have not answered ``failure_grace_s`` later, the group is broken and every call raises ``GroupBroken`` at once.
:meth:`shutdown` is idempotent.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from ppo_core.workers.base import WorkerSpec
from ppo_core.workers.dispatch import DispatchPlan
from ppo_core.workers.errors import RankLocation
from ppo_core.workers.group import WorkerGroup
from ppo_core_monarch.calls import CallPart, GroupCall
from ppo_core_monarch.config import MonarchConfig
from ppo_core_monarch.errors import CallTimeout, GroupBroken, SpawnError, WorkerLost
from ppo_core_monarch.launch import Hosts, local_hosts
from ppo_core_monarch.liveness import LocalExitProbe
from ppo_core_monarch.supervision import fault_monitor
from ppo_core_monarch.topology import MeshTopology
from ppo_core_monarch.transport import Encoded, ShmPool, compact, encode, release
from ppo_core_monarch.worker import Failed, RankInfo, SetupArgs, WorkerActor

__all__ = ["MonarchWorkerGroup"]

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[MonarchWorkerGroup] = weakref.WeakSet()


def controller_logs_unprefixed() -> None:
    """Keep Monarch from prefixing this (controller) process's log records with ``[actor=<root>]``.

    Once a process has a Monarch context, Monarch adds a filter to every logging handler that rewrites each record's
    message with the actor's name; in the controller that name is always ``<root>``, and with several handlers the
    same record is rewritten once per handler (``[actor=<root>] [actor=<root>] ...``). Worker processes keep the
    prefix, where it names the rank's actor. Called by the groups before they spawn processes."""
    try:
        from monarch._src.actor import config as monarch_actor_config
    except ImportError:  # another Monarch layout: leave its logging alone
        return
    if hasattr(monarch_actor_config, "prefix_python_logs_with_actor"):
        monarch_actor_config.prefix_python_logs_with_actor = False


class MonarchWorkerGroup(WorkerGroup):
    """Run ``spec`` on ``procs_per_host`` Monarch processes per host (see the module docstring).

    Args:
        spec: the worker class and constructor arguments (a bare class is accepted).
        procs_per_host: processes per host; default: the number of CUDA devices, or 1 without CUDA.
        hosts: where to run (:func:`local_hosts`, :func:`attach_hosts`, :func:`job_hosts`); default: this
            machine. The group shuts down hosts it owns.
        config: deadlines, device and transport.
        local_dim: name of the per-host mesh dimension.

    Example:
        >>> from ppo_core.workers import Worker
        >>> with MonarchWorkerGroup(Worker, procs_per_host=2) as wg:  # doctest: +SKIP
        ...     [w.rank for w in wg.call_all("worker_layout")]
        [0, 1]
    """

    compacts_payloads = True
    """:meth:`_payload` copies every tensor into shared memory (same host) or clones views before pickling
    (other hosts), so data-parallel shards arrive as views of the batch and are copied once, not twice."""

    _broken_error = GroupBroken

    concurrent_ranks = True
    """One process per rank: in-group reshards of resident batches use torch.distributed point-to-point."""

    def __init__(
        self,
        spec: WorkerSpec | type,
        *,
        procs_per_host: int | None = None,
        hosts: Hosts | None = None,
        config: MonarchConfig | None = None,
        local_dim: str = "procs",
    ) -> None:
        if isinstance(spec, type):
            spec = WorkerSpec(spec)
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be a WorkerSpec or a class, got {type(spec).__name__}")
        self.config = config if config is not None else MonarchConfig()
        if not isinstance(self.config, MonarchConfig):
            raise TypeError(f"config must be a MonarchConfig, got {type(self.config).__name__}")
        if procs_per_host is None:
            procs_per_host = _default_procs_per_host()
        if not isinstance(procs_per_host, int) or procs_per_host < 1:
            raise ValueError(f"procs_per_host must be a positive int, got {procs_per_host!r}")
        self.call_timeout_s = self.config.call_timeout_s
        self.failure_grace_s = self.config.failure_grace_s
        self._hosts = hosts if hosts is not None else local_hosts()
        self._name = f"ppo_worker_{uuid.uuid4().hex[:10]}"
        self._watch = fault_monitor().watch(self._name)
        self._broken: BaseException | None = None
        self._outstanding: list[GroupCall] = []
        self._where: dict[int, RankLocation] = {}
        self._exit_probe = LocalExitProbe(())  # sees no rank until setup reports where they run
        self._proc_mesh: Any = None
        self._shm_dir: str | None = None
        self._pool: ShmPool | None = None
        self._singletons: dict[int, Any] = {}
        self._ranges: dict[tuple[int, int], Any] = {}
        self.config.apply()
        try:
            self._start(spec, procs_per_host, local_dim)
        except BaseException:
            self._teardown(graceful=False)
            raise
        _LIVE.add(self)
        super().__init__(spec)
        if hasattr(spec.cls, "worker_layout"):
            # fetched now so that a later dispatch inside an event loop never blocks on it
            _ = self.layout

    # ----- start-up ---------------------------------------------------------------------------------------
    def _start(self, spec: WorkerSpec, procs_per_host: int, local_dim: str) -> None:
        cfg = self.config
        controller_logs_unprefixed()
        self._proc_mesh = self._hosts.mesh.spawn_procs(per_host={local_dim: procs_per_host}, name=self._name)
        self.topology = MeshTopology.from_mesh(self._proc_mesh)
        self._actors = self._proc_mesh.spawn(self._name, WorkerActor)
        self._flat = self._actors.flatten("rank")
        try:
            self._actors.initialized.get(timeout=cfg.ready_timeout_s)
        except Exception as exc:
            raise SpawnError(
                f"{self.topology.world_size} worker processes ({self.topology}) did not start within "
                f"{cfg.ready_timeout_s} s: {exc!r}"
            ) from exc
        ranks = tuple(range(self.topology.world_size))
        # host and pid of every rank before anything can fail, so that every error can name them
        for loc in self._wait_setup(
            "location", CallPart(self._actors.location.call(), ranks, ranks, mesh=True)
        ):
            self._where[loc.rank] = loc
        shm_token = None
        if cfg.shared_memory:
            self._shm_dir = tempfile.mkdtemp(prefix="ppo_core_monarch-", dir=cfg.shm_root)
            shm_token = uuid.uuid4().hex
            with open(os.path.join(self._shm_dir, "token"), "w", encoding="utf-8") as f:
                f.write(shm_token)
            self._pool = ShmPool(self._shm_dir, cfg.shm_pool_bytes)
        store = self._rank_mesh(0).host_store.call_one(cfg.master_port, cfg.master_port_retries)
        addr, port = self._wait_setup("host_store", CallPart(store, (0,), (0,), mesh=False))[0]
        args = SetupArgs(
            spec=spec,
            topology=self.topology,
            master_addr=addr,
            master_port=port,
            device=cfg.device,
            shm_dir=self._shm_dir,
            shm_token=shm_token,
            shm_threshold_bytes=cfg.shm_threshold_bytes,
            torch_threads=cfg.torch_threads,
            env=dict(cfg.worker_env),
        )
        infos = self._wait_setup("setup", CallPart(self._actors.setup.call(args), ranks, ranks, mesh=True))
        for expected, info in enumerate(infos):
            if (
                not isinstance(info, RankInfo)
                or info.rank != expected
                or info.coords != self.topology.coords(expected)
            ):
                raise SpawnError(
                    f"rank {expected} reported {info!r}; the topology expects coords "
                    f"{self.topology.coords(expected)}"
                )
        self.rank_info: tuple[RankInfo, ...] = tuple(infos)
        self._exit_probe = LocalExitProbe([(i.rank, i.pid, i.process_namespace) for i in infos])
        self._shm_ranks = frozenset(i.rank for i in infos if i.shared_memory)
        logger.info("started %s: %s on hosts %s", self._name, self.topology, sorted({i.host for i in infos}))

    def _wait_setup(self, what: str, part: CallPart) -> list[Any]:
        try:
            return self._make_call(what, [part], len(part.ranks), self.config.ready_timeout_s, []).result()
        except CallTimeout as exc:
            raise SpawnError(f"{what} did not finish within {self.config.ready_timeout_s} s: {exc}") from exc

    # ----- protocol -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def _submit(self, method: str, plan: DispatchPlan) -> GroupCall:
        if self._broken is not None:
            raise GroupBroken(
                f"cannot call {method}(): the group is broken ({self._broken})"
            ) from self._broken
        self._reap()
        order = sorted(range(len(plan.calls)), key=lambda i: plan.calls[i].rank)
        runs: list[list[int]] = []
        for i in order:
            call = plan.calls[i]
            if runs:
                last = plan.calls[runs[-1][-1]]
                same = plan.uniform or (
                    _same_objects(last.args, call.args) and _same_kwargs(last.kwargs, call.kwargs)
                )
                if same and call.rank == last.rank + 1:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        parts, forward, payloads = [], [], []
        for run in runs:  # every payload is written before the first message goes out: once a worker starts,
            # it competes for the CPU with the copies still to make
            ranks = tuple(plan.calls[i].rank for i in run)
            first = plan.calls[run[0]]
            payloads.append(self._payload(ranks, first.args, first.kwargs, forward))
        for run, payload in zip(runs, payloads, strict=True):
            ranks = tuple(plan.calls[i].rank for i in run)
            if len(ranks) == 1:
                future = self._rank_mesh(ranks[0]).run.call_one(method, payload)
            else:
                future = self._range_mesh(ranks[0], ranks[-1] + 1).run.call(method, payload)
            parts.append(CallPart(future=future, ranks=ranks, positions=tuple(run), mesh=len(ranks) > 1))
        call = self._make_call(method, parts, len(plan.calls), self.call_timeout_s, forward)
        self._outstanding.append(call)
        return call

    def _payload(self, ranks: tuple[int, ...], args: tuple, kwargs: dict, forward: list) -> Any:
        """What one message carries. Never a tensor view as is (``compacts_payloads``): a pickled view would
        ship its parent's whole storage, so views go to shared memory (written compactly) or are cloned."""
        if not _has_tensor((args, kwargs)):
            return (args, kwargs)  # nothing to share: skip the extra pickle (empty calls stay at raw speed)
        if self._pool is not None and all(r in self._shm_ranks for r in ranks):
            threshold = self.config.shm_threshold_bytes
            # views too small for shared memory are pickled into the skeleton: clone those (cheap) first
            obj = compact((tuple(args), dict(kwargs)), threshold_bytes=threshold)
            enc = encode(obj, self._pool.directory, threshold, self._pool.allocate)
            if enc.path is not None:
                forward.append((enc, ranks))
                return enc
            return obj
        return compact((tuple(args), dict(kwargs)))

    def _make_call(
        self, method: str, parts: list[CallPart], n: int, timeout_s: float, forward: list
    ) -> GroupCall:
        return GroupCall(
            method=method,
            parts=parts,
            n_outputs=n,
            timeout_s=timeout_s,
            watch=self._watch,
            wait_slice_s=self.config.wait_slice_s,
            on_broken=self._mark_broken,
            locate=self._ranks_in_report,
            where=self.rank_locations,
            exited=self._exit_probe.exited,
            forward=forward,
            recycle=self._recycle,
        )

    def _recycle(self, enc: Encoded, reusable: bool) -> None:
        if self._pool is None:
            release(enc)
        elif reusable:
            self._pool.give_back(enc.path)
        else:
            self._pool.discard(enc.path)

    def _rank_mesh(self, rank: int) -> Any:
        mesh = self._singletons.get(rank)
        if mesh is None:
            mesh = self._singletons[rank] = self._flat.slice(rank=rank)
        return mesh

    def _range_mesh(self, lo: int, hi: int) -> Any:
        if (lo, hi) == (0, self.world_size):
            return self._actors
        mesh = self._ranges.get((lo, hi))
        if mesh is None:
            mesh = self._ranges[(lo, hi)] = self._flat.slice(rank=slice(lo, hi))
        return mesh

    def rank_locations(self, ranks: Sequence[int]) -> tuple[RankLocation, ...]:
        """Host and pid of ``ranks`` (reported by each process when it started)."""
        return tuple(self._where.get(int(r), RankLocation(int(r))) for r in ranks)

    def _ranks_in_report(self, report: str) -> tuple[int, ...]:
        return _ranks_in_report(report, self.topology)

    def _reap(self) -> None:
        self._outstanding = [c for c in self._outstanding if not c.drain()]

    def ping(self, timeout_s: float | None = None) -> list[int]:
        """Empty round trip to every rank (one mesh-wide call); returns the ranks in order."""
        if self._broken is not None:
            raise GroupBroken(f"the group is broken ({self._broken})") from self._broken
        part = CallPart(
            self._actors.ping.call(), tuple(range(self.world_size)), tuple(range(self.world_size)), True
        )
        return self._make_call("ping", [part], self.world_size, timeout_s or self.call_timeout_s, []).result()

    # ----- shutdown --------------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        self._teardown(graceful=True)

    def _teardown(self, graceful: bool) -> None:
        cfg = self.config
        start = time.monotonic()
        step_s = cfg.shutdown_timeout_s
        if isinstance(self._broken, WorkerLost):
            step_s = min(step_s, cfg.lost_shutdown_timeout_s)
        self._watch.expected = True
        _LIVE.discard(self)
        if graceful and self._broken is None and self._proc_mesh is not None:
            for call in self._outstanding:
                try:
                    call.result(timeout=step_s)
                except Exception as exc:
                    logger.warning("outstanding %s() ended with %r during shutdown", call.method, exc)
            try:
                closes = self._actors.close.call().get(timeout=step_s)
                for value in closes.values():
                    if isinstance(value, Failed):
                        logger.warning("%s", value.error)
            except Exception as exc:
                logger.warning("closing the workers of %s failed: %r", self._name, exc)
        self._reap()
        if self._proc_mesh is not None:
            logger.debug("%s: workers closed after %.2f s", self._name, time.monotonic() - start)
            try:
                self._proc_mesh.stop("ppo_core_monarch shutdown").get(timeout=step_s)
            except Exception as exc:
                logger.warning("stopping the processes of %s failed: %r", self._name, exc)
        logger.debug("%s: processes stopped after %.2f s", self._name, time.monotonic() - start)
        try:
            self._hosts.shutdown(step_s)
        except Exception as exc:
            logger.warning("shutting down the hosts of %s failed: %r", self._name, exc)
        for call in self._outstanding:
            call.release_all()
        self._outstanding.clear()
        if self._pool is not None:
            self._pool.close()
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)
        fault_monitor().unwatch(self._watch)
        logger.info("shut down %s in %.2f s", self._name, time.monotonic() - start)


def _has_tensor(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` holds a tensor or TensorDict (containers searched a few levels deep)."""
    if isinstance(obj, (torch.Tensor, TensorDictBase)):
        return True
    if depth > 3:
        return True  # deep structures: let the encoder decide
    if isinstance(obj, dict):
        return any(_has_tensor(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v, depth + 1) for v in obj)
    return hasattr(obj, "__dict__") or hasattr(obj, "__slots__")  # arbitrary objects may hold tensors


def _same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _same_kwargs(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def _ranks_in_report(report: str, topology: MeshTopology) -> tuple[int, ...]:
    """Ranks whose mesh point (``{'hosts': 1/2, 'procs': 0/2}``) appears in a Monarch failure report."""
    import re

    ranks = set()
    for body in re.findall(r"\{([^{}]*)\}", report):
        coords = dict(re.findall(r"'([^']+)':\s*(\d+)/\d+", body))
        if set(coords) == set(topology.labels):
            try:
                ranks.add(topology.rank_of({k: int(v) for k, v in coords.items()}))
            except ValueError:
                continue
    return tuple(sorted(ranks))


def _default_procs_per_host() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


@atexit.register
def _shutdown_live_groups() -> None:
    for group in list(_LIVE):
        try:
            group.shutdown()
        except Exception:
            logger.exception("shutting down a worker group at exit failed")
