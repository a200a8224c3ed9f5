"""Hugging Face models in and out: load, value head, export round trips, left padding and KV cache in the workers."""

from __future__ import annotations

import functools
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

transformers = pytest.importorskip("transformers")

from _hf import make_checkpoint, make_tokenizer  # noqa: E402

from ppo_core.models import (  # noqa: E402
    CausalLMWithValueHead,
    HFCausalLM,
    export_actor_checkpoint,
    export_hf,
    load_causal_lm,
    load_value_model,
)
from ppo_core.models.hf import positions_from_mask, unwrap_hf_model  # noqa: E402
from ppo_core.workers.torch import SamplingConfig, TorchActorWorker, TorchCriticWorker, generate  # noqa: E402

V = 96


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {arch: make_checkpoint(root / arch, arch, vocab_size=V) for arch in ("llama", "qwen2")}
    make_tokenizer(root / "llama")  # a tokenizer next to the llama weights, as in a real checkpoint
    return out


def _ids(seed: int, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_wrapper_gives_the_logits_of_transformers(ckpts, arch):
    ours = load_causal_lm(ckpts[arch])
    ref = transformers.AutoModelForCausalLM.from_pretrained(ckpts[arch], local_files_only=True)
    ids = _ids(0)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(
            ours(ids, attention_mask=torch.ones_like(ids)), ref(ids).logits, rtol=0, atol=0
        )
    assert isinstance(ours, HFCausalLM) and ours.config.model_type == arch
    assert next(ours.parameters()).dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_round_trip_gives_identical_logits(ckpts, arch, tmp_path):
    model = load_causal_lm(ckpts[arch])
    _perturb(model, 1)  # a trained model differs from the checkpoint it started from
    out = export_hf(model, ckpts["llama"], tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert any(f.endswith(".safetensors") for f in os.listdir(out))
    ids = _ids(2, batch=3, length=9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=0, atol=0)
        original = transformers.AutoModelForCausalLM.from_pretrained(ckpts[arch], local_files_only=True)
        assert not torch.equal(original(ids).logits, model(ids))
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_export_in_bf16_casts_a_copy(ckpts, tmp_path):
    model = load_causal_lm(ckpts["qwen2"])
    out = export_hf(model, None, tmp_path / "bf16", dtype="bfloat16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype="auto")
    assert loaded.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))
    ref = {k: v.bfloat16() for k, v in model.model.state_dict().items()}
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, ref[name], rtol=0, atol=0)


def _padded_batch(prompts: list[list[int]], responses: list[list[int]], pad: int = 0) -> TensorDict:
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + R), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp = torch.full((len(prompts), R), pad, dtype=torch.long)
    rmask = torch.zeros(len(prompts), R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, P - len(p) : P] = torch.tensor(p)
        mask[i, P - len(p) : P] = 1
        ids[i, P : P + len(r)] = torch.tensor(r)
        mask[i, P : P + len(r)] = 1
        resp[i, : len(r)] = torch.tensor(r)
        rmask[i, : len(r)] = 1
    return TensorDict(
        {"input_ids": ids, "attention_mask": mask, "responses": resp, "response_mask": rmask},
        batch_size=[len(prompts)],
    )


@pytest.fixture(scope="module")
def llama_actor(ckpts):
    return TorchActorWorker(
        functools.partial(load_causal_lm, ckpts["llama"]),
        {"rollout": {"max_new_tokens": 5, "eos_token_id": 2}, "ppo_mini_batch_size": 2, "device": "cpu"},
    )


@settings(max_examples=10)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=2, max_size=4),
    seed=st.integers(0, 1000),
)
def test_left_padding_does_not_change_log_probs(llama_actor, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, V, (r,), generator=g).tolist() for _, r in lengths]
    batched = llama_actor.compute_log_prob(_padded_batch(prompts, responses))["old_log_probs"]
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        alone = llama_actor.compute_log_prob(_padded_batch([p], [r]))["old_log_probs"][0]
        torch.testing.assert_close(batched[i, : len(r)], alone, rtol=1e-5, atol=1e-5)


def test_left_padding_with_absolute_positions(tmp_path):
    # GPT-2 adds learned absolute position embeddings: without positions from the mask, padding would shift them
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    model = load_causal_lm(tmp_path / "gpt2", attn_implementation="eager").eval()
    row = [5, 6, 7, 8]
    padded = torch.tensor([[0, 0, 0, *row]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(padded, attention_mask=mask)[:, 3:], model(torch.tensor([row])), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kv_cache_decoding_equals_full_recompute(ckpts, arch):
    model = load_causal_lm(ckpts[arch]).eval()
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    outs = []
    for use_cache in (True, False):
        cfg = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_token_id=2, use_cache=use_cache)
        outs.append(generate(model, prompts, mask, cfg, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    assert torch.equal(outs[0]["response_mask"], outs[1]["response_mask"])


def test_positions_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(positions_from_mask(mask), expected)


# ----- value model ----------------------------------------------------------------------------------------------


def test_value_model_shapes_init_and_padding(ckpts):
    state = torch.random.get_rng_state()
    critic = load_value_model(ckpts["qwen2"])
    assert isinstance(critic, CausalLMWithValueHead)
    ids = _ids(4, batch=2, length=6)
    values = critic(ids)
    assert values.shape == (2, 6, 1) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))
    a = load_value_model(ckpts["qwen2"], head_init_std=0.1, seed=5)
    b = load_value_model(ckpts["qwen2"], head_init_std=0.1, seed=5)
    assert torch.equal(a.value_head.weight, b.value_head.weight) and a.value_head.weight.abs().sum() > 0
    assert torch.equal(torch.random.get_rng_state(), state)
    with torch.no_grad():
        padded = a(torch.tensor([[0, 0, 5, 6, 7]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1]]))
        torch.testing.assert_close(padded[:, 2:], a(torch.tensor([[5, 6, 7]])), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head_init_std must be >= 0"):
        CausalLMWithValueHead(torch.nn.Identity(), 4, head_init_std=-1)


def test_critic_worker_trains_the_value_model(ckpts):
    critic = TorchCriticWorker(
        functools.partial(load_value_model, ckpts["llama"]),
        {"ppo_mini_batch_size": 2, "device": "cpu", "optim": {"lr": 1e-2}},
    )
    batch = _padded_batch([[5, 6, 7], [8]], [[9, 10], [11, 12]])
    values = critic.compute_values(batch)["values"]
    assert torch.equal(values, torch.zeros(2, 2))
    batch.update({"values": values, "returns": torch.ones(2, 2)})
    metrics = critic.update_critic(batch)
    assert metrics["critic/grad_norm"] > 0
    after = critic.compute_values(batch)["values"]
    assert (after > 0).all()  # moved towards the returns of 1


# ----- factories, actor checkpoints, errors ---------------------------------------------------------------------


def test_factories_are_picklable(ckpts):
    factory = pickle.loads(
        pickle.dumps(functools.partial(load_causal_lm, ckpts["qwen2"], dtype=torch.float32))
    )
    assert isinstance(factory(), HFCausalLM)
    value_factory = pickle.loads(pickle.dumps(functools.partial(load_value_model, ckpts["qwen2"])))
    assert isinstance(value_factory(), CausalLMWithValueHead)


def test_export_actor_checkpoint_after_an_update(ckpts, tmp_path):
    actor = TorchActorWorker(
        functools.partial(load_causal_lm, ckpts["llama"]),
        {"ppo_mini_batch_size": 2, "device": "cpu", "optim": {"lr": 1e-2}},
    )
    batch = _padded_batch([[5, 6, 7], [8]], [[9, 10], [11, 12]])
    batch.update(actor.compute_log_prob(batch).select("old_log_probs"))
    batch.set("advantages", torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    actor.update_actor(batch)
    step_dir = tmp_path / "global_step_1"
    actor.save_checkpoint(str(step_dir / "actor"))
    for source in (step_dir, step_dir / "actor"):  # a trainer checkpoint, or the worker's own directory
        out = export_actor_checkpoint(source, ckpts["llama"], tmp_path / f"export_{source.name}")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        ids = _ids(5)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, actor.module(ids), rtol=0, atol=0)
            assert not torch.equal(loaded(ids).logits, actor.ref_model(ids))
    with pytest.raises(FileNotFoundError, match=r"neither actor/rank_0\.pt"):
        export_actor_checkpoint(tmp_path, ckpts["llama"], tmp_path / "x")


def test_errors(ckpts, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face checkpoint directory"):
        load_causal_lm(tmp_path)
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype"):
        load_causal_lm(ckpts["qwen2"], dtype="float33")
    with pytest.raises(TypeError, match="must be a Hugging Face PreTrainedModel"):
        unwrap_hf_model(torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match="holds none of"):
        export_hf(load_causal_lm(ckpts["qwen2"]), tmp_path, tmp_path / "out")

    class Wrapped(torch.nn.Module):  # DDP-style: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    inner = load_causal_lm(ckpts["qwen2"])
    assert unwrap_hf_model(Wrapped(inner)) is inner.model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_actor_left_padding_and_export(ckpts, tmp_path):
    actor = TorchActorWorker(
        functools.partial(load_causal_lm, ckpts["qwen2"], dtype=torch.bfloat16),
        {"rollout": {"max_new_tokens": 4, "eos_token_id": 2}, "ppo_mini_batch_size": 2, "device": "cuda"},
    )
    prompts, responses = [[5, 6, 7, 8, 9], [10]], [[11, 12, 13], [14, 15]]
    batched = actor.compute_log_prob(_padded_batch(prompts, responses))["old_log_probs"]
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        alone = actor.compute_log_prob(_padded_batch([p], [r]))["old_log_probs"][0]
        torch.testing.assert_close(batched[i, : len(r)], alone, rtol=0.05, atol=0.05)
    generated = actor.generate_sequences(
        _padded_batch(prompts, responses).select("input_ids", "attention_mask")
    )
    assert generated["responses"].shape == (2, 4)
    out = export_hf(actor.module, None, tmp_path / "cuda_export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True, dtype="auto"
    ).cuda()
    ids = _ids(6).cuda()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, actor.module(ids), rtol=0, atol=0)


def test_dropout_is_disabled_by_default(tmp_path):
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    assert config.resid_pdrop > 0 and config.attn_pdrop > 0
    ids = _ids(7)
    with torch.random.fork_rng(devices=[]):  # GPT-2's init and dropout draw from the global RNG
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
        for loader in (load_causal_lm, load_value_model):
            model = loader(tmp_path / "gpt2", attn_implementation="eager").train()
            assert torch.equal(model(ids), model(ids))  # training mode, yet deterministic
        noisy = load_causal_lm(tmp_path / "gpt2", attn_implementation="eager", disable_dropout=False).train()
        assert not torch.equal(noisy(ids), noisy(ids))
    assert load_causal_lm(tmp_path / "gpt2").config.resid_pdrop == 0.0
