"""``Tracker``: metric sinks for the trainer (console via logging, ``metrics.jsonl``, TensorBoard, Weights & Biases).

``metrics.jsonl`` holds one JSON object per logged step: ``{"step": k, "<metric>": value, ...}``. Non-finite
values are written as ``null`` so every line is strict JSON. Several ``log`` calls for the same step (validation
before train metrics) are merged into one line when the step ends (:meth:`Tracker.flush`). A resumed run first
drops the lines of steps after the checkpoint, so the file describes exactly one run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Tracker", "read_metrics_jsonl", "usable_loggers"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each optional sink needs."""


def _to_float(key: str, value: Any) -> float:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} must be a real number, got {type(value).__name__}")
    return float(value)


def _json_value(value: float) -> float | None:
    return value if math.isfinite(value) else None


def usable_loggers(loggers: Sequence[str]) -> tuple[str, ...]:
    """``loggers`` without the sinks whose package is not installed, with one warning for each dropped sink.

    Call it once where a run starts (the CLI does, before loading the model) and hand the result on, so that the
    warning comes at the start and only once.

    Example:
        >>> usable_loggers(["console", "jsonl"])
        ('console', 'jsonl')
    """
    kept = []
    for name in loggers:
        package = _PACKAGES.get(name)
        if package is not None and not _installed(package):
            logger.warning(
                "%s is not installed; the %s logger is disabled (pip install %s)", package, name, package
            )
            continue
        kept.append(name)
    return tuple(kept)


def _installed(package: str) -> bool:
    if package in sys.modules:  # already imported (or blocked: None)
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent package
        return False


def read_metrics_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (or of ``path/metrics.jsonl`` for a directory), in file order.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> t = Tracker(loggers=("jsonl",), log_dir=d); t.log({"a": 1.0}, step=1); t.close()
        >>> read_metrics_jsonl(d)
        [{'step': 1, 'a': 1.0}]
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Tracker:
    """Send per-step metric dicts to the configured sinks.

    Args:
        loggers: any of ``"console"`` (``logging.INFO`` on this module's logger), ``"jsonl"``,
            ``"tensorboard"`` (needs ``torch.utils.tensorboard`` and its ``tensorboard`` package) and ``"wandb"``
            (``wandb.init(project=$WANDB_PROJECT or "ppo-core", name=<log_dir's name>, dir=log_dir)``; offline
            when ``WANDB_MODE=offline``). A sink whose package is missing is skipped with a warning.
        log_dir: directory of ``metrics.jsonl`` and the TensorBoard events (created if needed).
        console_every: log to the console every this many steps.
        resume_step: when resuming from step ``k``, drop the records of steps ``> k`` from ``metrics.jsonl``.

    Example:
        >>> t = Tracker(loggers=("console",))
        >>> t.log({"critic/score/mean": 0.5}, step=3)
        >>> t.close()
    """

    def __init__(
        self,
        loggers: Sequence[str] = ("console", "jsonl"),
        log_dir: str | os.PathLike[str] | None = None,
        *,
        console_every: int = 1,
        resume_step: int | None = None,
    ) -> None:
        valid = ("console", "jsonl", "tensorboard", "wandb")
        for name in loggers:
            if name not in valid:
                raise ValueError(f"unknown logger {name!r}; valid values: {', '.join(valid)}")
        if any(name in loggers for name in ("jsonl", "tensorboard", "wandb")) and log_dir is None:
            raise ValueError("log_dir is required for the jsonl, tensorboard and wandb loggers")
        self.loggers = usable_loggers(loggers)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.console_every = max(1, int(console_every))
        self._pending: dict[int, dict[str, float]] = {}
        self._jsonl = None
        self._tb = None
        self._wandb: Any = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
        if "jsonl" in self.loggers:
            path = os.path.join(self.log_dir, METRICS_FILE)  # type: ignore[arg-type]
            if resume_step is not None:
                self._truncate(path, resume_step)
            elif os.path.exists(path):
                os.remove(path)  # a fresh run starts a fresh file
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if "tensorboard" in self.loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=self.log_dir)
            except ImportError:
                logger.warning("tensorboard is not installed; the tensorboard logger is disabled")
        if "wandb" in self.loggers:
            self._wandb = _start_wandb(self.log_dir, resume_step)  # type: ignore[arg-type]

    @staticmethod
    def _truncate(path: str, step: int) -> None:
        if not os.path.exists(path):
            return
        kept = [r for r in read_metrics_jsonl(path) if int(r.get("step", 0)) <= step]
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for record in kept:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` for ``step``; an empty dict logs nothing. Written at :meth:`flush`/the next step."""
        if not metrics:
            return
        for old in [s for s in self._pending if s != step]:
            self.flush(old)
        values = {str(k): _to_float(str(k), v) for k, v in metrics.items()}
        self._pending.setdefault(int(step), {}).update(values)

    def flush(self, step: int | None = None) -> None:
        """Write the pending metrics of ``step`` (all pending steps if None) to every sink."""
        steps = sorted(self._pending) if step is None else [step]
        for s in steps:
            values = self._pending.pop(s, None)
            if not values:
                continue
            if self._jsonl is not None:
                record = {"step": s, **{k: _json_value(v) for k, v in values.items()}}
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
            if self._tb is not None:
                for k, v in values.items():
                    self._tb.add_scalar(k, v, s)
            if self._wandb is not None:
                self._wandb.log(values, step=s)
            if "console" in self.loggers and (s % self.console_every == 0):
                text = " - ".join(f"{k}: {v:.4g}" for k, v in sorted(values.items()))
                logger.info("step %d: %s", s, text)

    def close(self) -> None:
        """Flush and close the sinks (idempotent)."""
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(log_dir: str, resume_step: int | None) -> Any:
    """A W&B run logging into ``log_dir`` (None, with a warning, when ``wandb`` is not installed)."""
    try:
        import wandb
    except ImportError:
        logger.warning("wandb is not installed; the wandb logger is disabled")
        return None
    name = os.path.basename(os.path.normpath(os.path.abspath(log_dir)))
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "ppo-core"),
        name=name,
        dir=log_dir,
        resume="allow" if resume_step is not None else None,
    )
