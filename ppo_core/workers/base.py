"""The ``Worker`` base class, its rank context, and the ``@register`` decorator for group-callable methods.

A worker is an ordinary Python object that lives in one process (one rank) of a worker group. Backends
(local, Monarch, Ray...) construct it inside :func:`worker_context`, so ``Worker.__init__`` knows its rank and
world size without reading per-process global state; outside a context it falls back to the ``RANK`` /
``WORLD_SIZE`` / ``LOCAL_RANK`` environment variables (torchrun, ``monarch.spmd.setup_torch_elastic_env``) and
then to a single rank.

Methods the controller calls through a group are marked with :func:`register`, which records how arguments are
dispatched to ranks and how results are collected (see :mod:`ppo_core.workers.dispatch`). Dotted names such as
``"actor.compute_log_prob"`` reach role instances held by a :class:`ColocatedWorker`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ppo_core.workers.dispatch import Dispatch, DispatchMode, Execute, WorkerLayout, resolve_dispatch
from ppo_core.workers.resident import BatchRef, Keep, ResidentStore, keep_output, resolve_refs

__all__ = [
    "ColocatedWorker",
    "Registration",
    "Worker",
    "WorkerContext",
    "WorkerSpec",
    "current_worker_context",
    "get_registration",
    "register",
    "registered_methods",
    "resolve_method",
    "worker_context",
]

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRATION_ATTR = "__ppo_core_registration__"

KEEP_KWARG = "__ppo_core_keep__"
"""The keyword argument a resident call carries its :class:`~ppo_core.workers.resident.Keep` in (never seen by the
method: :func:`resolve_method`'s wrapper takes it out)."""

_SHARED_STORE: contextvars.ContextVar[ResidentStore | None] = contextvars.ContextVar(
    "ppo_core_resident_store", default=None
)


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """Where a worker runs: its global rank, the group's world size, and its rank on the host."""

    rank: int
    world_size: int
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")


_CONTEXT: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar(
    "ppo_core_worker", default=None
)


@contextlib.contextmanager
def worker_context(rank: int, world_size: int, local_rank: int = 0) -> Iterator[WorkerContext]:
    """Backends construct workers inside this context so that ``Worker.__init__`` sees its rank.

    Example:
        >>> with worker_context(rank=1, world_size=2):
        ...     w = Worker()
        >>> (w.rank, w.world_size, w.dp_rank, w.dp_size)
        (1, 2, 1, 2)
    """
    token = _CONTEXT.set(WorkerContext(rank=rank, world_size=world_size, local_rank=local_rank))
    try:
        yield _CONTEXT.get()  # type: ignore[misc]
    finally:
        _CONTEXT.reset(token)


def current_worker_context() -> WorkerContext:
    """The rank a worker being built runs as: the backend's :func:`worker_context`, else the ``RANK`` /
    ``WORLD_SIZE`` / ``LOCAL_RANK`` environment variables, else rank 0 of 1 (what ``Worker.__init__`` reads; worker
    constructors that build engines before ``Worker.__init__`` read it too).

    Example:
        >>> with worker_context(rank=1, world_size=2):
        ...     current_worker_context().rank
        1
    """
    ctx = _CONTEXT.get()
    if ctx is not None:
        return ctx
    return WorkerContext(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


class Worker:
    """Base class for the objects a worker group runs, one per rank.

    By default every rank is its own data-parallel rank (``dp_rank == rank``, ``dp_size == world_size``) and
    is collected. Tensor/pipeline-parallel workers call :meth:`set_dp_layout` in ``__init__`` so that their
    TP/PP peers receive the same shard and only one of them (``is_collect_rank``) is collected.

    Example:
        >>> class Doubler(Worker):
        ...     @register(dispatch=Dispatch.DP_COMPUTE)
        ...     def double(self, batch):
        ...         return batch * 2
        >>> sorted(registered_methods(Doubler))
        ['double']
    """

    _RESERVED = ("worker_layout", "set_dp_layout")
    """What worker groups call on every worker to learn its layout. A subclass may override them (returning a
    :class:`WorkerLayout`), but a group-callable method of its own under one of these names (``@register``: a
    method that happens to share the name) would replace the layout every data-parallel call reads, so that is
    refused by name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        taken = [name for name in Worker._RESERVED if get_registration(vars(cls).get(name)) is not None]
        if taken:
            raise TypeError(
                f"{cls.__name__} registers {', '.join(taken)} (@register), a name worker groups call on every worker "
                "to learn its data-parallel layout (Worker's own; call set_dp_layout from __init__ to change it); "
                "rename the method"
            )

    def __init__(self) -> None:
        ctx = current_worker_context()
        self._rank = ctx.rank
        self._world_size = ctx.world_size
        self._local_rank = ctx.local_rank
        self._dp_rank = ctx.rank
        self._dp_size = ctx.world_size
        self._is_collect_rank = True
        shared = _SHARED_STORE.get()
        self._resident_store = shared if shared is not None else ResidentStore()

    @property
    def resident_store(self) -> ResidentStore:
        """This process's resident batches (shared by the roles of a colocated worker)."""
        return self._resident_store

    @property
    def rank(self) -> int:
        """Global rank of this worker in its group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank of this worker on its host (device index)."""
        return self._local_rank

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which shard of a ``DP_COMPUTE`` batch this worker receives."""
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards."""
        return self._dp_size

    @property
    def is_collect_rank(self) -> bool:
        """Whether this rank's output represents its dp group (e.g. TP rank 0 on the last PP stage)."""
        return self._is_collect_rank

    def set_dp_layout(self, dp_rank: int, dp_size: int, is_collect_rank: bool) -> None:
        """Declare this rank's data-parallel layout (call from ``__init__`` of TP/PP workers)."""
        if dp_size < 1 or dp_size > self._world_size:
            raise ValueError(f"dp_size must be in [1, {self._world_size}], got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self._dp_rank, self._dp_size, self._is_collect_rank = dp_rank, dp_size, bool(is_collect_rank)

    def worker_layout(self) -> WorkerLayout:
        """This rank's layout as reported to the controller (groups call it once and cache the result)."""
        return WorkerLayout(
            rank=self._rank,
            world_size=self._world_size,
            dp_rank=self._dp_rank,
            dp_size=self._dp_size,
            is_collect_rank=self._is_collect_rank,
        )

    def close(self) -> None:
        """Release the worker's resources (process groups, files). Called once by ``WorkerGroup.shutdown``."""

    # ----- resident batches (called by WorkerGroup's resident helpers, not registered) --------------------
    def resident_select(self, batch: Any, keys: tuple[str, ...]) -> Any:
        """This rank's rows of ``keys`` of a resident batch (``batch`` arrives resolved from the store)."""
        return batch.select(*keys)

    def resident_update(self, batch: Any, new: Any) -> Any:
        """The rows ``new`` brings to a resident batch (the caller keeps them into it with ``Keep(update=True)``)."""
        return new

    def resident_copy(self, batch: Any, copies: dict) -> Any:
        """``{new: batch[key]}`` for each ``new: key`` of ``copies``: a key of the batch under another name (the
        rollout's log-probs as the old ones), cloned so that the two stay independent in the store."""
        from tensordict import TensorDict

        return TensorDict(
            {new: batch.get(key).clone() for new, key in copies.items()}, batch_size=batch.batch_size
        )

    def resident_broadcast_rows(
        self, batch: Any, per_row: Any, mask_key: str, dtype: Any, copies: dict | None = None
    ) -> Any:
        """``[rows, T]`` columns from ``[rows]`` ones: each of ``per_row``'s columns over the row's valid tokens
        (``batch[mask_key]``), zero elsewhere, as the outcome advantage estimators broadcast them; ``copies``
        ``{new: key}`` adds clones of broadcast columns under other names (GRPO's returns)."""
        from ppo_core.advantages._common import broadcast_rows

        mask = batch.get(mask_key).bool()
        out = per_row.apply(lambda v: broadcast_rows(v, mask, dtype), batch_size=per_row.batch_size)
        for new, key in (copies or {}).items():
            out.set(new, out.get(key).clone())
        return out

    def resident_response_mask(self, batch: Any) -> Any:
        """``response_mask`` ``[rows, R]`` from ``attention_mask[:, P:]`` for a generation without one (the
        controller's :func:`~ppo_core.trainer.steps.merge_generation` does the same on a by-value batch)."""
        from ppo_core.trainer.steps import merge_generation

        rows = batch.select(*(k for k in ("responses", "attention_mask") if k in batch))
        return merge_generation(rows, rows).select("response_mask")

    def resident_set_prompts(self, prompts: list) -> None:
        """Keep the training prompts' ``input_ids`` (one 1-D tensor per dataset item) for :meth:`resident_prompts`:
        sent once, then each step's prompts arrive as dataset indices."""
        self.__dict__["_resident_prompts"] = list(prompts)

    def resident_prompts(self, index: Any, width: int, pad_token_id: int) -> Any:
        """``input_ids`` / ``attention_mask`` ``[rows, width]`` of this rank's prompt rows, left-padded to the step's
        ``width`` as :func:`~ppo_core.trainer.data.collate_prompts` pads the whole batch (``index``: ``[rows]``
        dataset indices, each prompt already repeated ``rollout.n`` times)."""
        from tensordict import TensorDict

        from ppo_core.workers.resident_ops import prompt_rows

        table = self.__dict__.get("_resident_prompts")
        if table is None:
            raise RuntimeError(f"rank {self._rank} has no prompt table: resident_set_prompts was not called")
        ids, mask = prompt_rows(table, index.get("index"), width, pad_token_id)
        return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=index.batch_size)

    def resident_reward(self, batch: Any, fields: Any, reward: Any) -> Any:
        """Run a :class:`~ppo_core.trainer.worker_reward.WorkerReward` on this rank's rows: their token-level
        scores, row score sums and numeric extra infos (:func:`~ppo_core.workers.resident_ops.score_rows`)."""
        from ppo_core.workers.resident_ops import score_rows

        return score_rows(batch, fields, reward)

    def resident_rewards(self, batch: Any, scores: Any, beta: float | None, estimator: str) -> Any:
        """Token-level scores and rewards (the in-reward KL penalty with ``beta``) of this rank's rows, and their
        ``[rows]`` columns (:func:`~ppo_core.workers.resident_ops.shape_rewards`)."""
        from ppo_core.workers.resident_ops import shape_rewards

        return shape_rewards(batch, scores, beta, estimator)

    def resident_gae(self, batch: Any, gamma: float, lam: float, whiten: bool) -> Any:
        """GAE advantages and returns of this rank's rows (:func:`~ppo_core.workers.resident_ops.gae_rows`)."""
        from ppo_core.workers.resident_ops import gae_rows

        return gae_rows(batch, gamma, lam, whiten)

    def resident_reinforce_pp(self, batch: Any, gamma: float, whiten: bool) -> Any:
        """REINFORCE++ advantages and returns of this rank's rows
        (:func:`~ppo_core.workers.resident_ops.reinforce_pp_rows`)."""
        from ppo_core.workers.resident_ops import reinforce_pp_rows

        return reinforce_pp_rows(batch, gamma, whiten)

    def resident_moments(self, batch: Any, key: str, mask_key: str) -> Any:
        """:class:`~ppo_core.masked_moments.Moments` of ``batch[key]`` over ``batch[mask_key]`` on this rank's rows."""
        from ppo_core.masked_moments import masked_moments

        return masked_moments(batch.get(key), batch.get(mask_key).bool())

    def resident_row_moments(self, batch: Any, key: str, mask_key: str) -> Any:
        """:class:`~ppo_core.masked_moments.RowMoments` (``[b]`` per-row float64 partials) of ``batch[key]`` over
        ``batch[mask_key]`` on this rank's rows: what the estimators' whitening reduces, layout-independently."""
        from ppo_core.masked_moments import row_moments

        return row_moments(batch.get(key), batch.get(mask_key).bool())

    def resident_whiten(
        self, batch: Any, key: str, mask_key: str, moments: Any, copies: tuple[str, ...] = ()
    ) -> Any:
        """``batch[key]`` whitened with the whole batch's ``moments`` (0 where ``batch[mask_key]`` is 0), and a
        clone of it under each name of ``copies`` (an outcome estimator's returns)."""
        from tensordict import TensorDict

        from ppo_core.masked_moments import whiten_with

        out = whiten_with(batch.get(key), batch.get(mask_key).bool(), moments)
        return TensorDict({key: out, **{name: out.clone() for name in copies}}, batch_size=batch.batch_size)

    def resident_rollout_correction(self, batch: Any, config: Any) -> Any:
        """The rollout correction's weights (before the batch normalisation) and rejection mask of this rank's rows
        (:func:`~ppo_core.workers.resident_ops.correction_rows_and_parts`); the same pass's metric parts are kept for
        :meth:`resident_rollout_correction_parts`."""
        return self._correction_memo().rows(batch, config)

    def resident_rollout_correction_parts(self, batch: Any, config: Any) -> Any:
        """This rank's rollout-correction parts (:func:`~ppo_core.workers.resident_ops.correction_parts`): those
        :meth:`resident_rollout_correction` computed with its rows, where it just ran on the same tensors."""
        return self._correction_memo().parts(batch, config)

    def _correction_memo(self) -> Any:
        from ppo_core.workers.resident_ops import CorrectionPartsMemo

        memo = self.__dict__.get("_resident_correction_memo")
        if memo is None:
            memo = self.__dict__["_resident_correction_memo"] = CorrectionPartsMemo()
        return memo

    def resident_normalize_weights(self, batch: Any, mean: float) -> Any:
        """This rank's ``rollout_is_weights`` divided by the batch's mean
        (:func:`~ppo_core.rollout_correction.partial.normalize_weights`)."""
        from tensordict import TensorDict

        from ppo_core.rollout_correction.partial import normalize_weights

        weights = normalize_weights(batch.get("rollout_is_weights"), mean)
        return TensorDict({"rollout_is_weights": weights}, batch_size=batch.batch_size)

    def resident_policy_view(self, batch: Any) -> Any:
        """This rank's rows with the rollout correction's policy mask as ``response_mask``
        (:func:`~ppo_core.workers.resident_ops.policy_view`)."""
        from ppo_core.workers.resident_ops import policy_view

        return policy_view(batch)

    def resident_probs_diff_parts(self, batch: Any) -> Any:
        """This rank's part of the rollout-vs-old probability metrics
        (:func:`~ppo_core.metrics.rollout.rollout_probs_diff_parts`)."""
        from ppo_core.metrics.rollout import rollout_probs_diff_parts

        return rollout_probs_diff_parts(
            batch.get("rollout_log_probs"), batch.get("old_log_probs"), batch.get("response_mask")
        )

    def resident_data_metric_parts(self, batch: Any, use_critic: bool) -> Any:
        """This rank's :class:`~ppo_core.metrics.partial.DataMetricParts` of the step's batch."""
        from ppo_core.metrics.partial import data_metric_parts

        return data_metric_parts(batch, use_critic=use_critic)

    def resident_drop(self, ids: tuple[str, ...]) -> tuple[str, ...]:
        """Forget resident batches ``ids``; those that were held."""
        return tuple(i for i in ids if self._resident_store.drop(i))

    def resident_end_step(self, step: int) -> tuple[str, ...]:
        """Drop the resident batches made at ``step`` or earlier; their ids."""
        return self._resident_store.end_step(step)

    def resident_ids(self) -> tuple[str, ...]:
        """Ids of the resident batches this process holds."""
        return self._resident_store.ids()

    def resident_reshard_p2p(
        self, plan: Any, source_id: str, keys: tuple, new_id: str, step: int, timeout_s: float
    ) -> Any:
        """This rank's part of an in-group reshard over ``torch.distributed`` point-to-point."""
        from ppo_core.workers.reshard_exec import run_p2p

        out = run_p2p(self._resident_store, plan, source_id, keys, self._rank, timeout_s)
        return self._keep_resharded(new_id, out, step)

    def resident_listen(self, plan: Any, keys: tuple, new_id: str, timeout_s: float, host: str | None) -> Any:
        """Start receiving this consumer rank's rows of a TCP reshard; the ``(host, port)`` producers connect to."""
        from ppo_core.workers.reshard_exec import TcpReceiver

        receivers = self.__dict__.setdefault("_resident_receivers", {})
        receivers[new_id] = TcpReceiver(plan, self._rank, keys, timeout_s, host)
        return receivers[new_id].address

    def resident_send(self, plan: Any, source_id: str, keys: tuple, addresses: list, timeout_s: float) -> int:
        """Send this producer rank's rows of a TCP reshard; the bytes sent."""
        from ppo_core.workers.reshard_exec import tcp_send

        return tcp_send(self._resident_store, plan, source_id, keys, self._rank, addresses, timeout_s)

    def resident_finish(self, source_id: str, new_id: str, step: int) -> Any:
        """Wait for this consumer rank's rows of a TCP reshard and keep them under ``new_id``."""
        receiver = self.__dict__.get("_resident_receivers", {}).pop(new_id, None)
        if receiver is None:
            raise RuntimeError(f"no reshard into {new_id} was started on rank {self._rank}")
        return self._keep_resharded(new_id, receiver.finish(self._resident_store, source_id), step)

    def _keep_resharded(self, new_id: str, out: Any, step: int) -> Any:
        from ppo_core.workers.resident import ShardInfo, describe_keys

        self._resident_store.put(new_id, out, step)
        return ShardInfo(rows=int(out.batch_size[0]), keys=describe_keys(out), columns=None)


@dataclasses.dataclass(frozen=True)
class Registration:
    """How a registered method is dispatched (``mode``), which ranks execute it, and whether calls block."""

    mode: DispatchMode
    execute: Execute = Execute.ALL
    blocking: bool = True
    reads: tuple[str, ...] | None = None
    """Keys the method reads from a resident batch argument (None: every key); only these are materialised."""
    may_read: tuple[str, ...] = ()
    """Keys it reads when the batch holds them (e.g. ``ref_log_probs`` with the KL loss on)."""


def register(
    dispatch: DispatchMode | str | tuple[Callable[..., Any], Callable[..., Any]] = Dispatch.ONE_TO_ALL,
    execute: Execute | str = Execute.ALL,
    blocking: bool = True,
    reads: Sequence[str] | None = None,
    may_read: Sequence[str] = (),
) -> Callable[[F], F]:
    """Mark a worker method as callable through a group, with its dispatch mode.

    Args:
        dispatch: a :class:`Dispatch` mode, its name (``"dp_compute"``), or a custom
            ``(dispatch_fn, collect_fn)`` pair (signatures in :mod:`ppo_core.workers.dispatch`).
        execute: ``Execute.ALL`` (every rank the dispatch addresses) or ``Execute.RANK_ZERO`` (rank 0 only).
        blocking: if False, the bound group method returns a handle (``.result()`` / ``await``) instead of
            the collected value.
        reads: the keys the method reads from a :class:`~ppo_core.workers.resident.BatchRef` argument; a rank
            materialises only these from its store (None: every key the batch holds).
        may_read: keys read when present (optional inputs).

    Example:
        >>> class Actor(Worker):
        ...     @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
        ...     def update_actor(self, batch):
        ...         return {"actor/loss": 0.0}
        >>> get_registration(Actor.update_actor).mode.name
        'dp_compute_metric'
    """
    for name, keys in (("reads", reads), ("may_read", may_read)):
        if keys is not None and (isinstance(keys, str) or not all(isinstance(k, str) for k in keys)):
            raise TypeError(f"@register({name}=...) must be a sequence of key names, got {keys!r}")
    reg = Registration(
        mode=resolve_dispatch(dispatch),
        execute=Execute(execute),
        blocking=bool(blocking),
        reads=None if reads is None else tuple(reads),
        may_read=tuple(may_read),
    )

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@register must decorate a function, got {type(fn).__name__}")
        setattr(fn, _REGISTRATION_ATTR, reg)
        return fn

    return decorate


def get_registration(fn: Any) -> Registration | None:
    """The :class:`Registration` of a method marked with :func:`register`, else ``None``."""
    return getattr(fn, _REGISTRATION_ATTR, None)


def registered_methods(cls: type) -> dict[str, Registration]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included), by name, in definition order."""
    out: dict[str, Registration] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            reg = get_registration(value)
            if reg is not None:
                out[name] = reg
            elif name in out:
                del out[name]  # an override without @register is no longer group-callable
    return out


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """An importable worker class and its constructor arguments, built once per rank by a backend."""

    cls: type
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.cls, type):
            raise TypeError(f"cls must be a class, got {type(self.cls).__name__}")

    def build(self) -> Any:
        """Construct the worker (call inside :func:`worker_context`)."""
        return self.cls(*self.args, **dict(self.kwargs))


class ColocatedWorker(Worker):
    """Several roles (e.g. actor, reference, critic) sharing one process per rank, each a plain instance.

    Methods are reached as ``"role.method"`` through :func:`resolve_method`; a group exposes one view per role
    (``group.role("actor")``) whose bound methods keep their original names. No class is generated.

    Example:
        >>> cw = ColocatedWorker({"a": WorkerSpec(Worker), "b": WorkerSpec(Worker)})
        >>> sorted(cw.roles)
        ['a', 'b']
    """

    def __init__(self, roles: Mapping[str, WorkerSpec]) -> None:
        super().__init__()
        if not roles:
            raise ValueError("roles must name at least one role")
        for name in roles:
            if not name.isidentifier():
                raise ValueError(f"role names must be identifiers, got {name!r}")
        token = _SHARED_STORE.set(self.resident_store)  # every role keeps its batches in this process's store
        try:
            self.roles: dict[str, Any] = {name: spec.build() for name, spec in roles.items()}
        finally:
            _SHARED_STORE.reset(token)

    def close(self) -> None:
        for role in self.roles.values():
            close = getattr(role, "close", None)
            if callable(close):
                close()


def resolve_method(worker: Any, method: str) -> Callable[..., Any]:
    """The bound method named ``method`` on ``worker``; ``"role.name"`` goes through a ColocatedWorker's roles.

    On a :class:`Worker` the callable also resolves :class:`~ppo_core.workers.resident.BatchRef` arguments from
    the worker's store (the method's declared ``reads`` only) and honours a resident call's
    :class:`~ppo_core.workers.resident.Keep` (the output is stored and described instead of returned).
    """
    target = worker
    *path, name = method.split(".")
    for role in path:
        roles = getattr(target, "roles", None)
        if not isinstance(roles, dict) or role not in roles:
            valid = sorted(roles) if isinstance(roles, dict) else []
            raise ValueError(f"unknown role {role!r} in method {method!r}; valid roles: {valid}")
        target = roles[role]
    fn = getattr(target, name, None)
    if fn is None or not callable(fn) or name.startswith("__"):
        raise ValueError(f"worker {type(target).__name__} has no method {name!r} (called as {method!r})")
    if isinstance(target, Worker):
        return functools.partial(_call_resident_aware, target, fn)
    return fn


def _call_resident_aware(worker: Worker, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    keep = kwargs.pop(KEEP_KWARG, None)
    if any(isinstance(v, BatchRef) for v in (*args, *kwargs.values())):
        reg = get_registration(fn)
        reads = None if reg is None or reg.reads is None else (reg.reads, reg.may_read)
        args, kwargs = resolve_refs(worker.resident_store, worker.rank, reads, args, kwargs)
    out = fn(*args, **kwargs)
    if keep is None:
        return out
    if not isinstance(keep, Keep):
        raise TypeError(f"{KEEP_KWARG} must be a Keep, got {type(keep).__name__}")
    return keep_output(worker.resident_store, keep, worker.dp_rank, out)
