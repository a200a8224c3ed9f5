"""The advantage-estimator registry, its calling convention, and input validation errors that name the argument."""

from __future__ import annotations

import enum
import re

import pytest
import torch

from ppo_core.advantages import (
    AdvantageInputs,
    advantage_estimator_names,
    compute_gae,
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    get_advantage_estimator,
    register_advantage_estimator,
)
from ppo_core.advantages import registry as registry_module

VERL_NAMES = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
)
R = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.25]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
V = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
B = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
IDX = ["a", "a", "b", "b"]
FULL = {
    "token_level_rewards": R,
    "response_mask": M,
    "index": IDX,
    "values": V,
    "reward_baselines": B,
    "gamma": 0.9,
    "lam": 0.7,
    "whiten": True,
    "norm_by_std": False,
    "epsilon": 1e-3,
    "f_norm": 2.0,
    "alpha": 3.0,
}
DIRECT = {
    "gae": lambda: compute_gae(R, V, M, gamma=0.9, lam=0.7, whiten=True),
    "grpo": lambda: compute_grpo_advantage(R, M, IDX, norm_by_std=False, epsilon=1e-3),
    "grpo_passk": lambda: compute_grpo_passk_advantage(R, M, IDX, norm_by_std=False, epsilon=1e-3),
    "rloo": lambda: compute_rloo_advantage(R, M, IDX),
    "reinforce_plus_plus_baseline": lambda: compute_reinforce_pp_baseline_advantage(R, M, IDX),
    "opo": lambda: compute_opo_advantage(R, M, IDX),
    "gpg": lambda: compute_gpg_advantage(R, M, IDX, f_norm=2.0, alpha=3.0),
    "reinforce_plus_plus": lambda: compute_reinforce_pp_advantage(R, M, gamma=0.9),
    "remax": lambda: compute_remax_advantage(R, B, M),
}
NEEDS = {
    "gae": "values",
    "remax": "reward_baselines",
    **{n: "index" for n in ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg")},
}


@pytest.fixture
def clean_registry():
    """Restore the global registry after a test that registers names."""
    saved = dict(registry_module._REGISTRY)
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(saved)


def test_every_verl_name_is_registered() -> None:
    assert set(VERL_NAMES) <= set(advantage_estimator_names())
    assert list(advantage_estimator_names()) == sorted(advantage_estimator_names())


@pytest.mark.parametrize("name", VERL_NAMES)
def test_one_calling_convention_matches_the_direct_function(name: str) -> None:
    fn = get_advantage_estimator(name)
    assert get_advantage_estimator(name) is fn
    adv, ret = fn(**FULL)  # every estimator accepts every field and ignores what it does not use
    want_adv, want_ret = DIRECT[name]()
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)


@pytest.mark.parametrize("name", VERL_NAMES)
def test_missing_input_and_unknown_keyword_are_errors(name: str) -> None:
    fn = get_advantage_estimator(name)
    needed = NEEDS.get(name)  # reinforce_plus_plus needs only rewards and mask
    if needed is not None:
        with pytest.raises(ValueError, match=f"{needed} is required by the '{name}' advantage estimator"):
            fn(**{**FULL, needed: None})
    with pytest.raises(TypeError, match="lamda"):
        fn(**FULL, lamda=0.9)
    with pytest.raises(TypeError, match="token_level_rewards"):
        fn(**{k: v for k, v in FULL.items() if k != "token_level_rewards"})


def test_unknown_name_lists_valid_names() -> None:
    for bad in ("gea", "GAE", ""):
        error = TypeError if bad == "" else ValueError
        with pytest.raises(error) as info:
            get_advantage_estimator(bad)
        if error is ValueError:
            for name in VERL_NAMES:
                assert name in str(info.value)
            assert repr(bad) in str(info.value)


def test_register_semantics(clean_registry: None) -> None:
    def first(**kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        x = AdvantageInputs(**kwargs)  # type: ignore[arg-type]
        zeros = torch.zeros_like(x.token_level_rewards)
        return zeros, zeros.clone()

    def second(**kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        return first(**kwargs)

    assert register_advantage_estimator("test_custom")(first) is first
    assert register_advantage_estimator("test_custom")(first) is first  # same function twice: fine
    with pytest.raises(ValueError, match="'test_custom' is already registered"):
        register_advantage_estimator("test_custom")(second)
    with pytest.raises(ValueError, match="'gae' is already registered"):
        register_advantage_estimator("gae")(second)
    assert get_advantage_estimator("test_custom") is first
    adv, _ = get_advantage_estimator("test_custom")(**FULL)
    assert torch.equal(adv, torch.zeros_like(R))

    class Kind(str, enum.Enum):
        CUSTOM = "test_enum_custom"

    register_advantage_estimator(Kind.CUSTOM)(second)
    assert get_advantage_estimator("test_enum_custom") is second
    assert get_advantage_estimator(Kind.CUSTOM) is second
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        register_advantage_estimator(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be callable"):
        register_advantage_estimator("test_not_callable")(42)  # type: ignore[arg-type]


# ---- validation errors name the argument ------------------------------------------------------------------------

ALL_CALLS = {
    "gae": lambda r, m, **kw: compute_gae(r, kw.get("values", torch.zeros_like(r)), m),
    "grpo": lambda r, m, **kw: compute_grpo_advantage(r, m, kw.get("index", [0] * r.shape[0])),
    "grpo_passk": lambda r, m, **kw: compute_grpo_passk_advantage(r, m, kw.get("index", [0] * r.shape[0])),
    "rloo": lambda r, m, **kw: compute_rloo_advantage(r, m, kw.get("index", [0] * r.shape[0])),
    "reinforce_plus_plus_baseline": lambda r, m, **kw: compute_reinforce_pp_baseline_advantage(
        r, m, kw.get("index", [0] * r.shape[0])
    ),
    "opo": lambda r, m, **kw: compute_opo_advantage(r, m, kw.get("index", [0] * r.shape[0])),
    "gpg": lambda r, m, **kw: compute_gpg_advantage(r, m, kw.get("index", [0] * r.shape[0])),
    "reinforce_plus_plus": lambda r, m, **kw: compute_reinforce_pp_advantage(r, m),
    "remax": lambda r, m, **kw: compute_remax_advantage(r, torch.zeros(r.shape[0], dtype=r.dtype), m),
}
GROUP_NAMES = [n for n, need in NEEDS.items() if need == "index"]


@pytest.mark.parametrize("name", VERL_NAMES)
def test_shape_dtype_and_nan_errors_name_the_argument(name: str) -> None:
    call = ALL_CALLS[name]
    r, m = R.clone(), M.clone()
    with pytest.raises(ValueError, match=r"response_mask has shape \(4, 2\).*token_level_rewards"):
        call(r, m[:, :2])
    with pytest.raises(TypeError, match=re.escape("rewards (token_level_rewards) must be a floating-point")):
        call(r.long(), m)
    with pytest.raises(ValueError, match=re.escape("rewards (token_level_rewards) must have 2 dimensions")):
        call(r[0], m[0])
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        call(r, m.long() * 2)
    with pytest.raises(TypeError, match=re.escape("response_mask must be a torch.Tensor")):
        call(r, m.tolist())
    nan = r.clone()
    nan[0, 1] = float("nan")  # a valid position: every estimator rejects it
    with pytest.raises(ValueError, match=re.escape("token_level_rewards) contains NaN")):
        call(nan, m)
    inf = r.clone()
    inf[1, 0] = float("-inf")
    with pytest.raises(ValueError, match=re.escape("token_level_rewards) contains inf")):
        call(inf, m)


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_index_errors_name_index(name: str) -> None:
    call = ALL_CALLS[name]
    with pytest.raises(ValueError, match="index has 3 labels but the batch has 4 rows"):
        call(R, M, index=["a", "a", "b"])
    with pytest.raises(TypeError, match="index must be an integer tensor"):
        call(R, M, index=torch.tensor([0.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="index must be 1-D"):
        call(R, M, index=torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="index labels must be hashable"):
        call(R, M, index=[["a"], ["a"], ["b"], ["b"]])


def test_estimator_specific_errors() -> None:
    with pytest.raises(ValueError, match=r"values has shape \(4, 2\)"):
        compute_gae(R, V[:, :2], M)
    with pytest.raises(TypeError, match="values must be a floating-point tensor"):
        compute_gae(R, V.long(), M)
    bad_v = V.clone()
    bad_v[0, 0] = float("nan")
    with pytest.raises(ValueError, match="values contains NaN"):
        compute_gae(R, bad_v, M)
    bad_v[0, 2] = float("nan")  # masked position only: ignored
    bad_v[0, 0] = 0.0
    assert torch.isfinite(compute_gae(R, bad_v, M)[0]).all()
    for name, value in (("gamma", 1.5), ("lam", -0.1), ("gamma", float("nan"))):
        with pytest.raises(ValueError, match=f"{name} must be a finite number in"):
            compute_gae(R, V, M, **{name: value})
    with pytest.raises(ValueError, match="gamma must be"):
        compute_reinforce_pp_advantage(R, M, gamma=2.0)
    with pytest.raises(ValueError, match="epsilon must be"):
        compute_grpo_advantage(R, M, IDX, epsilon=-1.0)
    with pytest.raises(ValueError, match="f_norm must be > 0"):
        compute_gpg_advantage(R, M, IDX, f_norm=0.0)
    with pytest.raises(ValueError, match="alpha must be"):
        compute_gpg_advantage(R, M, IDX, alpha=-1.0)
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(3,\)"):
        compute_remax_advantage(R, B[:3], M)
    with pytest.raises(ValueError, match="reward_baselines must have 1 dimensions"):
        compute_remax_advantage(R, B[:, None], M)
    with pytest.raises(ValueError, match="reward_baselines contains NaN"):
        compute_remax_advantage(R, torch.tensor([float("nan"), 0, 0, 0], dtype=torch.float64), M)
    # grpo_passk needs n >= 2 per group, as verl
    with pytest.raises(ValueError, match="index: grpo_passk needs at least 2 rows per group"):
        compute_grpo_passk_advantage(R, M, ["a", "a", "b", "c"])
