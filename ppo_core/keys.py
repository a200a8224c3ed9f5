"""The names of the batch keys, declared once: every module that reads or writes a PPO batch uses :data:`KEYS`.

A PPO batch is a ``TensorDict`` with ``batch_size=[B]``: ``B`` responses, each after a prompt left-padded to
width ``P``; responses are right-padded to width ``R``. Token-level tensors of the response are ``[B, R]`` and are
aligned with ``responses``: position ``t`` holds the quantity of response token ``t`` (a log-probability scored
with the logits at sequence position ``P + t - 1``, the value of the state before the token...). Masked positions
(``response_mask == 0``) carry no meaning; the producers of ``[B, R]`` tensors write 0 there.

One spelling per quantity: log-probabilities are plural (``old_log_probs``, ``ref_log_probs``,
``rollout_log_probs``), per-token entropies are ``entropies``.

Example:
    >>> from ppo_core.keys import KEYS
    >>> KEYS.ref_log_probs
    'ref_log_probs'
    >>> KEYS.num_turns
    '__num_turns__'
"""

from __future__ import annotations

import dataclasses

__all__ = ["KEYS", "BatchKeys"]


@dataclasses.dataclass(frozen=True)
class BatchKeys:
    """The key of each quantity in a PPO batch (field name = key, except where a docstring says otherwise)."""

    # ---- generation (rollout engine output; verl's layout)
    prompts: str = "prompts"
    """``[B, P]`` int64 prompt token ids, left-padded."""
    responses: str = "responses"
    """``[B, R]`` int64 response token ids, right-padded (pad token after the end)."""
    input_ids: str = "input_ids"
    """``[B, P+R]`` int64 prompt then response (before generation: the prompt alone, ``[B, P]``)."""
    attention_mask: str = "attention_mask"
    """``[B, P+R]`` 0/1: 1 on prompt and response tokens, 0 on padding (before generation: ``[B, P]``)."""
    response_mask: str = "response_mask"
    """``[B, R]`` 0/1: 1 on the response tokens that count (up to and including the first EOS), 0 after."""
    rollout_log_probs: str = "rollout_log_probs"
    """``[B, R]`` float: log-prob of each sampled token under the sampling distribution (``log_softmax(logits /
    T)``, ``T = 1`` for greedy decoding, before top-p truncation); 0 on masked positions."""

    # ---- scoring by the workers
    old_log_probs: str = "old_log_probs"
    """``[B, R]`` float: log-probs of the responses under the policy before the update (``compute_log_prob``)."""
    entropies: str = "entropies"
    """``[B, R]`` float: per-token entropy of the policy before the update (``compute_log_prob``)."""
    ref_log_probs: str = "ref_log_probs"
    """``[B, R]`` float: log-probs of the responses under the frozen reference policy (``compute_ref_log_prob``)."""
    values: str = "values"
    """``[B, R]`` float: the critic's value of the state before each response token (``compute_values``)."""

    # ---- rewards and advantages (controller)
    token_level_scores: str = "token_level_scores"
    """``[B, R]`` float: the reward function's scores (a sequence score sits at the last valid token)."""
    token_level_rewards: str = "token_level_rewards"
    """``[B, R]`` float: the scores after the in-reward KL penalty (equal to the scores without it)."""
    reward_baselines: str = "reward_baselines"
    """``[B]`` float: per-response baseline of estimators that take one (ReMax: the greedy response's reward)."""
    advantages: str = "advantages"
    """``[B, R]`` float: advantage of each response token (0 on masked positions)."""
    returns: str = "returns"
    """``[B, R]`` float: regression target of the critic (0 on masked positions)."""
    rollout_is_weights: str = "rollout_is_weights"
    """``[B, R]`` float: importance weights of the rollout correction (truncated ``pi_old / pi_rollout``), which
    multiply the per-token policy loss (:func:`~ppo_core.rollout_correction.compute_rollout_correction`)."""

    # ---- per-response fields (non-tensor unless noted)
    uid: str = "uid"
    """Group id: the ``n`` responses sampled for one prompt share it (a string per row)."""
    data_source: str = "data_source"
    """Name of the dataset a prompt comes from (a string per row; validation metrics group by it)."""
    ground_truth: str = "ground_truth"
    """The prompt's reference answer, as the dataset gives it (read by reward functions)."""
    num_turns: str = "__num_turns__"
    """Number of turns of a multi-turn rollout (an int per row), when the rollout reports it."""

    def all(self) -> tuple[str, ...]:
        """Every key, in declaration order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


KEYS = BatchKeys()
"""The batch keys of ppo-core (``KEYS.old_log_probs == "old_log_probs"``...)."""
