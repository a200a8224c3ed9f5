"""From a job to the pieces of a run: random-init checkpoints of known shapes, the worker dicts completed from the
tokenizer and the checkpoint (megatron shape included), scorers, worker specs that a process backend can pickle."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("omegaconf")

from ppo_core.rewards import gsm8k_score  # noqa: E402
from ppo_core_cli.config import JobConfig, ScorerConfig  # noqa: E402
from ppo_core_cli.job import (  # noqa: E402
    build_reward,
    complete_workers,
    load_tokenizer,
    prepare_model,
    resolve_scorer,
    worker_specs,
)
from ppo_core_cli.loading import load_job_config  # noqa: E402
from ppo_core_cli.shapes import SHAPES, write_random_checkpoint  # noqa: E402


def test_random_checkpoints_of_a_shape(tiny, tokenizer_dir, tmp_path):
    state = torch.random.get_rng_state()
    again = write_random_checkpoint(tmp_path / "again", "tiny", tokenizer_dir, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    a = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    b = transformers.AutoModelForCausalLM.from_pretrained(again)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    tok = transformers.AutoTokenizer.from_pretrained(tiny)  # the tokenizer files were copied
    assert a.config.vocab_size == len(tok) and a.config.eos_token_id == tok.eos_token_id
    shape = SHAPES["tiny"]
    assert (a.config.hidden_size, a.config.num_hidden_layers) == (
        shape["hidden_size"],
        shape["num_hidden_layers"],
    )
    assert not os.path.exists(str(tmp_path / "again") + ".tmp")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        write_random_checkpoint(again, "tiny", tokenizer_dir)
    with pytest.raises(ValueError, match="unknown shape 'qwen3'"):
        write_random_checkpoint(tmp_path / "x", "qwen3", tokenizer_dir)


def test_qwen_shapes_are_the_published_configurations():
    """Written out from the released Qwen2.5 config.json files (hidden, intermediate, layers, heads, kv heads)."""
    published = {"qwen2.5-0.5b": (896, 4864, 24, 14, 2), "qwen2.5-1.5b": (1536, 8960, 28, 12, 2)}
    for name, dims in published.items():
        s = SHAPES[name]
        keys = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
        assert tuple(s[k] for k in keys) == dims
        assert s["vocab_size"] == 151936 and s["tie_word_embeddings"] and s["rope_theta"] == 1e6


def test_prepare_model(tiny, tokenizer_dir, tmp_path):
    assert prepare_model(JobConfig.from_dict({"model": {"path": tiny}})) == tiny
    with pytest.raises(FileNotFoundError, match=r"set model\.init_shape"):
        prepare_model(JobConfig.from_dict({"model": {"path": str(tmp_path / "none")}}))
    with pytest.raises(ValueError, match=r"needs model\.tokenizer_path"):
        prepare_model(JobConfig.from_dict({"model": {"path": str(tmp_path / "n"), "init_shape": "tiny"}}))
    with pytest.raises(ValueError, match=r"model\.path must name"):
        prepare_model(JobConfig())
    job = JobConfig.from_dict(
        {"model": {"path": str(tmp_path / "new"), "init_shape": "tiny", "tokenizer_path": tokenizer_dir}}
    )
    assert os.path.isfile(os.path.join(prepare_model(job), "config.json"))


def test_torch_workers_get_the_tokenizers_ids_unless_set(tiny):
    from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig

    mini = {"worker": {"ppo_mini_batch_size": 8}}
    job = JobConfig.from_dict(
        {"model": {"path": tiny}, "rollout": {"eos_token_id": 7}, "actor": mini, "critic": mini}
    )
    tok = load_tokenizer(job)
    actor, critic = complete_workers(job, tok, tiny)
    assert isinstance(actor, TorchActorConfig) and isinstance(critic, TorchCriticConfig)
    assert (actor.rollout.eos_token_id, actor.rollout.pad_token_id) == (7, tok.pad_token_id)
    # the run records the checkpoint the models start from (compared on resume); the job is not modified
    assert critic == dataclasses.replace(job.critic.worker, hf_checkpoint=tiny)
    assert actor.hf_checkpoint == tiny and job.actor.worker.hf_checkpoint is None
    assert job.actor.worker.rollout.eos_token_id == 7
    assert job.rollout.pad_token_id is None
    specs = worker_specs(job, job.ppo_config(actor, critic), tiny)
    assert set(specs) == {"actor", "critic"}
    for spec in specs.values():  # process backends pickle the specs
        again = pickle.loads(pickle.dumps(spec))
        assert again.cls is spec.cls and isinstance(again.args[0], functools.partial)
        assert again.args[1] == spec.args[1]  # the typed config travels as it is
    grpo = JobConfig.from_dict(
        {"model": {"path": tiny}, "algorithm": {"adv_estimator": "grpo"}, "actor": mini}
    )
    assert set(worker_specs(grpo, grpo.ppo_config(), tiny)) == {"actor"}


def test_megatron_workers_get_the_checkpoints_shape(tiny):
    from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig

    job = load_job_config(
        None,
        [
            f"model.path={tiny}",
            "workers=megatron",
            "backend=monarch",
            "actor.world_size=2",
            "critic.world_size=2",
            "model.dtype=bfloat16",
            "actor.worker.model.attention=local",
            "actor.worker.parallel.tensor_model_parallel_size=2",
        ],
    )
    actor, critic = complete_workers(job, load_tokenizer(job), tiny)
    assert isinstance(actor, MegatronActorConfig) and isinstance(critic, MegatronCriticConfig)
    with open(os.path.join(tiny, "config.json")) as f:
        hf = json.load(f)
    model = actor.model  # what the worker will build
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.vocab_size) == (
        hf["num_hidden_layers"],
        hf["hidden_size"],
        hf["intermediate_size"],
        hf["vocab_size"],
    )
    assert model.kv_heads == hf["num_key_value_heads"] and model.qkv_bias and model.tie_word_embeddings
    assert model.dtype == "bfloat16" and model.attention == "local"
    assert actor.hf_checkpoint == tiny and actor.parallel.tensor_model_parallel_size == 2
    assert critic.hf_checkpoint == tiny and critic.model.attention == "sdpa"
    assert critic.to_dict()["parallel"]["tensor_model_parallel_size"] == 1  # the whole layout, for exports
    # the critic's value head is initialised as the torch critic's (model.value_head_init_std, model.init_seed)
    assert (critic.value_head_init_std, critic.value_head_seed) == (0.0, 0)
    job = load_job_config(
        None,
        [f"model.path={tiny}", "workers=megatron", "model.value_head_init_std=0.02", "model.init_seed=5"],
    )
    critic = complete_workers(job, load_tokenizer(job), tiny)[1]
    assert (critic.value_head_init_std, critic.value_head_seed) == (0.02, 5)


def test_scorers(tmp_path):
    assert resolve_scorer(ScorerConfig(function="gsm8k")) is gsm8k_score
    flexible = resolve_scorer(ScorerConfig(function="gsm8k", kwargs={"method": "flexible"}))
    assert flexible("so 7", "7")["acc"] == 1.0 and gsm8k_score("so 7", "7")["acc"] == 0.0
    mine = resolve_scorer(ScorerConfig(function="ppo_core.rewards.gsm8k:gsm8k_score", kwargs={"score": 2.0}))
    assert mine("#### 3", "3")["score"] == 2.0
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_scorer(ScorerConfig(function="no_such_module:f"))
    with pytest.raises(ValueError, match="has no attribute 'no_such_function'"):
        resolve_scorer(ScorerConfig(function="ppo_core.rewards:no_such_function"))
    with pytest.raises(ValueError, match="is not callable"):
        resolve_scorer(ScorerConfig(function="ppo_core.rewards:GSM8K_PATTERNS"))


def test_reward_uses_the_jobs_scorers_first(tiny):
    job = JobConfig.from_dict(
        {
            "model": {"path": tiny},
            "reward": {"scorers": {"*gsm8k*": {"function": "gsm8k", "kwargs": {"format_score": 0.25}}}},
        }
    )
    reward = build_reward(job, load_tokenizer(job))
    assert reward.registry.get("synthetic/arith_gsm8k")("#### 4", "5")["score"] == 0.25
    assert reward.registry.get("openai/gsm8k")("#### 4", "5")["score"] == 0.25  # the job's glob wins
    assert reward.num_workers == 0


def test_load_prompts_follows_the_jobs_data_settings(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from ppo_core.data.prompts import tokenize_chat
    from ppo_core_cli.job import load_datasets, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [
        {
            "data_source": "t",
            "question": [{"role": "user", "content": text}],
            "reward_model": {"ground_truth": "1"},
        }
        for text in ("Mia", "Mia has 7 shells. Mia has 7 shells. Mia has 7 shells.")
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [len(tokenize_chat(tokenizer, r["question"], {})) for r in rows]
    limit = (lengths[0] + lengths[1]) // 2
    assert lengths[0] <= limit < lengths[1]
    data = {"max_prompt_length": limit, "truncation": "filter", "prompt_key": "question"}
    job = JobConfig.from_dict({"data": {**data, "train_files": [str(path)], "val_files": [str(path)]}})
    assert len(load_prompts(job, tokenizer, [str(path)])) == 1  # the long row filtered at the job's limit
    train, val = load_datasets(job, tokenizer)
    assert len(train) == len(val) == 1
    job = JobConfig.from_dict({"data": {**data, "truncation": "left", "train_files": [str(path)]}})
    assert len(load_prompts(job, tokenizer, [str(path)])) == 2 and load_datasets(job, tokenizer)[1] is None
