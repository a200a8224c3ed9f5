"""Exact on-policy mode of the torch actor (``actor.worker.exact_log_probs``, ``ppo_core.workers.torch.exact``) on
tiny fp32 Llama and Qwen2 checkpoints: ``old_log_probs == rollout_log_probs`` bit for bit whatever the
micro-batching, PPO's ratio is 1 before the first optimiser step, the gradient is the model forward's, and a
trainer run logs ``training/rollout_probs_diff_max == 0`` on every step (the fast mode does not)."""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDict

transformers = pytest.importorskip("transformers")

from _hf import make_checkpoint  # noqa: E402

from ppo_core.backends import LocalWorkerGroup  # noqa: E402
from ppo_core.models import TinyGPT, TinyGPTConfig, load_causal_lm  # noqa: E402
from ppo_core.rollout import SamplingConfig  # noqa: E402
from ppo_core.trainer import BasePPOTrainer, PPOConfig  # noqa: E402
from ppo_core.trainer.tracking import read_metrics_jsonl  # noqa: E402
from ppo_core.workers import WorkerSpec  # noqa: E402
from ppo_core.workers.engine import LOG_PROBS, OutputSpec  # noqa: E402
from ppo_core.workers.torch import TorchActorWorker  # noqa: E402
from ppo_core.workers.torch.exact import ExactLogProbs, substitute_values  # noqa: E402

V, EOS, PAD = 16, 3, 0  # a small vocabulary: EOS ends some responses early (padding inside the rows)
R = 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return {arch: make_checkpoint(root / arch, arch, vocab_size=V) for arch in ("llama", "qwen2")}


def _worker_config(exact: bool, **overrides: object) -> dict:
    return {
        "rollout": {
            "max_new_tokens": R,
            "temperature": 0.9,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "batch_invariant": True,
        },
        "ppo_mini_batch_size": 8,
        "device": "cpu",
        "exact_log_probs": exact,
        **overrides,
    }


def _actor(ckpt: str, exact: bool = True, **overrides: object) -> TorchActorWorker:
    return TorchActorWorker(functools.partial(load_causal_lm, ckpt), _worker_config(exact, **overrides))


def _prompts(batch: int = 8, width: int = 7, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(EOS + 1, V, (batch, width), generator=g) * mask
    return TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[batch])


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "micro",
    [
        {"forward_micro_batch_size": 3},
        {"forward_max_token_len_per_gpu": 30},  # token-budget micro-batches: rows regrouped and reordered
        {"forward_micro_batch_size": 5, "use_remove_padding": True},  # the plain forward packs the rows
    ],
)
def test_old_and_reference_log_probs_are_the_rollout_s_bit_for_bit(ckpts, arch, micro):
    actor = _actor(ckpts[arch], **micro)
    batch = actor.generate_sequences(_prompts())
    valid = batch["response_mask"].bool()
    assert bool((~valid).any()), "some responses should end early"
    old = actor.compute_log_prob(batch)["old_log_probs"]
    calls = []
    hook = actor.ref_model.register_forward_hook(lambda *args: calls.append(1))
    ref = actor.compute_ref_log_prob(batch)["ref_log_probs"]
    hook.remove()
    assert torch.equal(old[valid], batch["rollout_log_probs"][valid])
    assert torch.equal(ref[valid], batch["rollout_log_probs"][valid])
    assert not calls  # without entropy or gradient the model's own forward has nothing to add


def test_a_custom_hf_engine_sets_the_numerics_of_the_reference_too(ckpts):
    from ppo_core_decode.hf import HFRolloutEngine

    def unfused(module):
        return HFRolloutEngine(module, batch_invariant=True, fuse_projections=False)

    factory = functools.partial(load_causal_lm, ckpts["qwen2"])
    actor = TorchActorWorker(factory, _worker_config(True), rollout_engine=unfused)
    assert actor.reference.exact_log_probs.rollout._forward.fuse_projections is False
    batch = actor.generate_sequences(_prompts(seed=4))
    valid = batch["response_mask"].bool()
    ref = actor.compute_ref_log_prob(batch)["ref_log_probs"]
    assert torch.equal(ref[valid], batch["rollout_log_probs"][valid])
    with pytest.raises(
        ValueError, match=r"actor\.worker\.exact_log_probs=True needs .*batch_invariant=True\)"
    ):
        TorchActorWorker(factory, _worker_config(True), rollout_engine=HFRolloutEngine)


def test_long_micro_batches_run_in_chunks_of_rows_with_the_same_bits(ckpts, monkeypatch):
    from ppo_core.workers.torch import exact

    actor = _actor(ckpts["llama"])
    batch = actor.generate_sequences(_prompts())
    whole = actor.compute_log_prob(batch)["old_log_probs"]
    monkeypatch.setattr(exact, "LOGITS_PER_CHUNK", 3 * (R + 1) * V)  # three rows a forward
    chunked = actor.compute_log_prob(batch)["old_log_probs"]
    assert torch.equal(chunked, whole)
    assert actor.engine.exact_log_probs.values(batch[:0]).shape == (0, R)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_without_exact_mode_the_log_probs_differ(ckpts, arch):
    """The test above is meaningful: the same rollout scored by the model's own forward is off in fp32 too."""
    actor = _actor(ckpts[arch], exact=False, forward_micro_batch_size=3)
    batch = actor.generate_sequences(_prompts())
    old = actor.compute_log_prob(batch)["old_log_probs"]
    assert 0 < _max_diff(old, batch["rollout_log_probs"], batch["response_mask"]) < 1e-4


def _first_micro_batch(actor: TorchActorWorker, batch: TensorDict, rows: int = 3):
    """The update's forward/backward of ``batch[:rows]`` with the loss ``sum(log_prob * mask)``: the log-probs
    it saw and the gradients it left."""
    seen = []

    def loss_fn(micro, outputs):
        seen.append(outputs[LOG_PROBS].detach().clone())
        return (outputs[LOG_PROBS] * micro["response_mask"]).sum(), {}

    actor.engine.train()
    actor.engine.zero_grad()
    micro = batch[:rows].to(actor.engine.device)
    actor.engine.forward_backward([micro], loss_fn, OutputSpec(temperature=0.9))
    grads = {n: p.grad.clone() for n, p in actor.engine.named_parameters() if p.grad is not None}
    actor.engine.zero_grad()
    return seen[0], grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_update_sees_the_rollout_s_log_probs_and_the_model_s_gradient(ckpts, arch):
    exact, fast = _actor(ckpts[arch]), _actor(ckpts[arch], exact=False)
    batch = exact.generate_sequences(_prompts(seed=1))
    log_prob, grads = _first_micro_batch(exact, batch)
    mask = batch["response_mask"][:3].bool()
    assert torch.equal(log_prob[mask], batch["rollout_log_probs"][:3][mask])  # the ratio is exactly 1
    fast_log_prob, fast_grads = _first_micro_batch(fast, batch)
    assert _max_diff(fast_log_prob, log_prob, mask) > 0
    # the backward is the plain forward's: the same gradient as the fast mode, bit for bit
    assert grads.keys() == fast_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, fast_grads[name]), name
        assert bool(torch.isfinite(grad).all())


def test_substitute_values_returns_the_values_and_the_differentiable_gradient():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen, requires_grad=True)
    values = torch.randn(4, 5, generator=gen)
    out = substitute_values(x.exp(), values)
    assert torch.equal(out, values) and out is not values
    weight = torch.randn(4, 5, generator=gen)
    (out * weight).sum().backward()
    torch.testing.assert_close(x.grad, weight * x.detach().exp(), rtol=0, atol=0)
    with torch.no_grad():
        assert substitute_values(x, values) is values
    with pytest.raises(ValueError, match="shapes differ"):
        substitute_values(x, values[:2])


class _Trainer(BasePPOTrainer):
    checkpoint = ""

    def init_workers(self) -> None:
        policy = functools.partial(load_causal_lm, self.checkpoint)
        self.actor_wg = LocalWorkerGroup(WorkerSpec(TorchActorWorker, (policy, self.config.actor.worker)))


def _dataset(n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(EOS + 1, V, (1 + i % 3,), generator=g).tolist(), "ground_truth": i % 3}
            for i in range(n)]  # fmt: skip


def _reward(batch: TensorDict) -> torch.Tensor:
    return (batch["responses"][:, 0] % 3 == torch.tensor(batch.get("ground_truth").tolist())).float()


def _fit(tmp_path, ckpt: str, exact: bool, steps: int = 2) -> list[dict]:
    worker = _worker_config(exact, micro_batch_size=3, optim={"lr": 1e-2})
    worker["rollout"]["temperature"] = 1.0
    cfg = PPOConfig.from_dict({
        "data": {"train_batch_size": 2, "seed": 1},
        "rollout": {"n": 4},
        "algorithm": {"adv_estimator": "grpo"},
        "actor": {"worker": worker},
        "trainer": {"total_epochs": 2, "total_training_steps": steps, "save_freq": 0,
                    "test_freq": 0, "default_local_dir": str(tmp_path), "progress_bar": False,
                    "loggers": ["jsonl"]},
    })  # fmt: skip
    trainer = type("Trainer", (_Trainer,), {"checkpoint": ckpt})(
        cfg, train_dataset=_dataset(), reward_fn=_reward
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return read_metrics_jsonl(tmp_path)


def test_a_trainer_run_in_exact_mode_is_on_policy_at_every_step(ckpts, tmp_path):
    rows = _fit(tmp_path / "exact", ckpts["qwen2"], exact=True)
    assert len(rows) == 2
    for metrics in rows:
        assert metrics["training/rollout_probs_diff_max"] == 0.0
        # one mini-batch per step: every micro-batch is before the step's optimiser step (ratio exactly 1)
        assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    fast = _fit(tmp_path / "fast", ckpts["qwen2"], exact=False)
    assert all(metrics["training/rollout_probs_diff_max"] > 0 for metrics in fast)


def test_unsupported_settings_name_the_config_field(ckpts):
    with pytest.raises(ValueError, match=r"^exact_log_probs=True needs .* rollout\.batch_invariant=True"):
        TorchActorWorker(
            functools.partial(load_causal_lm, ckpts["llama"]),
            {**_worker_config(True), "rollout": {"max_new_tokens": R}},
        )
    # built by hand around another engine: the worker's section named in full
    with pytest.raises(ValueError, match=r"actor\.worker\.exact_log_probs=True needs .*batch_invariant=True"):
        ExactLogProbs(object(), SamplingConfig())
    tiny = functools.partial(
        TinyGPT, TinyGPTConfig(vocab_size=V, max_seq_len=16, d_model=16, n_heads=2), seed=1
    )
    with pytest.raises(ValueError, match=r"actor\.worker\.exact_log_probs.*Hugging Face rollout engine"):
        TorchActorWorker(tiny, _worker_config(True, use_reference=False))


# ----- CUDA ---------------------------------------------------------------------------------------------------


def _cuda_model(kind: str) -> torch.nn.Module:
    """A bf16 model with a head width of 16 (the Triton attention's smallest) and a vocabulary of two sampling
    blocks."""
    from ppo_core.models import HFCausalLM

    sizes = dict(
        vocab_size=5000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    return HFCausalLM(model.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cuda_exact_mode_is_the_rollout_bit_for_bit(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = _worker_config(True, forward_max_token_len_per_gpu=500, use_remove_padding=True)
    config["device"] = "cuda"
    config["rollout"].update(max_new_tokens=48, eos_token_id=7)
    actor = TorchActorWorker(functools.partial(_cuda_model, kind), config)
    batch = actor.generate_sequences(_prompts(batch=24, width=40, seed=2))
    valid = batch["response_mask"].bool()
    old = actor.compute_log_prob(batch)["old_log_probs"]
    ref = actor.compute_ref_log_prob(batch)["ref_log_probs"]
    assert torch.equal(old[valid], batch["rollout_log_probs"][valid])
    assert torch.equal(ref[valid], batch["rollout_log_probs"][valid])
    log_prob, grads = _first_micro_batch(actor, batch, rows=5)
    assert torch.equal(log_prob.cpu()[valid[:5]], batch["rollout_log_probs"][:5][valid[:5]])
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    fast = TorchActorWorker(functools.partial(_cuda_model, kind), {**config, "exact_log_probs": False})
    assert _max_diff(fast.compute_log_prob(batch)["old_log_probs"], batch["rollout_log_probs"], valid) > 0
