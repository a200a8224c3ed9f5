"""Bytes through the controller: a counter every worker group keeps, per call and per direction.

``sent`` counts what the controller hands to the ranks (each rank's copy counted: a broadcast to ``n`` ranks
sends ``n`` copies, as a TP/PP replica receives its own), ``received`` what comes back. A payload's size is the
bytes of its tensors (compact: a view counts its elements, as the transports compact views) plus the pickle of
everything else (:func:`payload_nbytes`). The trainer logs the sum of a step as ``perf/controller_bytes``.

Example:
    >>> import torch
    >>> counter = TrafficCounter()
    >>> counter.record("f", sent=payload_nbytes(torch.zeros(256)), received=0)
    >>> counter.take()["sent"] >= 1024
    True
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CallBytes", "TrafficCounter", "controller_bytes_metrics", "payload_nbytes", "plan_sent_nbytes"]

_MAX_KEPT_CALLS = 4096


class _SizePickler(pickle.Pickler):
    """Pickles the skeleton of an object; tensors are counted by their element bytes instead of serialized."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensor_bytes = 0
        self._seen: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in self._seen:
                self._seen.add(id(obj))
                self.tensor_bytes += obj.nbytes
            return id(obj)
        return None


def payload_nbytes(obj: Any) -> int:
    """Bytes ``obj`` costs to ship: its tensors' element bytes plus the pickle of the rest.

    An object the standard pickler refuses (a backend may ship it with cloudpickle) counts the tensors met
    before the refusal only: the counter must never fail a call.
    """
    buf = io.BytesIO()
    pickler = _SizePickler(buf)
    try:
        pickler.dump(obj)
    except Exception:
        return pickler.tensor_bytes
    return pickler.tensor_bytes + buf.tell()


@dataclasses.dataclass(frozen=True)
class CallBytes:
    """One call's traffic through the controller."""

    method: str
    sent: int
    received: int


class TrafficCounter:
    """Totals and the recent calls of one group (thread-safe; :meth:`take` reads and resets)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[CallBytes] = []
        self._sent = 0
        self._received = 0

    def record(self, method: str, *, sent: int = 0, received: int = 0) -> None:
        """Add one call's bytes (a call records its sent bytes at submission and its received bytes later)."""
        with self._lock:
            self._sent += sent
            self._received += received
            if len(self._calls) < _MAX_KEPT_CALLS:
                self._calls.append(CallBytes(method, sent, received))

    def totals(self) -> dict[str, int]:
        """``{"sent", "received", "total"}`` bytes since the last :meth:`take`."""
        with self._lock:
            return {"sent": self._sent, "received": self._received, "total": self._sent + self._received}

    def calls(self) -> tuple[CallBytes, ...]:
        """The calls recorded since the last :meth:`take` (the first few thousand)."""
        with self._lock:
            return tuple(self._calls)

    def take(self) -> dict[str, int]:
        """:meth:`totals`, then reset."""
        with self._lock:
            out = {"sent": self._sent, "received": self._received, "total": self._sent + self._received}
            self._calls.clear()
            self._sent = self._received = 0
        return out


def plan_sent_nbytes(calls: Sequence[Any]) -> int:
    """Bytes a plan's calls carry, each rank's copy counted (a payload shared by ranks is sized once)."""
    sizes: dict[tuple[int, int], int] = {}
    total = 0
    for call in calls:
        key = (id(call.args), id(call.kwargs))
        if key not in sizes:
            sizes[key] = payload_nbytes((call.args, call.kwargs))
        total += sizes[key]
    return total


def controller_bytes_metrics(*groups: Any) -> dict[str, float]:
    """``perf/controller_bytes`` (and its ``_sent`` / ``_received`` parts) of ``groups`` since the last call; resets.

    Groups that share a counter (colocated role views) count once; None and objects without a ``traffic``
    counter are skipped.
    """
    counters = {id(c): c for g in groups if isinstance(c := getattr(g, "traffic", None), TrafficCounter)}
    sent = received = 0
    for counter in counters.values():
        taken = counter.take()
        sent += taken["sent"]
        received += taken["received"]
    return {
        "perf/controller_bytes": float(sent + received),
        "perf/controller_bytes_sent": float(sent),
        "perf/controller_bytes_received": float(received),
    }
