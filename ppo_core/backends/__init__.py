"""Backends that run worker groups: ``local`` (in the controller process); ``ppo_core_monarch`` adds Monarch.

A backend is one :class:`ppo_core.workers.WorkerGroup` subclass (see ``docs/backends.md``).
"""

from __future__ import annotations

from ppo_core.backends.local import LocalWorkerGroup

__all__ = ["LocalWorkerGroup"]
