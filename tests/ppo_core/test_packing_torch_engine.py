"""Padding-free micro-batches in ``TorchEngine``: packed == padded for tiny Hugging Face Llama / Qwen2 models and a
TinyGPT-style model that takes packed documents (fp32, CPU): log-probs, entropies, values, losses, gradients; a
plain ``TinyGPT`` keeps the padded path; token-budget micro-batches with packing leave the summed gradient unchanged.

Where a response token's predicting position is padding (after a short response), the padded path computes
something arbitrary and the packed path 0; the comparisons are over the positions that predict a valid token.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from tensordict import TensorDict

pytest.importorskip("transformers")

from _hf import make_checkpoint
from _packing import mixed_batch, predicted
from _tiny_lm import CFG, LM

from ppo_core.keys import KEYS
from ppo_core.models import TinyGPT
from ppo_core.models.hf import load_causal_lm, load_value_model
from ppo_core.workers._common import global_loss_denominators
from ppo_core.workers.config import PPOActorConfig
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES, OutputSpec
from ppo_core.workers.ppo import actor_loss
from ppo_core.workers.torch import OptimConfig, TorchActorWorker, TorchEngine

CPU = torch.device("cpu")
VOCAB = 96


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_packing")
    return {arch: make_checkpoint(root / arch, arch, vocab_size=VOCAB) for arch in ("llama", "qwen2")}


def _pair(module: torch.nn.Module, head: str = "policy") -> tuple[TorchEngine, TorchEngine]:
    optim = OptimConfig(lr=1e-3)
    packed = TorchEngine(module, device=CPU, head=head, optim=optim, remove_padding=True)
    padded = TorchEngine(copy.deepcopy(module), device=CPU, head=head, optim=optim, remove_padding=False)
    assert packed.packed and not padded.packed
    return packed, padded


def _assert_same_outputs(packed: dict, padded: dict, where: torch.Tensor) -> None:
    assert set(packed) == set(padded)
    for key in packed:
        assert packed[key].shape == padded[key].shape
        torch.testing.assert_close(packed[key][where], padded[key][where], rtol=1e-5, atol=1e-5, msg=key)
        assert packed[key][~where].eq(0).all(), key


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_policy_log_probs_and_entropies_packed_equal_padded(ckpts: dict, arch: str) -> None:
    packed, padded = _pair(load_causal_lm(ckpts[arch]))
    batch = mixed_batch()
    spec = OutputSpec(temperature=0.7, entropy=True)
    micros = [batch[:4], batch[4:]]
    for a, b, m in zip(packed.forward(micros, spec), padded.forward(micros, spec), micros, strict=True):
        _assert_same_outputs(a, b, predicted(m))
        assert set(a) == {LOG_PROBS, ENTROPY}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_values_packed_equal_padded(ckpts: dict, arch: str) -> None:
    packed, padded = _pair(load_value_model(ckpts[arch], head_init_std=0.5, seed=3), head="value")
    batch = mixed_batch(seed=1)
    (a,), (b,) = packed.forward([batch], OutputSpec()), padded.forward([batch], OutputSpec())
    _assert_same_outputs(a, b, predicted(batch))
    assert set(a) == {VALUES} and a[VALUES].abs().sum() > 0


def _loss_and_grads(engine: TorchEngine, batch: TensorDict, micros: list, config: PPOActorConfig) -> tuple:
    agg = global_loss_denominators(
        batch[KEYS.response_mask], dp_size=1, loss_scale_factor=None, all_reduce_sum=engine.all_reduce_sum
    )
    loss_fn = functools.partial(actor_loss, config=config, agg=agg, n_micro=len(micros))

    def fn(micro, outputs):
        return loss_fn(micro, outputs)

    metrics = engine.forward_backward(micros, fn, OutputSpec(entropy=True))
    loss = sum(float(m["actor/pg_loss"]) for m in metrics)
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    engine.zero_grad()
    return loss, grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_losses_and_gradients_packed_equal_padded(ckpts: dict, arch: str) -> None:
    packed, padded = _pair(load_causal_lm(ckpts[arch]))
    config = PPOActorConfig(entropy_coeff=0.01, ppo_mini_batch_size=6)
    batch = mixed_batch(seed=2)
    micros = [batch[:2], batch[2:]]
    loss_a, grads_a = _loss_and_grads(packed, batch, micros, config)
    loss_b, grads_b = _loss_and_grads(padded, batch, micros, config)
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert set(grads_a) == set(grads_b) and grads_a
    for name, g in grads_b.items():
        torch.testing.assert_close(grads_a[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_plain_tinygpt_keeps_the_padded_path() -> None:
    engine = TorchEngine(LM(), device=CPU, remove_padding=True)
    reference = TorchEngine(LM(), device=CPU, remove_padding=False)
    assert not engine.packed
    batch = mixed_batch(rows=3, prompt=3, response=4, vocab=CFG.vocab_size)
    (a,), (b,) = (
        engine.forward([batch], OutputSpec(entropy=True)),
        reference.forward([batch], OutputSpec(entropy=True)),
    )
    for key in a:
        assert torch.equal(a[key], b[key])


class DocumentTinyGPT(TinyGPT):
    """A TinyGPT that takes packed documents: with ``position_ids`` and no mask, each run of positions from 0 is a
    causal document (the protocol a plain module implements to be packed)."""

    supports_packed_sequences = True

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        if attention_mask is not None or position_ids is None:
            return super().forward(input_ids, attention_mask, position_ids, cache)
        starts = (position_ids == 0).long().cumsum(-1)  # [1, T] document index
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = causal & (starts[0][:, None] == starts[0][None, :])
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        for i, block in enumerate(self.blocks):
            x = block(x, allowed[None, None], None, i)
        return self.head(self.ln_f(x))


def test_a_module_declaring_packed_support_is_called_packed_and_matches_padded() -> None:
    calls = []
    model = DocumentTinyGPT(CFG, seed=1)
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs), with_kwargs=True)
    packed, padded = _pair(model)
    batch = mixed_batch(rows=4, prompt=3, response=5, vocab=CFG.vocab_size, seed=3)
    (a,) = packed.forward([batch], OutputSpec(entropy=True))
    assert "position_ids" in calls[-1] and "attention_mask" not in calls[-1]
    (b,) = padded.forward([batch], OutputSpec(entropy=True))
    _assert_same_outputs(a, b, predicted(batch))
    config = PPOActorConfig(ppo_mini_batch_size=4)
    loss_a, grads_a = _loss_and_grads(packed, batch, [batch], config)
    loss_b, grads_b = _loss_and_grads(padded, batch, [batch], config)
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for name, g in grads_b.items():
        torch.testing.assert_close(grads_a[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _captured_update(ckpt: str, batch: TensorDict, **config) -> tuple[list[dict], list[list[int]]]:
    """``update_actor`` with the gradients of every step and the valid tokens of every micro-batch recorded."""
    actor = TorchActorWorker(
        functools.partial(load_causal_lm, ckpt),
        {
            "ppo_mini_batch_size": 4,
            "use_reference": False,
            "optim": {"lr": 1e-3, "grad_clip": None},
            **config,
        },
    )
    engine = actor.engine
    grads: list[dict] = []
    sizes: list[list[int]] = []
    step, fb = engine.optimizer_step, engine.forward_backward

    def optimizer_step():
        grads.append({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        return step()

    def forward_backward(micros, loss_fn, spec):
        sizes.append([int(m[KEYS.attention_mask].sum()) for m in micros])
        return fb(micros, loss_fn, spec)

    engine.optimizer_step, engine.forward_backward = optimizer_step, forward_backward
    actor.update_actor(batch)
    return grads, sizes


def test_token_budget_micro_batches_with_packing_sum_to_the_mini_batch_gradient(ckpts: dict) -> None:
    batch = mixed_batch(rows=8, seed=4)
    whole, whole_sizes = _captured_update(ckpts["llama"], batch)
    budget = 14
    split, sizes = _captured_update(ckpts["llama"], batch, ppo_max_token_len_per_gpu=budget)
    assert [len(s) for s in whole_sizes] == [1, 1]
    lengths = batch[KEYS.attention_mask].sum(-1).tolist()
    for step_sizes in sizes:  # every micro-batch within the budget, or a single row
        assert len(step_sizes) > 1
        assert all(s <= budget or s in lengths for s in step_sizes)
    assert len(whole) == len(split) == 2
    for a, b in zip(split, whole, strict=True):
        for name, g in b.items():
            torch.testing.assert_close(a[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_forward_token_budget_returns_rows_in_their_order(ckpts: dict) -> None:
    batch = mixed_batch(rows=7, seed=5)
    plain = TorchActorWorker(functools.partial(load_causal_lm, ckpts["qwen2"]), {"use_reference": False})
    budgeted = TorchActorWorker(
        functools.partial(load_causal_lm, ckpts["qwen2"]),
        {"use_reference": False, "forward_max_token_len_per_gpu": 12},
    )
    a, b = plain.compute_log_prob(batch), budgeted.compute_log_prob(batch)
    where = predicted(batch)
    for key in (KEYS.old_log_probs, KEYS.entropies):
        torch.testing.assert_close(b[key][where], a[key][where], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_hf_wrapper_keeps_the_logits_asked_for(ckpts: dict, native: bool) -> None:
    lm = load_causal_lm(ckpts["llama"]).eval()
    lm._takes_logits_to_keep = native  # False: a model without the argument, sliced by the wrapper
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = lm(ids)
        index = torch.tensor([7, 0, 3])
        torch.testing.assert_close(lm(ids, logits_to_keep=index), full[:, index])
        torch.testing.assert_close(lm(ids, logits_to_keep=4), full[:, -4:])


def test_hf_attention_without_document_masks_is_not_packed(ckpts: dict) -> None:
    lm = load_causal_lm(ckpts["qwen2"])
    assert lm.supports_packed_sequences
    lm.model.config._attn_implementation = "paged_attention"  # builds no mask from position_ids
    assert not lm.supports_packed_sequences
    assert not TorchEngine(lm, device=CPU).packed


@pytest.mark.parametrize(
    ("implementation", "auto_packs"),
    [("sdpa", False), ("eager", False), ("flex_attention", True), ("flash_attention_2", True)],
)
def test_auto_packs_only_where_packed_attention_skips_other_documents(
    ckpts: dict, implementation: str, auto_packs: bool
) -> None:
    """``sdpa``/``eager`` would attend through a dense ``[N, N]`` block mask over the whole packed length (on CPU
    the tiny job's steps took 5x longer packed): ``"auto"`` keeps their rows padded, True still packs them."""
    from ppo_core.models.hf import load_value_model

    for lm in (load_causal_lm(ckpts["qwen2"]), load_value_model(ckpts["qwen2"])):
        config = lm.model.config if hasattr(lm, "model") else lm.body.config
        config._attn_implementation = implementation
        assert lm.supports_packed_sequences and lm.packed_attention_is_sparse == auto_packs
        head = "policy" if hasattr(lm, "model") else "value"
        assert TorchEngine(lm, device=CPU, head=head).packed == auto_packs  # "auto", the default
        assert TorchEngine(lm, device=CPU, head=head, remove_padding=True).packed
        assert not TorchEngine(lm, device=CPU, head=head, remove_padding=False).packed
    with pytest.raises(ValueError, match="remove_padding"):
        TorchEngine(load_causal_lm(ckpts["qwen2"]), device=CPU, remove_padding="yes")
