"""``MegatronEngine`` on one CPU rank, forward-only (megatron's DDP and optimizer need CUDA: the trained engine is
tested in ``test_megatron_gpu.py``): per-token outputs at the response positions against the full-vocabulary
logits, the value head, and sampling through the last-position view of the policy."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytest.importorskip("megatron.core")

from _megatron import tiny_config

from ppo_core.keys import KEYS
from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.rollout import ModelRolloutEngine, SamplingConfig
from ppo_core.workers import ForwardEngine
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES, OutputSpec

VOCAB, P, R = 70, 3, 4


def _batch(rows: int = 5) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (rows, P + R), generator=g)
    mask = torch.ones(rows, P + R, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[3, :1] = 0
    return TensorDict(
        {KEYS.input_ids: ids * mask, KEYS.attention_mask: mask, KEYS.responses: ids[:, P:]}, batch_size=[rows]
    )


def _engine(head: str):
    from ppo_core.workers.megatron import MegatronEngine, ParallelConfig, build_gpt_model, megatron_layout

    model = build_gpt_model(tiny_config(), ParallelConfig(), value_head=head == "value")
    layout = megatron_layout(0, 1, ParallelConfig())
    return MegatronEngine(model, layout=layout, device=torch.device("cpu"), head=head, vocab_size=VOCAB)


def _full_output(engine, batch: TensorDict) -> torch.Tensor:
    from ppo_core.workers.megatron.engine import megatron_attention_mask, position_ids

    mask = batch[KEYS.attention_mask]
    with torch.no_grad():
        return engine.module(batch[KEYS.input_ids], position_ids(mask), megatron_attention_mask(mask))


def test_frozen_policy_engine_scores_responses_like_the_full_vocabulary(cpu_megatron) -> None:
    engine = _engine("policy")
    assert isinstance(engine, ForwardEngine) and not engine.module.training
    batch = _batch()
    outs = engine.forward([batch[:2], batch[2:]], OutputSpec(temperature=0.7, entropy=True))
    got = {k: torch.cat([o[k] for o in outs]) for k in (LOG_PROBS, ENTROPY)}
    logits = _full_output(engine, batch)[:, P - 1 : -1, :VOCAB] / 0.7
    torch.testing.assert_close(got[LOG_PROBS], logprobs_from_logits(logits, batch[KEYS.responses]))
    torch.testing.assert_close(got[ENTROPY], entropy_from_logits(logits))
    (plain,) = engine.forward([batch], OutputSpec())
    assert set(plain) == {LOG_PROBS}
    with pytest.raises(ValueError, match="forward-only"):
        _ = engine.lr


def test_frozen_value_engine_reads_the_value_before_each_token(cpu_megatron) -> None:
    engine = _engine("value")
    batch = _batch()
    (out,) = engine.forward([batch], OutputSpec())
    torch.testing.assert_close(out[VALUES], _full_output(engine, batch)[:, P - 1 : -1, 0].float())


def test_sampling_through_the_last_logits_view(cpu_megatron) -> None:
    from ppo_core.workers.megatron.workers import _LastLogitsView

    engine = _engine("policy")
    view = _LastLogitsView(engine.module, engine.layout, VOCAB)
    batch = _batch(4)
    prompt_ids, prompt_mask = batch[KEYS.input_ids][:, :P], batch[KEYS.attention_mask][:, :P]
    cfg = SamplingConfig(max_new_tokens=R, temperature=0)
    out = ModelRolloutEngine(view).generate(prompt_ids, prompt_mask, cfg, generator=None)
    assert out[KEYS.responses].shape == (4, R)
    (scored,) = engine.forward(
        [out.select(KEYS.input_ids, KEYS.attention_mask, KEYS.responses)], OutputSpec()
    )
    torch.testing.assert_close(out[KEYS.rollout_log_probs], scored[LOG_PROBS], rtol=1e-5, atol=1e-5)
    # greedy: every sampled token is the argmax of the full-vocabulary logits at its position
    logits = _full_output(engine, out)[:, P - 1 : -1, :VOCAB]
    assert torch.equal(out[KEYS.responses], logits.argmax(-1))


@pytest.mark.parametrize("std", [0.0, 0.02])
def test_value_head_initialisation_is_the_torch_critics(cpu_megatron, std) -> None:
    """``value_head_init_std`` > 0 draws the torch critic's head (same seed, same weight); 0 gives zeros."""
    from ppo_core.models.hf import CausalLMWithValueHead
    from ppo_core.workers.megatron import ParallelConfig, build_gpt_model

    cfg = tiny_config()
    model = build_gpt_model(
        cfg, ParallelConfig(), value_head=True, value_head_init_std=std, value_head_seed=3
    )
    torch_head = CausalLMWithValueHead(
        torch.nn.Module(), cfg.hidden_size, head_init_std=std, seed=3
    ).value_head
    torch.testing.assert_close(model.output_layer.linear.weight, torch_head.weight, rtol=0, atol=0)
    assert torch.count_nonzero(model.output_layer.linear.bias) == 0
    assert (torch.count_nonzero(model.output_layer.linear.weight) > 0) == (std > 0)
