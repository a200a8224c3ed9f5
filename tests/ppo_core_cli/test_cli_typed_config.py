"""Typed configs from the YAML to the worker: typed worker sections once a job is built, one key per setting (the
deprecated keys as aliases, a conflict refused), the cross-section rules at build time with dotted keys, the
timings JSON reading the typed config, and worker kinds completing their own configs (no branch per kind)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.rollout.sampling import SamplingConfig
from ppo_core.trainer import aliases
from ppo_core.workers.config import ModelSource, PPOActorConfig, PPOCriticConfig
from ppo_core.workers.megatron.config import MegatronActorConfig, MegatronCriticConfig
from ppo_core.workers.torch.config import TorchActorConfig, TorchCriticConfig
from ppo_core_cli import worker_kinds
from ppo_core_cli.aliases import canonical_job_tree
from ppo_core_cli.config import JobConfig
from ppo_core_cli.worker_kinds import WorkerKind, worker_kind

CLI = os.path.join(os.path.dirname(__file__), "..", "..", "ppo_core_cli")


# ----- typed sections ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("workers", "actor_cls", "critic_cls"),
    [("torch", TorchActorConfig, TorchCriticConfig), ("megatron", MegatronActorConfig, MegatronCriticConfig)],
)
def test_worker_sections_are_typed_once_the_job_is_built(workers, actor_cls, critic_cls):
    job = JobConfig.from_dict(
        {
            "workers": workers,
            "rollout": {"temperature": 0.5, "max_new_tokens": 7},
            "actor": {"use_kl_loss": True, "worker": {"optim": {"lr": 1e-4}}},
        }
    )
    assert type(job.actor.worker) is actor_cls and type(job.critic.worker) is critic_cls
    assert isinstance(job.actor.worker.rollout, SamplingConfig)
    # the actor's sampling and KL switch follow the canonical keys
    assert (job.actor.worker.rollout.temperature, job.actor.worker.rollout.max_new_tokens) == (0.5, 7)
    assert job.actor.worker.use_kl_loss and job.actor.worker.optim.lr == 1e-4
    again = dataclasses.replace(job, run_dir="elsewhere")  # rebuilding keeps the typed configs
    assert again.actor.worker == job.actor.worker and type(again.critic.worker) is critic_cls
    assert JobConfig.from_dict(job.to_dict()) == job


def test_a_worker_config_of_another_kind_is_refused():
    with pytest.raises(
        TypeError, match=r"actor\.worker must be a MegatronActorConfig or a dict for workers='megatron'"
    ):
        JobConfig(workers="megatron", actor={"worker": TorchActorConfig()})


# ----- one key per setting: deprecated aliases ----------------------------------------------------------------------
SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "max_new_tokens": st.integers(1, 512),
    "engine": st.sampled_from(["auto", "hf", "reference"]),
}


@given(
    st.dictionaries(st.sampled_from(sorted(SAMPLING)), st.none(), min_size=1).flatmap(
        lambda keys: st.fixed_dictionaries({k: SAMPLING[k] for k in keys})
    )
)
def test_the_old_rollout_keys_give_the_job_of_the_canonical_keys(values):
    old = JobConfig.from_dict({"actor": {"worker": {"rollout": dict(values)}}})
    new = JobConfig.from_dict({"rollout": dict(values)})
    assert old == new
    assert {k: getattr(new.rollout, k) for k in values} == values


def test_old_keys_warn_once_and_map_onto_the_canonical_keys(caplog, monkeypatch):
    monkeypatch.setattr(aliases, "_warned", set())
    tree = {"actor": {"worker": {"rollout": {"temperature": 0.3}, "use_kl_loss": True, "ppo_epochs": 2}}}
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.aliases"):
        job = JobConfig.from_dict(tree)
        JobConfig.from_dict(tree)
    assert job.rollout.temperature == 0.3 and job.actor.use_kl_loss and job.actor.worker.ppo_epochs == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "actor.worker.rollout.temperature is deprecated: write rollout.temperature (the old key is read as an "
        "alias for one release)",
        "actor.worker.use_kl_loss is deprecated: write actor.use_kl_loss (the old key is read as an alias for one "
        "release)",
    ]
    assert tree["actor"]["worker"]["use_kl_loss"] is True  # the caller's mapping is not modified
    # the same value at both keys is one setting
    same = {"rollout": {"temperature": 0.3}, "actor": {"use_kl_loss": True, **tree["actor"]}}
    assert JobConfig.from_dict(same) == job


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"rollout": {"max_new_tokens": 8}, "actor": {"worker": {"rollout": {"max_new_tokens": 9}}}},
            "actor.worker.rollout.max_new_tokens=9 (deprecated) and rollout.max_new_tokens=8 are both set and "
            "differ; keep only rollout.max_new_tokens",
        ),
        (
            {"actor": {"use_kl_loss": False, "worker": {"use_kl_loss": True}}},
            "actor.worker.use_kl_loss=True (deprecated) and actor.use_kl_loss=False are both set and differ; keep "
            "only actor.use_kl_loss",
        ),
    ],
)
def test_an_old_key_that_disagrees_with_its_canonical_key_is_refused(tree, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        JobConfig.from_dict(tree)


def test_the_loader_reads_old_keys_before_the_preset(caplog, monkeypatch):
    from ppo_core_cli.loading import load_job_config

    monkeypatch.setattr(aliases, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="ppo_core.trainer.aliases"):
        job = load_job_config(None, ["preset=grpo"])  # the preset's keys are no deprecated keys of the job
    assert caplog.records == [] and job.actor.use_kl_loss and job.actor.worker.use_kl_loss

    # the job's own (deprecated) key wins over the grpo preset's actor.use_kl_loss=true: a conflict, not a default
    with pytest.raises(ValueError, match=r"actor\.worker\.use_kl_loss=False \(deprecated\)"):
        load_job_config(None, ["preset=grpo", "actor.worker.use_kl_loss=false", "actor.use_kl_loss=true"])
    job = load_job_config(None, ["preset=grpo", "actor.worker.rollout.max_new_tokens=5"])
    assert job.rollout.max_new_tokens == 5 and job.rollout.n == 8


def test_an_omegaconf_mapping_with_old_keys_gives_the_same_job():
    omegaconf = pytest.importorskip("omegaconf")
    tree = {"actor": {"worker": {"rollout": {"temperature": 0.4}, "ppo_epochs": 3}}, "rollout": {"n": 2}}
    job = JobConfig.from_dict(omegaconf.OmegaConf.create(tree))
    assert job == JobConfig.from_dict(tree) and job.rollout.temperature == 0.4 and job.rollout.n == 2


def test_canonical_job_tree_names_a_section_that_is_no_mapping():
    with pytest.raises(TypeError, match=r"actor\.worker must be a mapping, got int 3"):
        canonical_job_tree({"actor": {"worker": 3}})
    assert canonical_job_tree({"actor": {"worker": {"rollout": None}}}, warn=False) == {
        "actor": {"worker": {}}
    }


# ----- cross-section rules at build time ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tree", "exc", "message"),
    [
        (
            {
                "data": {"train_batch_size": 6},
                "rollout": {"n": 2},
                "actor": {"worker": {"ppo_mini_batch_size": 8}},
            },
            ValueError,
            "actor.worker.ppo_mini_batch_size=8 does not divide the responses of a step, data.train_batch_size x "
            "rollout.n = 6 x 2 = 12",
        ),
        (
            {"actor": {"use_kl_loss": True, "worker": {"use_reference": False}}},
            ValueError,
            "actor.worker.use_reference=false, but actor.use_kl_loss=true needs the reference",
        ),
        (
            {"algorithm": {"use_kl_in_reward": True}, "actor": {"worker": {"use_reference": False}}},
            ValueError,
            "actor.worker.use_reference=false, but algorithm.use_kl_in_reward=true needs the reference",
        ),
        (
            {"rollout": {"engine": "megatron"}},
            ValueError,
            "rollout.engine='megatron' samples with the megatron actor's policy",
        ),
        (
            {
                "backend": "monarch",
                "actor": {"world_size": 3, "worker": {"ppo_mini_batch_size": 8}},
                "critic": {"world_size": 3, "worker": {"ppo_mini_batch_size": 8}},
            },
            ValueError,
            "actor.worker.ppo_mini_batch_size=8 must be divisible by the data-parallel size 3",
        ),
        (
            {
                "workers": "megatron",
                "backend": "monarch",
                "actor": {
                    "world_size": 4,
                    "worker": {"ppo_mini_batch_size": 8, "parallel": {"tensor_model_parallel_size": 3}},
                },
                "critic": {"world_size": 4, "worker": {"ppo_mini_batch_size": 8}},
            },
            ValueError,
            "actor.worker.parallel: world_size (4) must be divisible by tensor_model_parallel_size (3)",
        ),
        (
            {"workers": "megatron", "critic": {"worker": {"hf_checkpoint": "x"}}},
            ValueError,
            "critic.worker.hf_checkpoint is set by the run from the model's checkpoint",
        ),
        (
            {"workers": "megatron", "critic": {"worker": {"value_head_init_std": 0.1}}},
            ValueError,
            "critic.worker.value_head_init_std is set by the run",
        ),
        ({"workers": "jax"}, ValueError, "unknown workers 'jax'; valid values: megatron, torch"),
    ],
)
def test_rules_between_sections_are_checked_when_the_job_is_built(tree, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        JobConfig.from_dict(tree)


@pytest.mark.parametrize(
    "tree",
    [
        {"rollout": {"batch_invariant": True}, "actor": {"worker": {"exact_log_probs": True}}},
        {"actor": {"worker": {"exact_log_probs": True, "rollout": {"batch_invariant": True}}}},  # old key
    ],
)
def test_exact_log_probs_reads_batch_invariant_from_the_rollout_section(tree):
    # the worker's own check (exact mode needs the batch-invariant sampler) sees the job's rollout section
    job = JobConfig.from_dict(tree)
    assert job.actor.worker.exact_log_probs and job.actor.worker.rollout.batch_invariant
    with pytest.raises(
        ValueError, match=re.escape("actor.worker.exact_log_probs=True needs the batch-invariant")
    ):
        JobConfig.from_dict({"actor": {"worker": {"exact_log_probs": True}}})
    # a rule on the sampling names the canonical key, not actor.worker.rollout.*
    with pytest.raises(ValueError, match=r"^rollout\.engine='megatron' samples"):
        JobConfig.from_dict({"rollout": {"engine": "megatron"}})


def test_megatron_data_parallel_size_is_the_world_over_the_model_parallel_ranks():
    job = JobConfig.from_dict(
        {
            "workers": "megatron",
            "backend": "monarch",
            "actor": {
                "world_size": 4,
                "worker": {"ppo_mini_batch_size": 6, "parallel": {"tensor_model_parallel_size": 2}},
            },
            "critic": {"world_size": 4, "worker": {"ppo_mini_batch_size": 8}},
            "data": {"train_batch_size": 24},
        }
    )  # actor: dp 2 divides 6; critic: dp 4 divides 8
    assert job.actor.worker.data_parallel_size(4) == 2 and job.critic.worker.data_parallel_size(4) == 4


# ----- the timings JSON reads the typed config ---------------------------------------------------------------------
def test_the_timings_json_reports_the_effective_max_new_tokens(tmp_path):
    from ppo_core_cli.train import TrainResult, _write_timings

    records = [{"step": 1, "timing_s/step": 2.0, "timing_s/gen": 1.0, "response_length/mean": 4.0}]
    for tree, expected in (({}, SamplingConfig().max_new_tokens), ({"rollout": {"max_new_tokens": 33}}, 33)):
        job = JobConfig.from_dict(tree)
        path = _write_timings(
            str(tmp_path / "t.json"), job, records, TrainResult(run_dir="r", metrics_file="m"), 0
        )
        with open(path, encoding="utf-8") as f:
            assert json.load(f)["job"]["max_new_tokens"] == expected


# ----- worker kinds complete their own configs ---------------------------------------------------------------------
@dataclass(kw_only=True)
class _FakeActorConfig(PPOActorConfig):
    """A worker kind of a test: its actor reads a ``checkpoint`` the run sets."""

    checkpoint: str = ""
    """Set by the run (:meth:`resolved`)."""
    dtype: str = ""
    """Set by the run."""

    RUN_KEYS: ClassVar[tuple[str, ...]] = ("checkpoint", "dtype")

    def resolved(self, source: ModelSource) -> _FakeActorConfig:
        return dataclasses.replace(self, checkpoint=source.checkpoint, dtype=source.dtype)

    def data_parallel_size(self, world_size: int) -> int:
        return 1  # one replica spread over every rank


@dataclass(kw_only=True)
class _FakeCriticConfig(PPOCriticConfig):
    """The fake kind's critic."""

    head_std: float = -1.0
    """Set by the run."""

    RUN_KEYS: ClassVar[tuple[str, ...]] = ("head_std",)

    def resolved(self, source: ModelSource) -> _FakeCriticConfig:
        return dataclasses.replace(self, head_std=source.value_head_init_std)


def _fake_specs(job: Any, ppo: Any, model_dir: str) -> dict[str, Any]:
    return {"actor": ("fake actor", ppo.actor.worker, model_dir)}


@pytest.fixture
def fake_kind(monkeypatch):
    kind = WorkerKind("fake", _FakeActorConfig, _FakeCriticConfig, _fake_specs, "a test's")
    monkeypatch.setitem(worker_kinds._KINDS, "fake", kind)
    return kind


def test_a_registered_worker_kind_completes_its_config_through_its_own_methods(fake_kind):
    from ppo_core_cli.job import complete_workers, worker_specs
    from ppo_core_cli.tokens import SpecialTokens

    tree = {
        "workers": "fake",
        "backend": "monarch",
        "model": {"path": "/ckpt", "critic_path": "/critic", "dtype": "bfloat16", "value_head_init_std": 0.5},
        "actor": {"world_size": 2, "worker": {"ppo_mini_batch_size": 1}},  # dp 1: any size divides
        "critic": {"world_size": 2, "worker": {"ppo_mini_batch_size": 8}},
        "rollout": {"max_new_tokens": 5},
    }
    job = JobConfig.from_dict(tree)
    assert worker_kind("fake") is fake_kind
    assert type(job.actor.worker) is _FakeActorConfig and type(job.critic.worker) is _FakeCriticConfig
    tokens = SpecialTokens(
        eos_token="e", eos_token_id=2, eos_source="test", pad_token="p", pad_token_id=1, pad_source="test"
    )
    actor, critic = complete_workers(job, tokenizer=None, model_dir="/ckpt", tokens=tokens)
    assert (actor.checkpoint, actor.dtype, critic.head_std) == ("/ckpt", "bfloat16", 0.5)
    assert (actor.rollout.max_new_tokens, actor.rollout.eos_token_id, actor.rollout.pad_token_id) == (5, 2, 1)
    ppo = job.ppo_config(actor, critic)
    assert worker_specs(job, ppo, "/ckpt") == {"actor": ("fake actor", actor, "/ckpt")}
    # the keys the run sets are the run's, and are not written into the job
    with pytest.raises(ValueError, match=r"actor\.worker\.checkpoint is set by the run"):
        JobConfig.from_dict({**tree, "actor": {"world_size": 2, "worker": {"checkpoint": "x"}}})
    assert "checkpoint" not in job.to_dict()["actor"]["worker"]
    from ppo_core_cli.reference import render_markdown

    assert "### `actor.worker` with `workers: fake` (`_FakeActorConfig`: a test's)" in render_markdown()


def test_the_command_has_no_branch_per_kind_of_workers():
    """Completion, specs and rules go through the kind's classes: no ``workers == "..."`` test in the command."""
    for name in ("config.py", "job.py", "reference.py", "train.py", "evaluate.py", "loading.py", "roles.py"):
        with open(os.path.join(CLI, name), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"workers\s*[!=]=\s*['\"]", text), name
