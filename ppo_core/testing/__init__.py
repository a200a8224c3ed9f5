"""Public testing utilities: hypothesis strategies for PPO-shaped data and slow, obviously-correct oracles.

Users import these to property-test their own implementations against ours::

    from hypothesis import given
    from ppo_core.testing import ppo_batches, gae_oracle

    @given(ppo_batches(dtype=torch.float64))
    def test_my_gae(b):
        adv, ret = my_gae(b.token_level_rewards, b.values, b.response_mask)
        ref_adv, ref_ret = gae_oracle(b.token_level_rewards, b.values, b.response_mask, whiten=False)
        ...

Every strategy takes ``device`` so the same properties run on a GPU.
"""

from __future__ import annotations

from ppo_core.testing.advantage_oracles import (
    ADVANTAGE_ORACLES,
    advantage_inputs_from_batch,
    gae_oracle,
    gpg_oracle,
    grpo_oracle,
    grpo_passk_oracle,
    opo_oracle,
    reinforce_pp_baseline_oracle,
    reinforce_pp_oracle,
    remax_oracle,
    rloo_oracle,
)
from ppo_core.testing.batch_strategies import assert_batch_rows, td_batches, uid_texts
from ppo_core.testing.kl_oracles import entropy_oracle, full_kl_oracle, kl_penalty_oracle, logprobs_oracle
from ppo_core.testing.loss_oracles import (
    PolicyLossInputs,
    agg_loss_oracle,
    cispo_policy_loss_oracle,
    clip_cov_policy_loss_oracle,
    dppo_kl_policy_loss_oracle,
    dppo_tv_policy_loss_oracle,
    dro_policy_loss_oracle,
    entropy_loss_oracle,
    geo_mean_policy_loss_oracle,
    gpg_policy_loss_oracle,
    gspo_policy_loss_oracle,
    kl_cov_policy_loss_oracle,
    policy_loss_inputs,
    sapo_policy_loss_oracle,
    value_loss_oracle,
    vanilla_policy_loss_oracle,
)
from ppo_core.testing.rollout_correction_oracles import rollout_correction_oracle
from ppo_core.testing.strategies import PPOBatch, group_ids, mask_rows, ppo_batches, response_masks

__all__ = [
    "ADVANTAGE_ORACLES",
    "PPOBatch",
    "PolicyLossInputs",
    "advantage_inputs_from_batch",
    "agg_loss_oracle",
    "assert_batch_rows",
    "cispo_policy_loss_oracle",
    "clip_cov_policy_loss_oracle",
    "dppo_kl_policy_loss_oracle",
    "dppo_tv_policy_loss_oracle",
    "dro_policy_loss_oracle",
    "entropy_loss_oracle",
    "entropy_oracle",
    "full_kl_oracle",
    "gae_oracle",
    "geo_mean_policy_loss_oracle",
    "gpg_oracle",
    "gpg_policy_loss_oracle",
    "group_ids",
    "grpo_oracle",
    "grpo_passk_oracle",
    "gspo_policy_loss_oracle",
    "kl_cov_policy_loss_oracle",
    "kl_penalty_oracle",
    "logprobs_oracle",
    "mask_rows",
    "opo_oracle",
    "policy_loss_inputs",
    "ppo_batches",
    "reinforce_pp_baseline_oracle",
    "reinforce_pp_oracle",
    "remax_oracle",
    "response_masks",
    "rloo_oracle",
    "rollout_correction_oracle",
    "sapo_policy_loss_oracle",
    "td_batches",
    "uid_texts",
    "value_loss_oracle",
    "vanilla_policy_loss_oracle",
]
