"""ppo-core on PyTorch Monarch (work in progress: see the Monarch issue)."""

from __future__ import annotations

__all__: list[str] = []
