"""``MonarchPPOTrainer``: ``BasePPOTrainer`` with its worker groups on Monarch; backend wiring only, no PPO logic.

The roles (``"actor"`` required; ``"critic"`` and ``"ref"`` optional) are ``WorkerSpec`` objects. By default they
are **colocated**: one proc mesh whose every process holds all roles (a ``ColocatedWorker``), the way GPU
memory is usually shared between actor and critic; the trainer's ``actor_wg``/``critic_wg``/``ref_wg`` are the
role views of that one group. With ``colocate=False`` each role gets its own proc mesh (on the same hosts).

The same code runs on one machine (``hosts=None``) and on N hosts x M GPUs (``hosts=attach_hosts([...])`` or
``job_hosts(job, "trainers")``, ``procs_per_host=M``): every rank, host and device comes from the mesh.

Example:
    >>> roles = {"actor": WorkerSpec(MyActor, (cfg.actor.worker,)), "critic": WorkerSpec(MyCritic, (cfg.critic.worker,))}  # doctest: +SKIP
    >>> trainer = MonarchPPOTrainer(cfg, roles=roles, procs_per_host=2, train_dataset=data, reward_fn=score)  # doctest: +SKIP
    >>> try:  # doctest: +SKIP
    ...     trainer.fit()
    ... finally:
    ...     trainer.shutdown()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ppo_core.trainer import BasePPOTrainer, PPOConfig
from ppo_core.workers.base import ColocatedWorker, WorkerSpec
from ppo_core_monarch.config import MonarchConfig
from ppo_core_monarch.group import MonarchWorkerGroup
from ppo_core_monarch.launch import Hosts

__all__ = ["MonarchPPOTrainer"]

_ROLES = ("actor", "critic", "ref")


class MonarchPPOTrainer(BasePPOTrainer):
    """The PPO trainer on Monarch worker groups (see the module docstring).

    Args:
        config: the :class:`PPOConfig` (or its dict).
        roles: ``{"actor": spec, "critic": spec, "ref": spec}``, or a callable ``config -> roles`` evaluated in
            :meth:`init_workers` (specs often depend on the parsed config).
        procs_per_host: processes (GPUs) per host; default: the CUDA device count, or 1 without CUDA.
        hosts: a :class:`Hosts` or a zero-argument callable returning one (called once per proc mesh; needed when
            ``colocate=False`` spawns several meshes on attached hosts); default: this machine.
        monarch: deadlines, device and transport of the groups.
        colocate: one proc mesh for every role (default) or one per role.
        **kwargs: the other :class:`BasePPOTrainer` arguments (``train_dataset``, ``reward_fn``...).
    """

    def __init__(
        self,
        config: PPOConfig | Mapping[str, Any],
        *,
        roles: Mapping[str, WorkerSpec] | Callable[[PPOConfig], Mapping[str, WorkerSpec]],
        procs_per_host: int | None = None,
        hosts: Hosts | Callable[[], Hosts] | None = None,
        monarch: MonarchConfig | None = None,
        colocate: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        if not callable(roles) and not isinstance(roles, Mapping):
            raise TypeError(
                f"roles must be a mapping of WorkerSpec or a callable, got {type(roles).__name__}"
            )
        self._roles = roles
        self._procs_per_host = procs_per_host
        self._hosts = hosts
        self._monarch = monarch or MonarchConfig()
        self._colocate = bool(colocate)
        self.groups: list[MonarchWorkerGroup] = []

    def _role_specs(self) -> dict[str, WorkerSpec]:
        roles = dict(self._roles(self.config) if callable(self._roles) else self._roles)
        unknown = sorted(set(roles) - set(_ROLES))
        if unknown or "actor" not in roles:
            raise ValueError(f"roles must include 'actor' and only name {list(_ROLES)}; got {sorted(roles)}")
        for name, spec in roles.items():
            if not isinstance(spec, WorkerSpec):
                raise TypeError(f"roles[{name!r}] must be a WorkerSpec, got {type(spec).__name__}")
        return roles

    def _group(self, spec: WorkerSpec) -> MonarchWorkerGroup:
        hosts = self._hosts() if callable(self._hosts) else self._hosts
        group = MonarchWorkerGroup(
            spec, procs_per_host=self._procs_per_host, hosts=hosts, config=self._monarch
        )
        self.groups.append(group)
        return group

    def init_workers(self) -> None:
        """Spawn the group(s) and set ``actor_wg`` / ``critic_wg`` / ``ref_wg``."""
        roles = self._role_specs()
        try:
            if self._colocate:
                group = self._group(WorkerSpec(ColocatedWorker, kwargs={"roles": roles}))
                views = {name: group.role(name) for name in roles}
            else:
                views = {name: self._group(spec) for name, spec in roles.items()}
        except BaseException:
            self.shutdown()
            raise
        self.actor_wg = views["actor"]
        self.critic_wg = views.get("critic")
        self.ref_wg = views.get("ref")

    def shutdown(self) -> None:
        """Shut down every group this trainer spawned (idempotent)."""
        super().shutdown()
        for group in self.groups:
            group.shutdown()
