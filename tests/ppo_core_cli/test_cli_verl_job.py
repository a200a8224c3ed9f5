"""``ppo-core convert-verl`` and a verl file given to ``ppo-core train``: a verl user's path, end to end.

verl's composed config is built from our table of verl 0.9.1's keys and defaults (``_verl_defaults.DEFAULTS``); the
overrides are those of verl's GSM8K quick start, pointed at the offline example of ``ppo-core make-data``."""

from __future__ import annotations

import os
import re

import pytest
import yaml

pytest.importorskip("omegaconf")
pytest.importorskip("transformers")

from ppo_core.compat._verl_defaults import DEFAULTS, composed_config
from ppo_core_cli.config import JobConfig
from ppo_core_cli.loading import load_job_config
from ppo_core_cli.main import main
from ppo_core_cli.verl_job import job_from_verl

_SUMMARY = re.compile(
    r"converted (\d+) verl keys: (\d+) mapped, (\d+) at verl's defaults or switched off, (\d+) dropped"
)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    data = str(root / "ex")
    assert main(["-q", "make-data", data, "--n-train", "32", "--n-test", "8"]) == 0
    composed = root / "composed.yaml"
    composed.write_text(yaml.safe_dump(composed_config(), sort_keys=False))
    return root, data, str(composed)


def _quick_start(data: str) -> list[str]:
    """verl's GSM8K quick-start overrides, sized for the offline example."""
    return [
        f"data.train_files={data}/data/train.parquet",
        f"data.val_files={data}/data/test.parquet",
        "data.train_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={data}/model",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        f"critic.model.path={data}/model",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=console",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
    ]


def _summary(out: str) -> tuple[int, int, int, int]:
    match = _SUMMARY.search(out)
    assert match, out
    return tuple(int(n) for n in match.groups())  # type: ignore[return-value]


def test_the_composed_config_with_the_quick_start_overrides_is_a_job(example, capsys):
    root, data, composed = example
    job_file = str(root / "job.yaml")
    assert main(["convert-verl", composed, *_quick_start(data), "-o", job_file]) == 0
    out = capsys.readouterr().out
    total, mapped, quiet, dropped = _summary(out)
    assert total == len(DEFAULTS) == mapped + quiet + dropped
    dropped_lines = [line for line in out.splitlines() if line.startswith("  dropped ")]
    assert len(dropped_lines) == dropped == 2  # the rollout engine's name and memory share
    assert any("actor_rollout_ref.rollout.name='vllm'" in line for line in dropped_lines)
    assert f"train it: ppo-core train {job_file}" in out
    with open(job_file, encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("# ppo-core job converted from a verl config")
    assert "#     actor_rollout_ref.rollout.gpu_memory_utilization=0.4: engine" in text
    settings = yaml.safe_load(text)
    job = JobConfig.from_dict(settings)
    assert load_job_config(job_file) == job
    assert (
        job.model.path == f"{data}/model" and job.model.critic_path is None
    )  # the critic starts from it too
    assert job.data.train_files == [f"{data}/data/train.parquet"] and job.data.max_prompt_length == 64
    assert (job.backend, job.workers, job.actor.world_size) == ("local", "torch", 1)
    assert job.actor.worker.ppo_mini_batch_size == 4 and job.rollout.max_new_tokens == 8
    assert "rollout" not in settings["actor"]["worker"] and settings["rollout"]["max_new_tokens"] == 8
    assert job.trainer.loggers == ("console",)


def test_verls_rollout_correction_reaches_the_job(example, capsys):
    root, data, composed = example
    job_file = str(root / "rollout_correction.yaml")
    section = "algorithm.rollout_correction"
    correction = [
        f"{section}.rollout_is=token",
        f"{section}.rollout_rs=token_k1",
        f"{section}.rollout_rs_threshold=3.0",
    ]
    assert main(["convert-verl", composed, *_quick_start(data), *correction, "-o", job_file]) == 0
    _, mapped, _, dropped = _summary(capsys.readouterr().out)
    assert dropped == 2
    plain = job_from_verl(composed, _quick_start(data))
    # the composed config gives every key: the three were mapped before, at verl's defaults
    assert mapped == len(plain.conversion.mapped) and f"{section}.rollout_is" in plain.conversion.mapped
    job = load_job_config(job_file)
    assert job.algorithm.rollout_correction.rollout_is == "token"
    assert job.algorithm.rollout_correction.rejection_bounds()[0].option == "token_k1"
    assert plain.job.algorithm.rollout_correction.enabled is False


def test_verls_defaults_alone_convert_for_eight_gpus_with_notes(example, capsys):
    root, _, composed = example
    assert main(["convert-verl", composed, "-o", str(root / "defaults.yaml")]) == 0
    out = capsys.readouterr().out
    assert _summary(out)[3] == 0  # nothing dropped: every key is at verl's default
    assert "note: model.path" in out and "not a local folder" in out
    job = load_job_config(str(root / "defaults.yaml"))
    assert (job.backend, job.actor.world_size) == ("monarch", 8)


def test_without_output_the_job_goes_to_stdout(example, capsys):
    _, data, _ = example
    assert main(["convert-verl", _overrides_file(example), f"actor_rollout_ref.model.path={data}/model"]) == 0
    captured = capsys.readouterr()
    job = JobConfig.from_dict(yaml.safe_load(captured.out))
    assert job.algorithm.adv_estimator == "grpo" and job.rollout.n == 4
    assert _summary(captured.err)[0] > 0


def _overrides_file(example) -> str:
    root, data, _ = example
    path = root / "grpo_overrides.yaml"
    path.write_text(
        f"""
algorithm:
  adv_estimator: grpo
data:
  train_files: {data}/data/train.parquet
  val_files: [{data}/data/test.parquet]
  train_batch_size: 4
  max_prompt_length: 64
  max_response_length: 8
actor_rollout_ref:
  model:
    path: {data}/model
  actor:
    ppo_mini_batch_size: 2
    use_kl_loss: true
  rollout:
    n: 4
trainer:
  n_gpus_per_node: 1
  logger: console
  total_training_steps: 2
  test_freq: 2
"""
    )
    return str(path)


def test_refused_keys_stop_the_command_with_each_key_and_reason(example, capsys):
    root, _, composed = example
    job_file = root / "refused.yaml"
    status = main(
        [
            "convert-verl",
            composed,
            "algorithm.filter_groups.enable=true",
            "reward.custom_reward_function.path=my_reward.py",
            "-o",
            str(job_file),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("ppo-core: error: cannot convert 2 verl config key(s)")
    assert "algorithm.filter_groups.enable=True: DAPO's dynamic sampling" in err
    assert "reward.custom_reward_function.path='my_reward.py': verl's compute_score" in err
    assert not job_file.exists()


@pytest.mark.parametrize("which", ["composed", "overrides"])
def test_train_on_a_verl_file_says_how_to_convert_it_in_one_line(example, capsys, which):
    _, _, composed = example
    path = composed if which == "composed" else _overrides_file(example)
    assert main(["train", path, "trainer.total_training_steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ppo-core: error: ")
    assert f"ppo-core convert-verl {path} trainer.total_training_steps=1 -o job.yaml" in err
    assert "actor_rollout_ref" in err


@pytest.mark.slow
def test_the_converted_job_trains(example, capsys):
    root, data, composed = example
    job_file = str(root / "train_job.yaml")
    assert main(["-q", "convert-verl", composed, *_quick_start(data), "-o", job_file]) == 0
    run_dir = str(root / "run")
    assert main(["-q", "train", job_file, f"run_dir={run_dir}", "torch_threads=1"]) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps" in out
    assert os.path.isdir(os.path.join(run_dir, "export"))


def test_verls_megatron_strategy_gives_a_megatron_job(example):
    _, data, _ = example
    converted = job_from_verl(
        composed_config(megatron=True),
        [
            f"actor_rollout_ref.model.path={data}/model",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        ],
    )
    job = converted.job
    assert (job.workers, job.backend, job.actor.world_size) == ("megatron", "monarch", 2)
    assert job.actor.worker.parallel.tensor_model_parallel_size == 2
    assert "hf_checkpoint" not in converted.settings["actor"]["worker"]  # the run reads it from model.path
    assert job.actor.worker.hf_checkpoint is None
    assert job.model.path == f"{data}/model"
    assert any("backend monarch" in note for note in converted.notes)
