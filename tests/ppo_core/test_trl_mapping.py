"""Every equality claimed by ``docs/migrating-from-trl.md``: TRL's ``GRPOTrainer`` loss (each ``loss_type``, both
``importance_sampling_level`` s, ``delta``, ``beta`` with and without ``use_bias_correction_kl``) and advantages
(``scale_rewards`` ``group`` / ``none``), written below from their formulas, against ppo-core's functions configured
as the page says (:func:`ppo_core_config`), values and gradients, on random inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core.advantages import compute_grpo_advantage
from ppo_core.keys import KEYS
from ppo_core.losses import LOG_RATIO_CLAMP, compute_policy_loss
from ppo_core.testing.loss_oracles import policy_loss_inputs
from ppo_core.workers.config import PPOActorConfig
from ppo_core.workers.engine import LOG_PROBS
from ppo_core.workers.objectives import actor_loss

TOKEN_LEVEL = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
SEQUENCE_LEVEL = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]
MAX_COMPLETION_LENGTH = 16


# ------------------------------------------------------------------------------------ TRL, from its formulas
def trl_loss(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref: torch.Tensor | None = None,
    bias_correction_kl: bool = False,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
    num_items_in_batch: torch.Tensor | None = None,
    num_processes: int = 1,
    accumulation_steps: int = 1,
) -> torch.Tensor:
    """The loss one process back-propagates for one micro-batch (``adv`` ``[B, T]`` or ``[B, 1]``)."""
    mask = mask.to(new.dtype)
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    log_ratio = new - old
    if level == "token":
        log_w = log_ratio
    else:  # one ratio per sequence: the mean log-ratio over its valid tokens, [B, 1]
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if loss_type == "cispo":  # epsilon_high is an absolute cap of the ratio
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * new
    elif loss_type == "sapo":
        tau = torch.full_like(adv, temperature_neg).masked_fill(adv > 0, temperature_pos)
        per_token = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        kl = torch.exp(ref - new) - (ref - new) - 1
        if bias_correction_kl:
            kl = kl * torch.exp(log_w)  # the ratio before the delta clamp
        per_token = per_token + beta * kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * MAX_COMPLETION_LENGTH) / accumulation_steps
    if loss_type in ("dapo", "cispo"):
        items = mask.sum() if num_items_in_batch is None else num_items_in_batch
        return (per_token * mask).sum() / (items.clamp(min=1.0) / num_processes)
    assert loss_type == "luspo"
    return (per_token * mask.sum(1, keepdim=True)).mean() / accumulation_steps


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """``[B]`` advantages of ``[B]`` rewards in consecutive groups of ``num_generations``."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    std = grouped.std(1).repeat_interleave(num_generations)  # Bessel-corrected, as TRL's nanstd
    advantages = rewards - mean
    return advantages if scale_rewards == "none" else advantages / (std + 1e-4)


# ------------------------------------------------------------------------------------ ppo-core, as the page says
def ppo_core_config(
    loss_type: str,
    *,
    level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = False,
    temperature_pos: float = 1.0,
    temperature_neg: float = 1.05,
) -> dict[str, Any]:
    """The actor-config fields of ``docs/migrating-from-trl.md`` for a TRL ``GRPOConfig``."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mode = {
        "grpo": "seq-mean-token-mean",
        "sapo": "seq-mean-token-mean",
        "bnpo": "token-mean",
        "dapo": "token-mean",
        "cispo": "token-mean",
        "dr_grpo": "seq-mean-token-sum-norm",
        "luspo": "seq-mean-token-sum",
    }[loss_type]
    loss: dict[str, Any] = {"loss_agg_mode": mode, "clip_ratio_low": epsilon, "clip_ratio_high": eps_high}
    if level == "sequence":
        loss["loss_mode"] = "gspo"
    elif loss_type == "cispo":
        loss.update(loss_mode="cispo", clip_ratio_low=1.0, clip_ratio_high=eps_high - 1.0)
    elif loss_type == "sapo":
        loss.update(loss_mode="sapo", tau_pos=temperature_pos, tau_neg=temperature_neg)
    else:
        loss.update(loss_mode="vanilla", clip_ratio_c=delta)
    return {
        "policy_loss": loss,
        "use_kl_loss": beta != 0.0,
        "kl_loss_coef": beta,
        "kl_loss_type": "k3",
        "kl_loss_importance_weighted": bias_correction_kl,
        "loss_scale_factor": MAX_COMPLETION_LENGTH if loss_type == "dr_grpo" else None,
    }


def ppo_core_loss(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    config: dict[str, Any],
    *,
    ref: torch.Tensor | None = None,
    rows: int | None = None,
    tokens: torch.Tensor | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """The actor objective of the workers on one micro-batch, with the step's row and token counts (``rows``:
    every row of the optimizer step, on all processes; ``tokens``: every valid token of it)."""
    cfg = PPOActorConfig.from_dict(config)
    micro = TensorDict(
        {
            KEYS.old_log_probs: old,
            KEYS.advantages: adv.expand_as(old),
            KEYS.response_mask: mask,
            KEYS.ref_log_probs: old if ref is None else ref,
        },
        batch_size=[old.shape[0]],
    )
    agg = {
        "dp_size": dp_size,
        "global_batch_size": old.shape[0] if rows is None else rows,
        "batch_num_tokens": tokens,
        "loss_scale_factor": cfg.loss_scale_factor,
    }
    loss, _ = actor_loss(micro, {LOG_PROBS: new}, config=cfg, agg=agg)
    return loss


# ------------------------------------------------------------------------------------ tests
@st.composite
def trl_inputs(draw: st.DrawFn, *, level: str) -> tuple[torch.Tensor, ...]:
    """old, new, advantages (``[B, T]`` per token at the token level, ``[B, 1]`` per sequence), mask, ref."""
    inputs = draw(policy_loss_inputs(with_is_weights=False, max_len=MAX_COMPLETION_LENGTH))
    old, new, mask = inputs.old_log_prob, inputs.log_prob, inputs.response_mask
    assume(bool(((new - old).abs() < LOG_RATIO_CLAMP).all()))  # TRL does not clamp the log-ratio
    adv = inputs.advantages if level == "token" else inputs.advantages[:, :1]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ref = new + 0.3 * torch.randn(new.shape, generator=gen, dtype=new.dtype)
    return old, new, adv, mask, ref


def _close(ours: torch.Tensor, theirs: torch.Tensor, new: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    g_ours, g_theirs = (
        torch.autograd.grad(ours, new, retain_graph=True)[0],
        torch.autograd.grad(theirs, new)[0],
    )
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-9, atol=1e-12)


OPTIONS = st.fixed_dictionaries(
    {
        "epsilon": st.sampled_from([0.1, 0.2]),
        "epsilon_high": st.sampled_from([None, 0.28]),
        "beta": st.sampled_from([0.0, 0.04]),
        "bias_correction_kl": st.booleans(),
    }
)


@settings(max_examples=60)
@given(data=st.data(), loss_type=st.sampled_from(TOKEN_LEVEL), options=OPTIONS)
def test_token_level_losses(data: st.DataObject, loss_type: str, options: dict[str, Any]) -> None:
    old, new, adv, mask, ref = data.draw(trl_inputs(level="token"))
    if loss_type == "cispo":  # epsilon_high is the absolute cap (TRL recommends 5.0)
        options["epsilon_high"] = data.draw(st.sampled_from([1.28, 5.0]))
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        high = 1 + (options["epsilon_high"] or options["epsilon"])
        options["delta"] = data.draw(st.sampled_from([None, high, 3.0]))  # delta >= 1 + epsilon_high
    if loss_type == "sapo":
        options.update(temperature_pos=1.0, temperature_neg=data.draw(st.sampled_from([1.05, 2.0])))
    new = new.clone().requires_grad_(True)
    assume(bool((ref - new < 2.3).all()))  # k3 below ppo-core's cap of 10
    theirs = trl_loss(old, new, adv, mask, loss_type=loss_type, ref=ref, **options)
    ours = ppo_core_loss(old, new, adv, mask, ppo_core_config(loss_type, **options), ref=ref)
    _close(ours, theirs, new)


@settings(max_examples=60)
@given(data=st.data(), loss_type=st.sampled_from(SEQUENCE_LEVEL), beta=st.sampled_from([0.0, 0.04]))
def test_sequence_level_losses_are_gspo(data: st.DataObject, loss_type: str, beta: float) -> None:
    """``importance_sampling_level="sequence"`` (GSPO, and LUSPO) is ``gspo`` with the loss type's aggregation;
    the plain KL term (without TRL's bias correction, which uses the sequence ratio there) is the same, except for
    ``luspo``, whose reduction averages the KL over all ``B x T`` positions, padding included (no counterpart)."""
    if loss_type == "luspo":
        beta = 0.0
    old, new, adv, mask, ref = data.draw(trl_inputs(level="sequence"))
    new = new.clone().requires_grad_(True)
    assume(bool((ref - new < 2.3).all()))
    options = {"epsilon": 3e-4, "epsilon_high": 4e-4, "beta": beta}  # the GSPO paper's ranges
    theirs = trl_loss(old, new, adv, mask, loss_type=loss_type, level="sequence", ref=ref, **options)
    ours = ppo_core_loss(
        old, new, adv, mask, ppo_core_config(loss_type, level="sequence", **options), ref=ref
    )
    _close(ours, theirs, new)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo"])
def test_gradient_accumulation_and_processes(loss_type: str) -> None:
    """Four equal micro-batches (2 processes x 2 accumulation steps): each micro-batch's loss is TRL's when the
    step's row and token counts are passed, as the workers do (``global_loss_denominators``)."""
    gen = torch.Generator().manual_seed(0)
    rows, length = 8, MAX_COMPLETION_LENGTH
    old = -torch.rand(rows, length, generator=gen, dtype=torch.float64)
    new = old + 0.1 * torch.randn(rows, length, generator=gen, dtype=torch.float64)
    mask = (torch.arange(length)[None] < torch.randint(0, length + 1, (rows, 1), generator=gen)).long()
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64)
    level = "sequence" if loss_type == "luspo" else "token"
    config = ppo_core_config(loss_type, level=level)
    for part in range(4):
        sl = slice(2 * part, 2 * part + 2)
        micro_new = new[sl].clone().requires_grad_(True)
        theirs = trl_loss(
            old[sl], micro_new, adv[sl], mask[sl], loss_type=loss_type, level=level,
            num_items_in_batch=mask.sum().to(torch.float64), num_processes=2, accumulation_steps=2,
        )  # fmt: skip
        ours = ppo_core_loss(
            old[sl], micro_new, adv[sl], mask[sl], config, rows=rows, tokens=mask.sum().double(), dp_size=2
        )
        _close(ours, theirs, micro_new)


def test_without_delta_the_dual_clip_must_be_off() -> None:
    """TRL's default (``delta=None``) is the plain clipped surrogate: ppo-core's default dual clip (3.0) differs
    where a negative advantage meets a ratio above 3, so ``clip_ratio_c=None`` is part of the mapping."""
    old, new = (
        torch.zeros(1, 1, dtype=torch.float64),
        torch.full((1, 1), 1.5, dtype=torch.float64),
    )  # r = e^1.5
    adv, mask = -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    theirs = trl_loss(old, new, adv, mask, loss_type="dapo")
    mapped = ppo_core_config("dapo")["policy_loss"]
    assert compute_policy_loss(old, new, adv, mask, config=mapped)[0] == pytest.approx(float(theirs))
    default_dual_clip = compute_policy_loss(old, new, adv, mask, config={**mapped, "clip_ratio_c": 3.0})[0]
    assert float(default_dual_clip) == pytest.approx(3.0) != pytest.approx(float(theirs))


@settings(max_examples=40)
@given(
    groups=st.integers(1, 5),
    n=st.integers(2, 6),
    scale_rewards=st.sampled_from(["group", "none"]),
    seed=st.integers(0, 2**31 - 1),
    binary=st.booleans(),
)
def test_advantages(groups: int, n: int, scale_rewards: str, seed: int, binary: bool) -> None:
    """``scale_rewards="group"`` is ``grpo`` with ``epsilon=1e-4`` (``algorithm.adv_std_epsilon``); ``"none"`` is
    ``norm_adv_by_std_in_grpo=False``; the per-sequence advantage is broadcast over the valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    shape = (groups * n,)
    rewards = (
        (torch.rand(shape, generator=gen) < 0.5).double() if binary else torch.randn(shape, generator=gen)
    )
    rewards = rewards.to(torch.float64)
    theirs = trl_advantages(rewards, n, scale_rewards)
    length = 5
    mask = torch.ones(groups * n, length)
    token_rewards = torch.zeros(groups * n, length, dtype=torch.float64)
    token_rewards[:, -1] = rewards
    index = [i // n for i in range(groups * n)]
    ours, _ = compute_grpo_advantage(
        token_rewards, mask, index, norm_by_std=scale_rewards == "group", epsilon=1e-4
    )
    torch.testing.assert_close(ours, theirs[:, None].expand(-1, length), rtol=1e-12, atol=1e-12)


def test_scale_rewards_batch_composition() -> None:
    """``scale_rewards="batch"``: group-centred (``norm_by_std=False``), divided by the batch's std + 1e-4."""
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(12, generator=gen, dtype=torch.float64)
    grouped_mean = rewards.view(-1, 4).mean(1).repeat_interleave(4)
    theirs = (rewards - grouped_mean) / (rewards.std() + 1e-4)
    token_rewards = torch.zeros(12, 3, dtype=torch.float64)
    token_rewards[:, -1] = rewards
    centred, _ = compute_grpo_advantage(
        token_rewards, torch.ones(12, 3), [i // 4 for i in range(12)], norm_by_std=False
    )
    torch.testing.assert_close(centred[:, 0] / (rewards.std() + 1e-4), theirs, rtol=1e-12, atol=1e-12)


def test_mask_truncated_completions_recipe() -> None:
    """TRL scores truncated completions into the group statistics and masks them only in the loss: compute the
    advantages with the full mask, then zero the truncated rows' mask (zeroing it first changes the groups)."""
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(8, generator=gen, dtype=torch.float64)
    truncated = torch.tensor([True, False, False, False, False, True, False, False])
    theirs = trl_advantages(rewards, 4, "group")
    token_rewards = torch.zeros(8, 3, dtype=torch.float64)
    token_rewards[:, -1] = rewards
    index = [i // 4 for i in range(8)]
    full, _ = compute_grpo_advantage(token_rewards, torch.ones(8, 3), index, epsilon=1e-4)
    torch.testing.assert_close(full[:, 0], theirs, rtol=1e-12, atol=1e-12)
    loss_mask = torch.ones(8, 3, dtype=torch.long)
    loss_mask[truncated] = 0
    early, _ = compute_grpo_advantage(token_rewards, loss_mask, index, epsilon=1e-4)
    assert not torch.allclose(early[~truncated, 0], theirs[~truncated])
    # the loss then counts every row in grpo's mean (the truncated ones contribute 0)
    old = -torch.rand(8, 3, generator=gen, dtype=torch.float64)
    new = (old + 0.1 * torch.randn(8, 3, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = theirs[:, None]
    ours = ppo_core_loss(old, new, full[:, :1], loss_mask, ppo_core_config("grpo"))
    _close(ours, trl_loss(old, new, adv, loss_mask, loss_type="grpo"), new)
