"""``CallDeadline``: bound each scorer call to a number of seconds, also a pure-Python loop that never returns.

A thread cannot stop another thread's Python code, so the deadline interrupts the calling thread itself:

- In a process's main thread (the controller scoring inline, or a worker of ``RuleBasedReward(num_workers=N)``,
  whose tasks run in each worker process's main thread): a watchdog thread sends a signal of its own
  (:data:`DEADLINE_SIGNAL`, a real-time signal where the platform has one) to the main thread when a call
  overruns; its handler raises inside the call, which interrupts a Python loop and a blocking ``time.sleep``
  alike. ``math-verify``'s own ``signal.alarm`` timeouts (SIGALRM) are left alone. The handler is installed for
  the ``with`` block only and the previous one restored after.
- Elsewhere (another thread, or a platform without ``signal.pthread_kill``): the call runs in a daemon thread
  that is waited for ``seconds``; past that :class:`DeadlineExceeded` is raised although the call keeps running in
  the background (it cannot be stopped): score with ``num_workers > 0`` there.

Code stuck inside a C extension that never returns to the interpreter is not interrupted in either case.

Example:
    >>> with CallDeadline(5.0) as deadline:
    ...     deadline.call(sum, [1, 2, 3])
    6
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["DEADLINE_SIGNAL", "CallDeadline", "DeadlineExceeded"]

R = TypeVar("R")

# a real-time signal that nothing else in a training process is expected to use (SIGALRM is math-verify's)
DEADLINE_SIGNAL: int | None = (
    signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else getattr(signal, "SIGUSR2", None)
)
"""The signal the watchdog sends to the main thread (None: the platform has none; the thread fallback is used)."""

_REFIRE_S = 1.0  # a call that swallowed the interruption is interrupted again this often


class DeadlineExceeded(Exception):
    """A call did not return within its deadline. ``seconds``: the deadline; ``still_running``: the call goes on
    in a background thread (the thread fallback)."""

    def __init__(self, seconds: float, still_running: bool = False) -> None:
        more = "; it keeps running in a background thread" if still_running else ""
        super().__init__(f"did not return within {seconds:g} s{more}")
        self.seconds = seconds
        self.still_running = still_running

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.seconds, self.still_running))


class _Expired(BaseException):
    """Raised inside the overrunning call (a BaseException, so that a scorer's ``except Exception`` lets it pass)."""


class CallDeadline:
    """Context manager bounding every :meth:`call` made inside it to ``seconds`` (None: no bound).

    Args:
        seconds: the deadline of each call, > 0; None calls without one.
    """

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a deadline must be > 0 seconds or None, got {seconds!r}")
        self.seconds = seconds
        self._mode = "none"
        self._cond = threading.Condition()
        self._active = False
        self._fire_at: float | None = None
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._previous: Any = None

    # ----- setup -------------------------------------------------------------------------------------------
    def __enter__(self) -> CallDeadline:
        if self.seconds is None:
            self._mode = "none"
        elif self._can_signal():
            self._mode = "signal"
            self._previous = signal.signal(DEADLINE_SIGNAL, self._on_signal)  # type: ignore[arg-type]
            self._closed = False
            self._watchdog = threading.Thread(target=self._watch, name="ppo-scorer-deadline", daemon=True)
            self._watchdog.start()
        else:
            self._mode = "thread"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode != "signal":
            return
        with self._cond:
            self._closed = True
            self._active = False
            self._cond.notify_all()
        assert self._watchdog is not None
        self._watchdog.join()
        signal.signal(DEADLINE_SIGNAL, self._previous)  # type: ignore[arg-type]

    @staticmethod
    def _can_signal() -> bool:
        if DEADLINE_SIGNAL is None or not hasattr(signal, "pthread_kill"):
            return False
        if threading.current_thread() is not threading.main_thread():
            return False
        return signal.getsignal(DEADLINE_SIGNAL) in (signal.SIG_DFL, None)  # not taken by someone else

    # ----- calls -------------------------------------------------------------------------------------------
    def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)``; :class:`DeadlineExceeded` when it runs past the deadline."""
        if self._mode == "none":
            return fn(*args, **kwargs)
        if self._mode == "thread":
            return self._call_in_thread(fn, args, kwargs)
        assert self.seconds is not None
        with self._cond:
            self._active = True
            self._fire_at = time.monotonic() + self.seconds
            self._cond.notify_all()
        try:
            try:
                return fn(*args, **kwargs)
            finally:
                with self._cond:  # no signal is sent after this; one already sent finds _active False
                    self._active = False
                    self._fire_at = None
        except _Expired:
            raise DeadlineExceeded(self.seconds) from None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._active:
            raise _Expired

    def _watch(self) -> None:
        main = threading.main_thread().ident
        assert main is not None and DEADLINE_SIGNAL is not None
        with self._cond:
            while not self._closed:
                if not self._active or self._fire_at is None:
                    self._cond.wait()
                    continue
                remaining = self._fire_at - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                signal.pthread_kill(main, DEADLINE_SIGNAL)
                self._fire_at = time.monotonic() + _REFIRE_S

    def _call_in_thread(self, fn: Callable[..., R], args: tuple, kwargs: dict) -> R:
        assert self.seconds is not None
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # re-raised in the caller
                out["error"] = exc

        thread = threading.Thread(target=run, name="ppo-scorer-call", daemon=True)
        thread.start()
        thread.join(self.seconds)
        if thread.is_alive():
            raise DeadlineExceeded(self.seconds, still_running=True)
        if "error" in out:
            raise out["error"]
        return out["value"]
