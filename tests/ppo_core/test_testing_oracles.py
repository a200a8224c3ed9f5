"""``ppo_core.testing`` as its users meet it: oracle metric keys, the README recipe, docstring examples, short reprs."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest
import torch
from hypothesis import given, settings

import ppo_core.testing
from ppo_core.advantages import compute_gae
from ppo_core.losses import PolicyLossConfig, compute_policy_loss, compute_value_loss, policy_loss_names
from ppo_core.testing import loss_oracles as oracles
from ppo_core.testing import policy_loss_inputs, ppo_batches
from ppo_core.testing.loss_oracles import PolicyLossInputs

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
_CLIP = ("clip_ratio_low", "clip_ratio_high")
# loss name -> (oracle, its PolicyLossConfig keywords)
ORACLES = {
    "vanilla": (oracles.vanilla_policy_loss_oracle, (*_CLIP, "clip_ratio_c")),
    "gpg": (oracles.gpg_policy_loss_oracle, ()),
    "sapo": (oracles.sapo_policy_loss_oracle, ("tau_pos", "tau_neg")),
    "cispo": (oracles.cispo_policy_loss_oracle, _CLIP),
    "dppo_tv": (oracles.dppo_tv_policy_loss_oracle, (*_CLIP, "clip_ratio_c")),
    "dppo_kl": (oracles.dppo_kl_policy_loss_oracle, (*_CLIP, "clip_ratio_c")),
    "gspo": (oracles.gspo_policy_loss_oracle, _CLIP),
    "geo_mean": (oracles.geo_mean_policy_loss_oracle, _CLIP),
    "clip_cov": (
        oracles.clip_cov_policy_loss_oracle,
        (*_CLIP, "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    ),
    "kl_cov": (oracles.kl_cov_policy_loss_oracle, ("kl_cov_ratio", "ppo_kl_coef")),
    "dro": (oracles.dro_policy_loss_oracle, ("dro_beta",)),
}


def test_every_registered_loss_has_an_oracle():
    assert set(ORACLES) == set(policy_loss_names())


def _both(name: str, inputs: PolicyLossInputs):
    config = PolicyLossConfig(loss_mode=name, dro_beta=0.1 if name == "dro" else None)
    args = (inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask)
    seed = torch.Generator().manual_seed(0)
    _, metrics = compute_policy_loss(
        *args, config=config, rollout_is_weights=inputs.rollout_is_weights, generator=seed
    )
    fn, keys = ORACLES[name]
    extra = {
        k: getattr(config, {"clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high"}.get(k, k))
        for k in keys
    }
    if name == "clip_cov":
        extra["generator"] = torch.Generator().manual_seed(0)
    _, expected = fn(*args, rollout_is_weights=inputs.rollout_is_weights, **extra)
    return metrics, expected


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_oracles_return_the_functions_metric_keys_even_when_everything_is_masked(name):
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.3]], dtype=torch.float64))
    for mask in (torch.ones(2, 3), torch.zeros(2, 3)):
        metrics, expected = _both(
            name, PolicyLossInputs(lp, lp - 0.1, torch.ones(2, 3, dtype=torch.float64), mask)
        )
        assert set(expected) == set(metrics), (mask.sum().item(), sorted(expected), sorted(metrics))
        if not mask.any():
            assert all(v == 0.0 for v in expected.values())


@pytest.mark.parametrize("name", sorted(ORACLES))
@settings(max_examples=15)
@given(inputs=policy_loss_inputs())
def test_oracle_keys_match_on_drawn_inputs(name, inputs):
    metrics, expected = _both(name, inputs)
    assert set(expected) == set(metrics)


def test_value_oracle_returns_a_clip_fraction_for_an_all_masked_batch():
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    loss, clipfrac = oracles.value_loss_oracle(zeros, zeros, zeros, zeros)
    assert (loss, clipfrac) == (0.0, 0.0)
    assert compute_value_loss(zeros, zeros, zeros, zeros)[1].item() == clipfrac


def _readme_testing_block() -> str:
    text = README.read_text()
    section = text[text.index("## Test your own code with our strategies") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_readme_recipe(my_gae, my_ppo_loss) -> None:
    namespace = {"my_gae": my_gae, "my_ppo_loss": my_ppo_loss}
    # a pseudo file name: hypothesis reads the source of a test from its file, and README.md is not Python
    exec(compile(_readme_testing_block(), "<README.md testing recipe>", "exec"), namespace)
    tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
    assert len(tests) == 2
    for test in tests:
        settings(max_examples=15)(test)()


def _correct_gae(rewards, values, mask, gamma, lam):
    return compute_gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)


def _correct_ppo_loss(old, new, adv, mask, weights):
    return compute_policy_loss(old, new, adv, mask, config=PolicyLossConfig(), rollout_is_weights=weights)[0]


def test_readme_recipe_passes_for_correct_implementations():
    """It used to compare an unwhitened GAE with the oracle's default (whitened) output: a correct GAE failed."""
    block = _readme_testing_block()
    assert "policy_loss_inputs" in block and "whiten=False" in block
    _run_readme_recipe(_correct_gae, _correct_ppo_loss)


def test_readme_recipe_catches_wrong_implementations():
    def whitened_gae(rewards, values, mask, gamma, lam):
        return compute_gae(rewards, values, mask, gamma=gamma, lam=lam, whiten=True)

    def unclipped_loss(old, new, adv, mask, weights):
        config = PolicyLossConfig(clip_ratio_low=0.999, clip_ratio_high=10.0, clip_ratio_c=100.0)
        return compute_policy_loss(old, new, adv, mask, config=config, rollout_is_weights=weights)[0]

    with pytest.raises(AssertionError):
        _run_readme_recipe(whitened_gae, _correct_ppo_loss)
    with pytest.raises(AssertionError):
        _run_readme_recipe(_correct_gae, unclipped_loss)


def _literal_blocks(doc: str) -> list[str]:
    """The reStructuredText literal blocks (after a line ending in ``::``) of a docstring."""
    blocks, lines = [], doc.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            body = []
            for follow in lines[i + 1 :]:
                if follow.strip() and not follow.startswith((" ", "\t")):
                    break
                body.append(follow)
            blocks.append(inspect.cleandoc("\n".join(body)))
    return blocks


def _testing_modules() -> list:
    names = [m.name for m in pkgutil.iter_modules(ppo_core.testing.__path__, "ppo_core.testing.")]
    return [ppo_core.testing, *(importlib.import_module(n) for n in names)]


@pytest.mark.parametrize("module", _testing_modules(), ids=lambda m: m.__name__)
def test_code_examples_in_the_testing_docstrings_are_valid_python(module):
    docs = [module.__doc__ or ""]
    docs += [
        obj.__doc__ or ""
        for _, obj in inspect.getmembers(module)
        if inspect.isfunction(obj) or inspect.isclass(obj)
    ]
    for doc in docs:
        for block in _literal_blocks(inspect.cleandoc(doc)):
            ast.parse(block)  # a SyntaxError fails the test with the offending line


def test_the_literal_block_check_can_fail():
    with pytest.raises(SyntaxError):
        ast.parse(_literal_blocks("Example::\n\n    f(x, y: float = 0.2)\n")[0])


@settings(max_examples=30)
@given(batch=ppo_batches(max_batch=12, max_len=64), inputs=policy_loss_inputs(max_batch=8, max_len=64))
def test_batches_print_as_one_short_line(batch, inputs):
    for text in (repr(batch), repr(inputs)):
        assert "\n" not in text and len(text) < 400, text
    assert f"B={batch.batch_size}, T={batch.seq_len}" in repr(batch)


def test_a_failing_property_reports_the_batch_in_a_few_lines():
    @settings(max_examples=5, database=None)
    @given(ppo_batches(max_batch=12, max_len=16))
    def always_fails(b):
        raise AssertionError("boom")

    with pytest.raises(AssertionError) as info:
        always_fails()
    report = "\n".join(getattr(info.value, "__notes__", []))
    assert "PPOBatch(B=" in report
    assert len(report.splitlines()) <= 5, report


def test_ppo_batches_draw_empty_batches_and_empty_responses_when_asked():
    """``min_batch=0`` and ``min_len=0`` reach ``B = 0`` and ``T = 0`` (the library handles both; a user's property
    test should meet them), and every drawn batch stays in the bounds asked for."""
    seen = {"B=0": 0, "T=0": 0}

    @settings(max_examples=200, deadline=None, database=None)
    @given(ppo_batches(min_batch=0, max_batch=3, min_len=0, max_len=2))
    def draw(batch):
        assert 0 <= batch.batch_size <= 3 and 0 <= batch.seq_len <= 2
        assert sum(batch.group_sizes) == batch.batch_size
        seen["B=0"] += batch.batch_size == 0
        seen["T=0"] += batch.seq_len == 0
        compute_gae(batch.token_level_rewards, batch.values, batch.response_mask, gamma=1.0, lam=1.0)

    draw()
    assert seen["B=0"] > 0 and seen["T=0"] > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_batch": 5, "max_batch": 3}, "min_batch=5, max_batch=3"),
        ({"min_len": -1}, "min_len=-1"),
        ({"max_group_size": 0}, "max_group_size must be >= 1"),
    ],
)
def test_ppo_batches_refuse_bounds_they_cannot_keep(kwargs, message):
    @settings(max_examples=1, deadline=None, database=None)
    @given(ppo_batches(**kwargs))
    def draw(batch):
        pass

    with pytest.raises(ValueError, match=re.escape(message)):
        draw()
