"""The per-rank pieces of a resident PPO step: rewards, the in-reward KL penalty and GAE on one rank's rows.

Each function takes a rank's ``[b]`` rows of the step's batch (resolved from its resident store) and returns the
``[b]`` keys to add to it. Every output row depends on its own input row only, so the rows equal, bit for bit, those
of the by-value step that runs the same function on the whole batch; what needs the whole batch (the KL
controller's mean, the estimator's groups, the whitening statistics) goes to the controller as ``[b]`` columns or
per-rank partial moments (:mod:`ppo_core.masked_moments`). ``docs/resident-batches.md`` describes the step.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.keys import KEYS

__all__ = [
    "EXTRA_PREFIX",
    "POLICY_MASK",
    "ROW_KL",
    "ROW_LENGTH",
    "ROW_REWARD_SUM",
    "ROW_SCORES",
    "ROW_SCORE_SUM",
    "ROW_VALID",
    "CorrectionPartsMemo",
    "correction_parts",
    "correction_rows_and_parts",
    "gae_rows",
    "policy_view",
    "prompt_rows",
    "reinforce_pp_rows",
    "score_rows",
    "shape_rewards",
]

ROW_SCORES = "row_scores"
"""``[B]`` float32 sequence scores the controller scatters (placed at each row's last valid token)."""
ROW_KL = "row_kl"
"""``[B]`` each row's masked mean of the KL penalty (the controller's ``current_kl`` is their mean)."""
ROW_REWARD_SUM = "row_reward_sum"
"""``[B]`` float64 row sums of ``token_level_rewards`` (an outcome estimator's per-row rewards)."""
ROW_VALID = "row_valid"
"""``[B]`` bool: whether the row has a valid response token."""
ROW_LENGTH = "row_length"
"""``[B]`` int64: the row's valid response tokens (what a token-weighted whitening of per-row values weighs)."""
EXTRA_PREFIX = "extra/"
"""Prefix of a worker-side reward's extra infos kept as ``[B]`` float64 columns."""
POLICY_MASK = "policy_response_mask"
"""``[B, R]`` the response mask without the tokens the rollout correction rejects (``response_mask``'s dtype): what
the actor's losses read as ``response_mask`` (:func:`policy_view`); everything else reads the full mask."""
ROW_SCORE_SUM = "row_score_sum"
"""``[B]`` float64 row sums of a worker-side reward's token-level scores (what the reward metrics read)."""


def shape_rewards(
    batch: TensorDictBase, scores: TensorDictBase | None, beta: float | None, estimator: str = "kl"
) -> TensorDict:
    """``token_level_scores``, ``token_level_rewards`` and the row columns of one rank's rows.

    Args:
        batch: ``[b]`` rows with ``response_mask`` ``[b, T]`` (and ``old_log_probs``, ``ref_log_probs`` ``[b, T]``
            when ``beta`` is given).
        scores: ``[b]`` rows holding ``row_scores`` ``[b]`` (sequence scores, placed at the last valid token as
            :func:`~ppo_core.trainer.reward.scores_to_token_level` places them) or ``token_level_scores`` ``[b, T]``;
            None: ``batch`` holds ``token_level_scores`` already (a worker-side reward kept them).
        beta: the KL coefficient of the in-reward penalty (:func:`~ppo_core.kl_control.kl_penalty_rewards`); None:
            no penalty, the rewards are the scores.
        estimator: the penalty's KL estimator (``algorithm.kl_penalty``).

    Returns:
        ``[b]`` TensorDict: ``token_level_scores``, ``token_level_rewards`` ``[b, T]`` float32, ``row_reward_sum``
        ``[b]`` float64, ``row_valid`` ``[b]`` bool, ``row_length`` ``[b]`` int64 and, with ``beta``, ``row_kl``
        ``[b]``.
    """
    from ppo_core.kl_control import kl_penalty_rewards
    from ppo_core.trainer.reward import scores_to_token_level

    mask = batch.get(KEYS.response_mask).bool()
    if scores is None:
        token_scores = batch.get(KEYS.token_level_scores)
    elif ROW_SCORES in scores:
        token_scores = scores_to_token_level(scores.get(ROW_SCORES), mask)
    else:
        token_scores = scores.get(KEYS.token_level_scores)
    out = {KEYS.token_level_scores: token_scores}
    if beta is None:
        rewards = token_scores
    else:
        rewards, row_kl = kl_penalty_rewards(
            token_scores, batch.get(KEYS.old_log_probs), batch.get(KEYS.ref_log_probs), mask, beta, estimator
        )
        out[ROW_KL] = row_kl
    out[KEYS.token_level_rewards] = rewards
    out[ROW_REWARD_SUM] = rewards.to(torch.float64).sum(dim=-1)
    out[ROW_VALID] = mask.any(dim=-1)
    out[ROW_LENGTH] = mask.sum(dim=-1)
    return TensorDict(out, batch_size=batch.batch_size)


def gae_rows(batch: TensorDictBase, gamma: float, lam: float, whiten: bool = False) -> TensorDict:
    """GAE ``advantages`` and ``returns`` ``[b, T]`` of one rank's rows (``token_level_rewards``, ``values``,
    ``response_mask``): :func:`~ppo_core.advantages.gae.compute_gae`. ``whiten`` only where this rank holds the
    whole batch (the by-value computation, bit for bit); otherwise the batch's whitening follows through
    :mod:`ppo_core.masked_moments`."""
    from ppo_core.advantages.gae import compute_gae

    advantages, returns = compute_gae(
        batch.get(KEYS.token_level_rewards),
        batch.get(KEYS.values),
        batch.get(KEYS.response_mask),
        gamma=gamma,
        lam=lam,
        whiten=whiten,
    )
    return TensorDict({KEYS.advantages: advantages, KEYS.returns: returns}, batch_size=batch.batch_size)


def reinforce_pp_rows(batch: TensorDictBase, gamma: float, whiten: bool = False) -> TensorDict:
    """REINFORCE++ ``advantages`` and ``returns`` ``[b, T]`` of one rank's rows (``token_level_rewards``,
    ``response_mask``): the discounted reward-to-go ``G`` as both (:func:`~ppo_core.advantages.returns.
    reinforce_pp_returns`), the batch's whitening of the advantages following through :mod:`ppo_core.masked_moments`;
    ``whiten`` only where this rank holds the whole batch (:func:`~ppo_core.advantages.returns.
    compute_reinforce_pp_advantage` itself, bit for bit)."""
    from ppo_core.advantages.returns import compute_reinforce_pp_advantage, reinforce_pp_returns

    rewards, mask = batch.get(KEYS.token_level_rewards), batch.get(KEYS.response_mask)
    if whiten:
        advantages, returns = compute_reinforce_pp_advantage(rewards, mask, gamma=gamma)
    else:
        returns = reinforce_pp_returns(rewards, mask, gamma=gamma)
        advantages = returns.clone()
    return TensorDict({KEYS.advantages: advantages, KEYS.returns: returns}, batch_size=batch.batch_size)


def prompt_rows(
    table: list[torch.Tensor], index: torch.Tensor, width: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[b, width]`` int64 of the prompts ``table[index[i]]`` (1-D token ids),
    left-padded with ``pad_token_id``: the rows :func:`~ppo_core.trainer.data.collate_prompts` makes of them in a
    batch whose longest prompt has ``width`` tokens."""
    rows = len(index)
    input_ids = torch.full((rows, int(width)), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((rows, int(width)), dtype=torch.long)
    for i, j in enumerate(index.tolist()):
        row = table[j]
        if row.numel() > width:
            raise ValueError(f"prompt {j} has {row.numel()} tokens, more than the step's width {width}")
        input_ids[i, width - row.numel() :] = row
        attention_mask[i, width - row.numel() :] = 1
    return input_ids, attention_mask


def score_rows(batch: TensorDictBase, fields: TensorDictBase | None, reward) -> TensorDict:
    """Run a :class:`~ppo_core.trainer.worker_reward.WorkerReward` on one rank's rows.

    Args:
        batch: ``[b]`` rows of the generation (the reward's ``reads`` and ``response_mask``).
        fields: ``[b]`` rows of the prompts' fields the reward reads (non-tensor), or None.
        reward: the :class:`~ppo_core.trainer.worker_reward.WorkerReward`.

    Returns:
        ``[b]`` TensorDict to keep with the rows: ``token_level_scores`` ``[b, T]`` float32 (placed as the by-value
        step places a reward's scores), ``row_score_sum`` ``[b]`` float64 (the row sums the reward metrics read)
        and ``extra/{name}`` ``[b]`` float64 per extra info (a value that is not a number is NaN: the metrics
        skip both alike).
    """
    from ppo_core.trainer.reward import _normalize

    keys = list(dict.fromkeys([*reward.reads, KEYS.response_mask]))
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"the worker reward reads {missing}; the generation holds {sorted(batch.keys())}")
    rows = batch.select(*keys)
    for key in () if fields is None else list(fields.keys()):
        rows.set(key, fields.get(key))
    token_scores, extra = _normalize(reward.fn(rows), rows)
    out = {
        KEYS.token_level_scores: token_scores,
        ROW_SCORE_SUM: token_scores.to(torch.float64).sum(dim=-1),
    }
    for name, values in extra.items():
        out[EXTRA_PREFIX + name] = torch.tensor([_number(v) for v in values], dtype=torch.float64)
    return TensorDict(out, batch_size=batch.batch_size)


def _number(value) -> float:
    """``value`` as the reward metrics count it: a finite number (bools included), else NaN (skipped)."""
    from ppo_core.rewards.metrics import _is_number

    return float(value) if _is_number(value) else float("nan")


def _correction_inputs(batch: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch.get(KEYS.old_log_probs), batch.get(KEYS.rollout_log_probs), batch.get(KEYS.response_mask)


def correction_rows_and_parts(batch: TensorDictBase, config) -> tuple[TensorDict, Any]:
    """The rollout correction of one rank's rows (``old_log_probs``, ``rollout_log_probs``, ``response_mask``) in
    one pass over their tokens: the row-local outputs, ``rollout_is_weights`` ``[b, R]`` before the batch
    normalisation (with ``config.rollout_is``) and :data:`POLICY_MASK` (with ``config.rollout_rs``), the by-value
    step's rows bit for bit (:func:`~ppo_core.rollout_correction.partial.correction_rows`), and the
    :func:`correction_parts` of the same rows (the weights, the rejection and the metrics' partials share every
    per-token term)."""
    from ppo_core.rollout_correction.partial import correction_rows as rows

    weights, mask, parts = rows(*_correction_inputs(batch), config)
    out = {}
    if weights is not None:
        out[KEYS.rollout_is_weights] = weights
    if config.rollout_rs is not None:
        out[POLICY_MASK] = mask
    return TensorDict(out, batch_size=batch.batch_size), parts


def correction_parts(batch: TensorDictBase, config):
    """One rank's :class:`~ppo_core.rollout_correction.partial.CorrectionParts` (the metrics' partials and the
    batch normalisation's exact sum), for the controller's
    :func:`~ppo_core.rollout_correction.partial.reduce_correction_parts`."""
    from ppo_core.rollout_correction.partial import correction_rows as rows

    return rows(*_correction_inputs(batch), config)[2]


class CorrectionPartsMemo:
    """A rank's rollout-correction parts kept from the call that computed its rows (:func:`correction_rows_and_parts`)
    for the call that asks for them next (the controller dispatches the rows, then gathers the parts): taken back
    only for the same input tensors (the very objects) and an equal config, once; otherwise computed again
    (:func:`correction_parts`)."""

    def __init__(self) -> None:
        self._kept: tuple[tuple[torch.Tensor, ...], Any, Any] | None = None

    def rows(self, batch: TensorDictBase, config) -> TensorDict:
        out, parts = correction_rows_and_parts(batch, config)
        self._kept = (_correction_inputs(batch), config, parts)
        return out

    def parts(self, batch: TensorDictBase, config):
        kept, self._kept = self._kept, None
        if kept is not None:
            inputs, kept_config, parts = kept
            same = all(a is b for a, b in zip(inputs, _correction_inputs(batch), strict=True))
            if same and kept_config == config:
                return parts
        return correction_parts(batch, config)


def policy_view(batch: TensorDictBase) -> TensorDict:
    """One rank's rows as the actor's update reads them: :data:`POLICY_MASK` as ``response_mask`` (the same
    tensors, no copy), the other keys as they are."""
    out = {k: batch.get(k) for k in list(batch.keys()) if k not in (KEYS.response_mask, POLICY_MASK)}
    out[KEYS.response_mask] = batch.get(POLICY_MASK)
    return TensorDict(out, batch_size=batch.batch_size)
