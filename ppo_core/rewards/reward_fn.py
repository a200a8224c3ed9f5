"""``RuleBasedReward``: the trainer's reward function for rule-scored data sources (GSM8K, MATH, your own).

It decodes each response (only the tokens where ``response_mask`` is 1, special tokens skipped), picks the scorer
of the row's ``data_source`` (:mod:`ppo_core.rewards.registry`) and calls it with the row's ``ground_truth`` and
``extra_info``. It returns ``(scores [B], extra_infos)``: ``extra_infos`` holds, per response, every value the
scorers return besides ``score`` (None where a row's scorer does not return it): for the built-in scorers ``acc``
(1 if right) and ``pred`` (the extracted answer, the vote of validation's ``maj@N``). Validation reports them per data source; for training steps,
:func:`reward_metrics_by_source` turns them into per-source means.

With ``num_workers=0`` scoring runs in the caller's thread and the result is returned directly. With
``num_workers=N`` the rows are scored by a pool of ``N`` processes (``spawn``ed on first use, kept until
:meth:`RuleBasedReward.close`) and the call returns a ``concurrent.futures.Future``: the trainer starts it right
after generation and awaits it before the advantages, so slow scorers overlap with the log-prob and value passes.
Scorers must then be picklable (module-level functions or ``functools.partial`` of them), and a script that
creates the reward must guard its entry point with ``if __name__ == "__main__":`` (``spawn`` re-imports it).

Errors: every scorer call has a deadline (``timeout_s``, 60 s by default, per call: one hung response is the
failure to catch, whatever the batch size or the number of workers). A scorer that raises, overruns, or returns
something other than a finite number (a NaN or inf score included) raises :class:`ScorerError` naming the
scorer, the row's ``data_source`` and its row; the trainer re-raises it naming the step.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import multiprocessing
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

import ppo_core.rewards._builtin  # noqa: F401  (registers the built-in scorers)
from ppo_core.rewards.deadline import CallDeadline, DeadlineExceeded
from ppo_core.rewards.registry import Scorer, ScorerRegistry, global_registry

__all__ = ["RuleBasedReward", "ScorerError", "ScorerTimeoutError", "score_rows", "scorer_name"]

Row = tuple[str, Scorer, str, Any, "Mapping[str, Any] | None"]
"""``(data_source, scorer, solution_str, ground_truth, extra_info)``."""


class ScorerError(RuntimeError):
    """A scorer raised, returned something that is not a finite score, or did not return within ``timeout_s``.

    The message names the scorer, the row's ``data_source`` and its row in the batch (the trainer adds the step).
    Attributes: ``data_source``, ``scorer`` (its name) and ``row``.
    """

    def __init__(self, message: str, data_source: str, scorer: str, row: int) -> None:
        super().__init__(f"scorer {scorer} of data_source {data_source!r} (row {row}) {message}")
        self.message, self.data_source, self.scorer, self.row = message, data_source, scorer, row

    def __reduce__(self) -> tuple[Any, ...]:  # crosses the process pool
        return (type(self), (self.message, self.data_source, self.scorer, self.row))


class ScorerTimeoutError(ScorerError):
    """A scorer did not return within the reward's ``timeout_s``."""


def scorer_name(scorer: Any) -> str:
    """A readable name for a scorer or a reward function: ``module.qualname``, seeing through
    ``functools.partial``."""
    fn = getattr(scorer, "func", scorer)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins", "__main__") else name


def _finite_score(value: Any) -> float:
    """``value`` as a finite float; ``ValueError`` saying what it is otherwise."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ValueError(f"returned a score that is not a number: {value!r}")
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:  # e.g. a tensor of several elements
        raise ValueError(f"returned a score that is not one number: {value!r} ({exc})") from None
    if not math.isfinite(score):
        raise ValueError(f"returned a {score} score; a score must be finite")
    return score


def _as_result(value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"returned a mapping without 'score' (keys: {sorted(map(str, value))})")
        out = dict(value)
    else:
        out = {"score": value}
    out["score"] = _finite_score(out["score"])
    return out


def score_rows(
    rows: Sequence[Row], timeout_s: float | None = None, first_row: int = 0
) -> list[dict[str, Any]]:
    """Score ``(data_source, scorer, solution_str, ground_truth, extra_info)`` rows; a dict with ``score`` each.

    Each call gets ``timeout_s`` seconds (None: no bound; see :class:`~ppo_core.rewards.deadline.CallDeadline`).
    A scorer that raises, overruns or returns no finite score raises :class:`ScorerError` naming it, the row's
    data source and its row (``first_row`` + its index here), chained to the scorer's exception. Module-level so
    that a process pool can run it on a chunk of rows.
    """
    out = []
    with CallDeadline(timeout_s) as deadline:
        for i, (source, scorer, text, truth, extra) in enumerate(rows):
            where = (source, scorer_name(scorer), first_row + i)
            try:
                value = deadline.call(scorer, text, truth, extra)
            except DeadlineExceeded as exc:
                raise ScorerTimeoutError(f"{exc} (timeout_s={timeout_s:g})", *where) from None
            except Exception as exc:
                raise ScorerError(f"raised {type(exc).__name__}: {exc}", *where) from exc
            try:
                out.append(_as_result(value))
            except ValueError as exc:
                raise ScorerError(str(exc), *where) from None
    return out


def _collect(results: list[dict[str, Any]]) -> tuple[torch.Tensor, dict[str, list]]:
    scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
    keys: list[str] = []
    for r in results:
        keys += [k for k in r if k != "score" and k not in keys]
    return scores, {key: [r.get(key) for r in results] for key in keys}


class RuleBasedReward:
    """Reward function scoring each response with the rule-based scorer of its ``data_source``.

    Args:
        tokenizer: the tokenizer that produced the responses (``batch_decode`` is used).
        num_workers: 0 scores inline; ``N > 0`` scores in a pool of ``N`` processes and returns a Future.
        scorers: ``{pattern: scorer}`` taking precedence over the global registry (same matching rules), e.g.
            ``{"openai/gsm8k": functools.partial(gsm8k_score, method="flexible")}``.
        skip_special_tokens: drop special tokens (EOS, padding) when decoding.
        timeout_s: seconds each scorer call may take (None: no bound); past it the call is interrupted and
            :class:`ScorerTimeoutError` raised (see :mod:`ppo_core.rewards.deadline`).
        mp_context: start method of the pool (``"spawn"`` is safe with threads and CUDA in the parent).

    Usage::

        reward = RuleBasedReward(tokenizer, num_workers=2)
        trainer = MyTrainer(cfg, train_dataset=train, reward_fn=reward, ...)
        trainer.fit()
        reward.close()
    """

    reads: tuple[str, ...] = ("responses", "response_mask")
    """The generation keys it reads (with the prompts' ``data_source``, ``ground_truth`` and ``extra_info``): a
    resident step fetches only these (``ppo_core.trainer.worker_reward``)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        num_workers: int = 0,
        scorers: Mapping[str, Scorer] | None = None,
        skip_special_tokens: bool = True,
        mp_context: str = "spawn",
        timeout_s: float | None = 60.0,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if mp_context not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"mp_context must be one of {multiprocessing.get_all_start_methods()}, got {mp_context!r}"
            )
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a number > 0 or None, got {timeout_s!r}")
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.tokenizer = tokenizer
        self.num_workers = num_workers
        self.skip_special_tokens = skip_special_tokens
        self.mp_context = mp_context
        self.registry = ScorerRegistry(fallback=global_registry())
        for pattern, scorer in (scorers or {}).items():
            self.registry.add(pattern, scorer)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    # ----- decoding and dispatch -----------------------------------------------------------------------------
    def decode_responses(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """The text of each response: its tokens where ``response_mask`` ``[B, R]`` is 1, decoded."""
        if responses.shape != response_mask.shape:
            raise ValueError(
                f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} must match"
            )
        keep = response_mask.bool().cpu()
        rows = [row[m].tolist() for row, m in zip(responses.cpu(), keep, strict=True)]
        return list(self.tokenizer.batch_decode(rows, skip_special_tokens=self.skip_special_tokens))

    def rows_of(self, batch: TensorDictBase) -> list[Row]:
        """``(data_source, scorer, text, ground_truth, extra_info)`` for each row of a generated batch."""
        for key in ("responses", "response_mask", "data_source", "ground_truth"):
            if key not in batch:
                raise ValueError(
                    f"RuleBasedReward needs batch key {key!r}; the batch has {sorted(batch.keys())}"
                )
        texts = self.decode_responses(batch["responses"], batch["response_mask"])
        sources = [str(s) for s in _non_tensor(batch, "data_source")]
        truths = _non_tensor(batch, "ground_truth")
        extras = _non_tensor(batch, "extra_info") if "extra_info" in batch else [None] * len(texts)
        return [
            (source, self.registry.get(source), text, truth, extra)
            for source, text, truth, extra in zip(sources, texts, truths, extras, strict=True)
        ]

    # ----- scoring -------------------------------------------------------------------------------------------
    def __call__(
        self, batch: TensorDictBase
    ) -> tuple[torch.Tensor, dict[str, list]] | concurrent.futures.Future:
        """Scores ``[B]`` (float32) and extra infos; a Future of them when ``num_workers > 0``."""
        rows = self.rows_of(batch)
        if self.num_workers == 0 or not rows:
            return _collect(score_rows(rows, self.timeout_s))
        return self._submit(rows)

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.num_workers, mp_context=multiprocessing.get_context(self.mp_context)
                )
            return self._pool

    def _submit(self, rows: list[Row]) -> concurrent.futures.Future:
        pool = self._executor()
        # a few chunks per worker: balances uneven scorer times without a round trip per row
        n_chunks = min(len(rows), 4 * self.num_workers)
        bounds = [len(rows) * i // n_chunks for i in range(n_chunks + 1)]
        parts = [pool.submit(score_rows, rows[a:b], self.timeout_s, a) for a, b in itertools.pairwise(bounds)]
        return _gather(parts, _collect)

    def close(self) -> None:
        """Shut the process pool down (idempotent; a later call starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RuleBasedReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _non_tensor(batch: TensorDictBase, key: str) -> list[Any]:
    value = batch.get(key)
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    size = int(batch.batch_size[0])
    if not isinstance(values, list) or len(values) != size:  # a single non-tensor value shared by every row
        values = [values] * size
    return values


def _gather(
    parts: list[concurrent.futures.Future], combine: Callable[[list[dict[str, Any]]], Any]
) -> concurrent.futures.Future:
    """One Future resolving to ``combine(results of parts, concatenated)``, or to the first failure."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def done(_: concurrent.futures.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] or out.done():
                return
        try:
            results = [r for part in parts for r in part.result()]
            out.set_result(combine(results))
        except BaseException as exc:  # the first failing chunk's exception, raised by result() of the trainer
            out.set_exception(exc)

    for part in parts:
        part.add_done_callback(done)
    return out
