"""Loss arguments a user gets wrong: a dict or a trainer's actor config as ``config``, tensors on other devices."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields

import pytest
import torch

from ppo_core.losses import (
    PolicyLossConfig,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss,
    policy_loss_names,
)


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 3, generator=gen)
    return (
        old,
        old + 0.3 * torch.randn(2, 3, generator=gen),
        torch.randn(2, 3, generator=gen),
        torch.ones(2, 3),
    )


@dataclass
class ActorConfig(Mapping):
    """Stands in for a trainer's actor config that reads like a mapping (verl's configs are Mappings)."""

    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    ppo_mini_batch_size: int = 256
    policy_loss: dict = field(default_factory=lambda: {"loss_mode": "vanilla"})

    def __getitem__(self, key: str) -> object:
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(f.name for f in fields(self))

    def __len__(self) -> int:
        return len(fields(self))


def test_compute_policy_loss_accepts_a_dict_of_policy_loss_config_fields():
    cfg = {"loss_mode": "vanilla", "clip_ratio": 0.1, "clip_ratio_high": 0.28}
    got, got_metrics = compute_policy_loss(*_inputs(), config=cfg)
    expected, expected_metrics = compute_policy_loss(*_inputs(), config=PolicyLossConfig(**cfg))
    assert torch.equal(got, expected)
    assert got_metrics.keys() == expected_metrics.keys()
    # the registered losses read it the same way
    assert torch.equal(get_policy_loss("vanilla")(*_inputs(), config=cfg)[0], expected)


def test_the_dict_selects_the_loss_and_bad_values_name_the_field():
    gspo, _ = compute_policy_loss(*_inputs(), config={"loss_mode": "gspo"})
    assert torch.equal(gspo, get_policy_loss("gspo")(*_inputs())[0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(*_inputs(), config={"clip_ratio_c": 0.5})


@pytest.mark.parametrize("name", policy_loss_names())
def test_an_actor_config_raises_a_type_error_that_says_what_to_pass(name):
    fn = get_policy_loss(name)
    for call in (lambda c: compute_policy_loss(*_inputs(), config=c), lambda c: fn(*_inputs(), config=c)):
        with pytest.raises(TypeError) as info:
            call(ActorConfig())
        message = str(info.value)
        assert "config must be a ppo_core PolicyLossConfig" in message
        assert "ppo_mini_batch_size" in message and "policy_loss" in message  # the keys it cannot read
        assert "PolicyLossConfig(loss_mode=" in message  # what to pass instead
        assert "clip_ratio_high" in message


@pytest.mark.parametrize("bad", [0.2, "vanilla", ["clip_ratio"], object()])
def test_other_objects_raise_type_error_naming_config(bad):
    with pytest.raises(TypeError, match=r"^config must be a ppo_core PolicyLossConfig.*got"):
        compute_policy_loss(*_inputs(), config=bad)


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("arg", [0, 1, 2, 3, 4])
def test_policy_losses_check_devices_and_name_both_arguments(name, arg):
    tensors = [*_inputs(), torch.ones(2, 3)]
    names = ["old_log_prob", "log_prob", "advantages", "response_mask", "rollout_is_weights"]
    tensors[arg] = tensors[arg].to("meta")
    config = PolicyLossConfig(loss_mode=name, dro_beta=0.1 if name == "dro" else None)
    with pytest.raises(ValueError, match="they must match") as info:
        compute_policy_loss(*tensors[:4], config=config, rollout_is_weights=tensors[4],
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert f"{names[arg]} is on meta" in str(info.value) and "is on cpu" in str(info.value)


@pytest.mark.parametrize("arg", [0, 1, 2, 3])
def test_value_loss_checks_devices(arg):
    tensors = [torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)]
    names = ["vpreds", "returns", "values", "response_mask"]
    tensors[arg] = tensors[arg].to("meta")
    with pytest.raises(
        ValueError, match=rf"(^{names[arg]} is on meta|is on cpu but {names[arg]} is on meta)"
    ):
        compute_value_loss(*tensors)


def test_agg_loss_and_entropy_loss_check_devices():
    with pytest.raises(ValueError, match="loss_mask is on meta but loss_mat is on cpu"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 3, device="meta"))
    with pytest.raises(ValueError, match="response_mask is on meta but logits is on cpu"):
        compute_entropy_loss(torch.zeros(2, 3, 4), torch.ones(2, 3, device="meta"))
