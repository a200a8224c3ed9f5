"""Slow, obviously-correct float64 oracles for every advantage estimator of :mod:`ppo_core.advantages`.

Each oracle loops over rows, tokens and groups in plain Python floats (``math.fsum``) and follows the documented
semantics of the fast function of the same name, including its deliberate deviations from verl (rows without a
valid token leave the group statistics, exact zeros on masked tokens, 0 instead of a whitening error). Outputs are
float64 CPU tensors. Use them to check your own implementation::

    fast, _ = compute_grpo_advantage(rewards, mask, index)
    slow, _ = grpo_oracle(rewards, mask, index)
    torch.testing.assert_close(fast.double(), slow, atol=1e-9, rtol=0)

``ADVANTAGE_ORACLES`` maps each registry name to an oracle with the registry's calling convention.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch

from ppo_core.advantages.registry import AdvantageInputs
from ppo_core.testing.strategies import PPOBatch

__all__ = [
    "ADVANTAGE_ORACLES",
    "advantage_inputs_from_batch",
    "gae_oracle",
    "gpg_oracle",
    "grpo_oracle",
    "grpo_passk_oracle",
    "opo_oracle",
    "reinforce_pp_baseline_oracle",
    "reinforce_pp_oracle",
    "remax_oracle",
    "rloo_oracle",
]

Tensor = torch.Tensor
Pair = tuple[torch.Tensor, torch.Tensor]
Index = torch.Tensor | Sequence[Hashable]
Rows = list[list[float]]
WHITEN_EPS = 1e-8


def _floats(t: torch.Tensor) -> Rows:
    return t.detach().to("cpu", torch.float64).tolist()


def _bools(m: torch.Tensor) -> list[list[bool]]:
    return (m.detach().cpu() != 0).tolist()


def _tensor(rows: Rows, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).reshape(like.shape)


def _whiten(rows: Rows, mask: list[list[bool]]) -> Rows:
    """Batch-global whitening of the valid entries, each centred about the first valid one before the mean is taken
    (so that constant values give exactly 0, as in :func:`ppo_core.masked.masked_whiten`)."""
    valid = [x for row, mrow in zip(rows, mask, strict=True) for x, m in zip(row, mrow, strict=True) if m]
    n = len(valid)
    ref = valid[0] if n else 0.0
    mean = math.fsum(x - ref for x in valid) / n if n else 0.0
    var = math.fsum((x - ref - mean) ** 2 for x in valid) / (n - 1) if n > 1 else 0.0
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [
        [(x - ref - mean) * scale if m else 0.0 for x, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(rows, mask, strict=True)
    ]


def _spread(per_row: list[float], mask: list[list[bool]]) -> Rows:
    return [[a if m else 0.0 for m in mrow] for a, mrow in zip(per_row, mask, strict=True)]


def gae_oracle(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> Pair:
    """Per-row, per-token GAE loop; masked tokens leave the running state untouched.

    Args mirror :func:`ppo_core.advantages.compute_gae` (``[B, T]`` rewards, values, mask).

    Returns:
        ``(advantages, returns)``, ``[B, T]`` float64 CPU tensors, 0 on masked tokens.

    Example:
        >>> gae_oracle(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), gamma=0.5, whiten=False)[0]
        tensor([[0.5000, 1.0000]], dtype=torch.float64)
    """
    r, v, mask = _floats(rewards), _floats(values), _bools(response_mask)
    raw, ret = [], []
    for r_row, v_row, m_row in zip(r, v, mask, strict=True):
        next_value, last_gae = 0.0, 0.0
        a_row, g_row = [0.0] * len(m_row), [0.0] * len(m_row)
        for t in reversed(range(len(m_row))):
            if m_row[t]:
                delta = r_row[t] + gamma * next_value - v_row[t]
                last_gae = delta + gamma * lam * last_gae
                next_value = v_row[t]
                a_row[t], g_row[t] = last_gae, last_gae + v_row[t]
        raw.append(a_row)
        ret.append(g_row)
    adv = _whiten(raw, mask) if whiten else raw
    return _tensor(adv, rewards), _tensor(ret, rewards)


def _reward_to_go(r: Rows, mask: list[list[bool]], gamma: float) -> Rows:
    out = []
    for r_row, m_row in zip(r, mask, strict=True):
        running, g_row = 0.0, [0.0] * len(m_row)
        for t in reversed(range(len(m_row))):
            if m_row[t]:
                running = r_row[t] + gamma * running
                g_row[t] = running
        out.append(g_row)
    return out


def reinforce_pp_oracle(rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Pair:
    """Per-token discounted reward-to-go over valid tokens, whitened. ``[B, T]`` float64 pair.

    Example:
        >>> reinforce_pp_oracle(torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), gamma=0.5)[1]
        tensor([[0.5000, 1.0000]], dtype=torch.float64)
    """
    mask = _bools(response_mask)
    g = _reward_to_go(_floats(rewards), mask, gamma)
    return _tensor(_whiten(g, mask), rewards), _tensor(g, rewards)


def remax_oracle(rewards: Tensor, reward_baselines: Tensor, response_mask: Tensor) -> Pair:
    """Undiscounted reward-to-go minus the row's ``[B]`` baseline on valid tokens. ``[B, T]`` float64 pair.

    Example:
        >>> remax_oracle(torch.tensor([[0.0, 1.0]]), torch.tensor([0.25]), torch.ones(1, 2))[0]
        tensor([[0.7500, 0.7500]], dtype=torch.float64)
    """
    mask = _bools(response_mask)
    g = _reward_to_go(_floats(rewards), mask, 1.0)
    b = reward_baselines.detach().to("cpu", torch.float64).tolist()
    adv = [
        [x - b_i if m else 0.0 for x, m in zip(row, mrow, strict=True)]
        for row, mrow, b_i in zip(g, mask, b, strict=True)
    ]
    return _tensor(adv, rewards), _tensor(g, rewards)


def _groups(index: torch.Tensor | Sequence[Hashable]) -> dict[Hashable, list[int]]:
    labels = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    members: dict[Hashable, list[int]] = {}
    for i, label in enumerate(labels):
        members.setdefault(label, []).append(i)
    return members


def _group_oracle(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor | Sequence[Hashable],
    rule: Callable[[list[float], list[int]], list[float]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``rule(scores, lengths) -> advantages`` to each group's rows that have a valid token."""
    mask = _bools(response_mask)
    scores = [math.fsum(row) for row in _floats(rewards)]
    per_row = [0.0] * len(scores)
    for rows in _groups(index).values():
        kept = [i for i in rows if any(mask[i])]
        if kept:
            out = rule([scores[i] for i in kept], [sum(mask[i]) for i in kept])
            for i, a in zip(kept, out, strict=True):
                per_row[i] = a
    adv = _tensor(_spread(per_row, mask), rewards)
    return adv, adv.clone()


def _centred(s: list[float]) -> list[float]:
    if max(s) == min(s):
        return [0.0] * len(s)
    mean = math.fsum(s) / len(s)
    return [x - mean for x in s]


def _std(s: list[float]) -> float:
    c = _centred(s)
    return math.sqrt(math.fsum(x * x for x in c) / (len(s) - 1))


def grpo_oracle(
    rewards: Tensor, response_mask: Tensor, index: Index, norm_by_std: bool = True, epsilon: float = 1e-6
) -> Pair:
    """Per-group GRPO / Dr.GRPO loop (singleton: mean 0, std 1). ``[B, T]`` float64 pair.

    Example:
        >>> grpo_oracle(torch.tensor([[1.0], [0.0]]), torch.ones(2, 1), ["u", "u"], norm_by_std=False)[0]
        tensor([[ 0.5000],
                [-0.5000]], dtype=torch.float64)
    """

    def rule(s: list[float], _: list[int]) -> list[float]:
        if len(s) == 1:
            return [s[0] / (1.0 + epsilon)] if norm_by_std else s
        c, d = _centred(s), _std(s) + epsilon
        return [x / d if norm_by_std and d > 0 else x for x in c]

    return _group_oracle(rewards, response_mask, index, rule)


def rloo_oracle(rewards: Tensor, response_mask: Tensor, index: Index) -> Pair:
    """Per-row leave-one-out mean baseline; singleton keeps its raw score. ``[B, T]`` float64 pair.

    Example:
        >>> rloo_oracle(torch.tensor([[1.0], [0.0], [0.7]]), torch.ones(3, 1), [0, 0, 1])[0].squeeze(-1)
        tensor([ 1.0000, -1.0000,  0.7000], dtype=torch.float64)
    """

    def rule(s: list[float], _: list[int]) -> list[float]:
        if len(s) == 1:
            return s
        if max(s) == min(s):
            return [0.0] * len(s)
        return [x - math.fsum(s[:i] + s[i + 1 :]) / (len(s) - 1) for i, x in enumerate(s)]

    return _group_oracle(rewards, response_mask, index, rule)


def _mean_baseline(s: list[float], _: list[int]) -> list[float]:
    return s if len(s) == 1 else _centred(s)


def reinforce_pp_baseline_oracle(rewards: Tensor, response_mask: Tensor, index: Index) -> Pair:
    """Group-mean baseline on every valid token, then whitening over all valid tokens. ``[B, T]`` float64 pair.

    Example:
        >>> reinforce_pp_baseline_oracle(torch.tensor([[1.0], [0.0]]), torch.ones(2, 1), [0, 0])[0].squeeze(-1)
        tensor([ 0.7071, -0.7071], dtype=torch.float64)
    """
    centred, _ = _group_oracle(rewards, response_mask, index, _mean_baseline)
    mask = _bools(response_mask)
    adv = _tensor(_whiten(_floats(centred), mask), rewards)
    return adv, adv.clone()


def opo_oracle(rewards: Tensor, response_mask: Tensor, index: Index) -> Pair:
    """Length-weighted group-mean baseline; singleton baseline 0. ``[B, T]`` float64 pair.

    Example:
        >>> r, m = torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.tensor([[1, 1], [1, 0]])
        >>> opo_oracle(r, m, [0, 0])[0][:, 0]
        tensor([ 0.3333, -0.6667], dtype=torch.float64)
    """

    def rule(s: list[float], lengths: list[int]) -> list[float]:
        if len(s) == 1:
            return s
        if max(s) == min(s):
            return [0.0] * len(s)
        b = math.fsum(n * x for n, x in zip(lengths, s, strict=True)) / sum(lengths)
        return [x - b for x in s]

    return _group_oracle(rewards, response_mask, index, rule)


def gpg_oracle(
    rewards: Tensor, response_mask: Tensor, index: Index, f_norm: float = 1.0, alpha: float | None = None
) -> Pair:
    """Group-mean baseline times ``alpha / f_norm``; ``alpha`` = valid rows / rows with a nonzero score.

    Example:
        >>> gpg_oracle(torch.tensor([[1.0], [0.0], [0.0], [0.0]]), torch.ones(4, 1), [0, 0, 1, 1])[0].squeeze(-1)
        tensor([ 2., -2.,  0.,  0.], dtype=torch.float64)
    """
    if alpha is None:
        mask = _bools(response_mask)
        scores = [math.fsum(row) for row in _floats(rewards)]
        valid = [s for s, mrow in zip(scores, mask, strict=True) if any(mrow)]
        alpha = len(valid) / max(sum(1 for s in valid if s != 0), 1)
    adv, _ = _group_oracle(rewards, response_mask, index, _mean_baseline)
    adv = adv * (alpha / f_norm)
    return adv, adv.clone()


def grpo_passk_oracle(
    rewards: Tensor, response_mask: Tensor, index: Index, norm_by_std: bool = True, epsilon: float = 1e-6
) -> Pair:
    """Per group: the unique best row gets its margin over the runner-up (over the std + epsilon).

    Example:
        >>> r = torch.tensor([[1.0], [0.0], [0.5]])
        >>> grpo_passk_oracle(r, torch.ones(3, 1), [0, 0, 0], norm_by_std=False)[0].squeeze(-1)
        tensor([0.5000, 0.0000, 0.0000], dtype=torch.float64)
    """
    if any(len(rows) < 2 for rows in _groups(index).values()):
        raise ValueError("index: grpo_passk needs at least 2 rows per group")

    def rule(s: list[float], _: list[int]) -> list[float]:
        out = [0.0] * len(s)
        ranked = sorted(range(len(s)), key=lambda i: s[i], reverse=True)
        if len(s) < 2 or s[ranked[0]] == s[ranked[1]]:
            return out
        margin = s[ranked[0]] - s[ranked[1]]
        out[ranked[0]] = margin / (_std(s) + epsilon) if norm_by_std else margin
        return out

    return _group_oracle(rewards, response_mask, index, rule)


def _registry_adapter(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def call(**kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        x = AdvantageInputs(**kwargs)  # type: ignore[arg-type]
        r, m = x.token_level_rewards, x.response_mask
        if name == "gae":
            return gae_oracle(r, x.require("values", name), m, x.gamma, x.lam, x.whiten)
        if name == "reinforce_plus_plus":
            return reinforce_pp_oracle(r, m, x.gamma)
        if name == "remax":
            return remax_oracle(r, x.require("reward_baselines", name), m)
        index = x.require("index", name)
        if name in ("grpo", "grpo_passk"):
            fn = grpo_oracle if name == "grpo" else grpo_passk_oracle
            return fn(r, m, index, x.norm_by_std, x.epsilon)
        if name == "gpg":
            return gpg_oracle(r, m, index, x.f_norm, x.alpha)
        simple = {
            "rloo": rloo_oracle,
            "opo": opo_oracle,
            "reinforce_plus_plus_baseline": reinforce_pp_baseline_oracle,
        }
        return simple[name](r, m, index)

    call.__name__ = f"{name}_oracle_registry"
    return call


ADVANTAGE_ORACLES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    name: _registry_adapter(name)
    for name in (
        "gae",
        "gpg",
        "grpo",
        "grpo_passk",
        "opo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
    )
}
"""Registry name -> oracle taking the same keyword arguments as :func:`ppo_core.advantages.get_advantage_estimator`."""


def advantage_inputs_from_batch(batch: PPOBatch, **options: object) -> dict[str, object]:
    """Registry keyword arguments for a :class:`~ppo_core.testing.strategies.PPOBatch` plus ``options``.

    Example:
        >>> from ppo_core.advantages import get_advantage_estimator
        >>> def check(batch, name="grpo"):  # inside a hypothesis test drawing ppo_batches()
        ...     kwargs = advantage_inputs_from_batch(batch, norm_by_std=False)
        ...     fast, _ = get_advantage_estimator(name)(**kwargs)
        ...     slow, _ = ADVANTAGE_ORACLES[name](**kwargs)
        ...     torch.testing.assert_close(fast.double(), slow, atol=1e-4, rtol=1e-4)
    """
    kwargs: dict[str, object] = {
        "token_level_rewards": batch.token_level_rewards,
        "response_mask": batch.response_mask,
        "index": batch.index,
        "values": batch.values,
        "reward_baselines": batch.reward_baselines,
    }
    kwargs.update(options)
    return kwargs
