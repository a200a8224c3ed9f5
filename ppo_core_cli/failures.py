"""A run stopped by the user's own code (a scorer that raises, returns no finite score or runs past its deadline):
one message that names the scorer, the data source, the row, the step and the line of the user's file, and the
whole traceback in a file of the run instead of on the terminal.

:func:`reward_failure_message` builds the message; :func:`user_frame` finds the user's line in an exception chain,
also when the scorer ran in a process pool (the worker's traceback then travels as text).
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback

from ppo_core.rewards.reward_fn import ScorerError
from ppo_core.trainer.reward import RewardFunctionError

__all__ = ["reward_failure_message", "user_frame", "weight_mismatch", "write_traceback"]

_OURS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
    for name in ("ppo_core", "ppo_core_cli", "ppo_core_decode", "ppo_core_monarch")
)
_LIBRARY = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_path("stdlib"), sysconfig.get_path("purelib")} if p
)
_REMOTE_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _is_users(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not filename.startswith("<") and not path.startswith(_OURS) and not path.startswith(_LIBRARY)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def user_frame(exc: BaseException) -> str | None:
    """``"FILE:LINE in FUNCTION"`` of the innermost frame of ``exc``'s chain that is neither ppo-core's nor the
    standard library's nor an installed package's (the user's scorer), or None when there is none."""
    found = None
    for err in reversed(_chain(exc)):  # innermost first
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)]
        remote = getattr(err, "tb", None)  # concurrent.futures' _RemoteTraceback: the pool worker's text
        if isinstance(remote, str):
            frames = [(m["file"], int(m["line"]), m["func"]) for m in _REMOTE_FRAME.finditer(remote)] + frames
        users = [f for f in frames if _is_users(f[0])]
        if users:
            found = users[-1]
            break
    return None if found is None else f"{found[0]}:{found[1]} in {found[2]}"


def write_traceback(exc: BaseException, path: str) -> str | None:
    """Write ``exc``'s whole traceback (its chain included) to ``path``; returns ``path``, or None if it could not
    be written (the message then says nothing about a file)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path


def reward_failure_message(exc: RewardFunctionError, traceback_file: str | None = None) -> str:
    """One message for a run stopped by its reward: the scorer's own message when a scorer failed (scorer, data
    source, row), else the reward function's; the step; the user's line; where the whole traceback is."""
    scorer = next((e for e in _chain(exc) if isinstance(e, ScorerError)), None)
    what = str(scorer) if scorer is not None else str(exc)
    parts = [f"{what} (step {exc.step})" if scorer is not None else what]
    frame = user_frame(exc)
    if frame:
        parts.append(f"at {frame}")
    if traceback_file:
        parts.append(f"traceback: {traceback_file}")
    return "; ".join(parts)


_MISMATCH = ("size mismatch", "Missing key", "Unexpected key")
"""What ``load_state_dict`` says of weights that do not fit a model (another width, fewer or more layers)."""


def weight_mismatch(message: str) -> str | None:
    """The line of ``message`` (an error's text) in which ``load_state_dict`` says weights do not fit the model
    (a checkpoint loaded into a model of another shape), stripped; None when it says no such thing.

    Example:
        >>> weight_mismatch("  size mismatch for w: copying [2] into [3]."), weight_mismatch("CUDA out of memory")
        ('size mismatch for w: copying [2] into [3].', None)
    """
    return next((line.strip() for line in message.splitlines() if any(m in line for m in _MISMATCH)), None)
