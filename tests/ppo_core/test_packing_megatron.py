"""Padding-free micro-batches in ``MegatronEngine`` on CPU (fp32, gloo): packed == padded for the policy's log-probs
and entropies, the critic's values, the PPO loss and its gradients (one rank, and TP = 2 against one rank), and
megatron ``PackedSeqParams`` built elsewhere.

megatron's DDP and optimizer need CUDA, so the gradients here come from the engine's own forward pieces
(``_prepare`` -> ``_call`` -> ``_outputs``) on a frozen engine with autograd on; the trained engine is compared in
``test_packing_gpu.py``. Where a response token's predicting position is padding the packed path gives 0 and the
padded path something arbitrary: comparisons are over the positions that predict a valid token.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from _megatron import cpu_tensor_parallel, tiny_config
from _packing import mixed_batch, predicted

from ppo_core.keys import KEYS
from ppo_core.workers._common import global_loss_denominators
from ppo_core.workers.config import PPOActorConfig
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES, OutputSpec
from ppo_core.workers.ppo import actor_loss

VOCAB = 70
CPU = torch.device("cpu")


def _engine(model, head: str = "policy", remove_padding: bool = True, tp: int = 1):
    from ppo_core.workers.megatron import MegatronEngine, ParallelConfig, megatron_layout

    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    rank = torch.distributed.get_rank() if tp > 1 else 0
    layout = megatron_layout(rank, tp, parallel)
    return MegatronEngine(
        model, layout=layout, device=CPU, head=head, vocab_size=VOCAB, remove_padding=remove_padding
    )


def _model(head: str = "policy", **config):
    from ppo_core.workers.megatron import ParallelConfig, build_gpt_model

    model = build_gpt_model(tiny_config(**config), ParallelConfig(), value_head=head == "value")
    if head == "value":  # a fresh value head is zero: give it weights
        torch.nn.init.normal_(model.output_layer.linear.weight, std=0.5)
    return model


def _assert_same(packed: dict, padded: dict, where: torch.Tensor, tol: float = 1e-5) -> None:
    assert set(packed) == set(padded)
    for key in packed:
        torch.testing.assert_close(packed[key][where], padded[key][where], rtol=tol, atol=tol, msg=key)
        assert packed[key][~where].eq(0).all(), key


def test_policy_log_probs_and_entropies_packed_equal_padded(cpu_megatron) -> None:
    model = _model()
    packed, padded = _engine(model), _engine(model, remove_padding=False)
    assert packed.packed and not padded.packed
    batch = mixed_batch(vocab=VOCAB)
    micros = [batch[:3], batch[3:]]
    spec = OutputSpec(temperature=0.7, entropy=True)
    for a, b, m in zip(packed.forward(micros, spec), padded.forward(micros, spec), micros, strict=True):
        assert set(a) == {LOG_PROBS, ENTROPY}
        _assert_same(a, b, predicted(m))


def test_values_packed_equal_padded(cpu_megatron) -> None:
    model = _model("value")
    packed, padded = _engine(model, "value"), _engine(model, "value", remove_padding=False)
    batch = mixed_batch(vocab=VOCAB, seed=1)
    (a,), (b,) = packed.forward([batch], OutputSpec()), padded.forward([batch], OutputSpec())
    assert set(a) == {VALUES} and a[VALUES].abs().sum() > 0
    _assert_same(a, b, predicted(batch))


def _loss_and_grads(engine, batch, micros) -> tuple[float, dict[str, torch.Tensor], list[torch.Tensor]]:
    """The PPO actor loss of ``micros`` summed, its gradients (main_grad + grad) and the log-probs."""
    config = PPOActorConfig(entropy_coeff=0.01, ppo_mini_batch_size=int(batch.batch_size[0]))
    agg = global_loss_denominators(
        batch[KEYS.response_mask], dp_size=1, loss_scale_factor=None, all_reduce_sum=lambda x: x
    )
    module = engine.module
    for p in module.parameters():
        p.main_grad, p.grad = torch.zeros_like(p), None
    spec = OutputSpec(entropy=True)
    total, log_probs = 0.0, []
    with torch.enable_grad():
        for inputs in engine._prepare(micros):
            outputs = engine._outputs(inputs, engine._call(module, inputs), spec)
            loss, _ = actor_loss(inputs.micro, outputs, config=config, agg=agg, n_micro=len(micros))
            loss.backward()
            total += float(loss.detach())
            log_probs.append(outputs[LOG_PROBS].detach())
    grads = {n: p.main_grad + (0 if p.grad is None else p.grad) for n, p in module.named_parameters()}
    return total, grads, log_probs


def test_loss_and_gradients_packed_equal_padded(cpu_megatron) -> None:
    model = _model()
    batch = mixed_batch(rows=6, vocab=VOCAB, seed=2)
    micros = [batch[:2], batch[2:]]
    loss_a, grads_a, _ = _loss_and_grads(_engine(model), batch, micros)
    loss_b, grads_b, _ = _loss_and_grads(_engine(model, remove_padding=False), batch, micros)
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert any(g.abs().sum() > 0 for g in grads_b.values())
    for name, g in grads_b.items():
        torch.testing.assert_close(grads_a[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_micro_batches_in_any_split_give_the_same_gradient(cpu_megatron) -> None:
    """Global denominators: the gradient of a mini-batch is the same however it is cut into packed micro-batches."""
    from ppo_core.workers._common import split_micro_batches

    model = _model()
    engine = _engine(model)
    batch = mixed_batch(rows=6, vocab=VOCAB, seed=3)
    loss_a, grads_a, _ = _loss_and_grads(engine, batch, [batch])
    micros, _ = split_micro_batches(batch, rows=None, max_tokens=20)
    assert len(micros) > 1
    loss_b, grads_b, _ = _loss_and_grads(engine, batch, micros)
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_seq_params_built_elsewhere_give_the_same_output(cpu_megatron) -> None:
    """megatron ``PackedSeqParams`` without our documents: the attention rebuilds them from ``cu_seqlens``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ppo_core.workers.megatron.model import packed_documents

    model = _model().eval()
    engine = _engine(model)
    (inputs,) = engine._prepare([mixed_batch(rows=3, vocab=VOCAB, seed=4)])
    docs = inputs.params.documents
    plain = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=docs.cu_seqlens,
        cu_seqlens_kv=docs.cu_seqlens,
        max_seqlen_q=docs.max_seqlen,
        max_seqlen_kv=docs.max_seqlen,
    )
    with torch.no_grad():
        ours = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.params)
        theirs = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=plain)
    torch.testing.assert_close(ours, theirs)
    assert packed_documents(plain).seqlens == docs.seqlens
    with pytest.raises(ValueError, match="'thd'"):
        packed_documents(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=docs.cu_seqlens))


def test_logits_window_takes_an_index_tensor_or_a_range(cpu_megatron) -> None:
    from ppo_core.workers.megatron.model import logits_window

    model = _model().eval()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(6)[None]
    index = torch.tensor([4, 0, 2])
    with torch.no_grad():
        full = model(ids, pos, None)
        with logits_window(model, index) as window:
            part = model(ids, pos, None)
    assert window.active
    torch.testing.assert_close(part, full[:, index])
    with pytest.raises(ValueError, match="index tensor alone"):
        logits_window(model, index, 3)
    with pytest.raises(ValueError, match="needs stop"):
        logits_window(model, 1)


def test_remove_padding_off_keeps_the_padded_path(cpu_megatron) -> None:
    model = _model()
    engine = _engine(model, remove_padding=False)
    (inputs,) = engine._prepare([mixed_batch(rows=2, vocab=VOCAB)])
    assert inputs.packed is None and inputs.attention_mask is not None


# ----- TP = 2 over gloo ---------------------------------------------------------------------------------------
def _tp_rank_main(rank: int, world: int, port: int, hf: dict | None, remove_padding: bool, out: dict) -> None:
    """One TP rank: loss, log-probs and gradients (Hugging Face names) of the packed or padded engine."""
    from ppo_core.workers.megatron import build_gpt_model
    from ppo_core.workers.megatron.hf_loading import hf_to_megatron, megatron_to_hf

    with cpu_tensor_parallel(rank, world, port) as parallel:
        cfg = tiny_config()
        model = build_gpt_model(cfg, parallel)
        if hf is not None:
            model.load_state_dict(hf_to_megatron(hf, cfg, tp_rank=rank, tp_size=world), strict=False)
        engine = _engine(model, remove_padding=remove_padding, tp=world)
        batch = mixed_batch(rows=5, vocab=VOCAB, seed=6)
        loss, grads, log_probs = _loss_and_grads(engine, batch, [batch[:2], batch[2:]])
        weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        out[rank] = (
            loss,
            megatron_to_hf([grads], cfg) if world == 1 else grads,
            torch.cat(log_probs),
            megatron_to_hf([weights], cfg) if hf is None else None,
        )


@pytest.mark.slow
def test_tensor_parallel_packed_equals_one_rank_padded(rank_pool) -> None:
    """TP = 2, packed: vocab-parallel log-probs at the packed output positions, the loss, and the gradient shards
    put together equal one padded rank's."""
    from ppo_core.workers.megatron.hf_loading import megatron_to_hf

    ref_loss, ref_grads, ref_lp, hf = rank_pool.run(_tp_rank_main, 1, None, False)[0]
    results = rank_pool.run(_tp_rank_main, 2, hf, True)  # packed
    where = predicted(mixed_batch(rows=5, vocab=VOCAB, seed=6))
    for rank in range(2):
        loss, _, log_probs, _ = results[rank]
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        torch.testing.assert_close(log_probs[where], ref_lp[where], rtol=1e-5, atol=1e-5)
    got = megatron_to_hf([results[r][1] for r in range(2)], tiny_config())
    assert set(got) == set(ref_grads)
    for name, value in ref_grads.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
