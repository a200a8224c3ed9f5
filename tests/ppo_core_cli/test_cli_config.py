"""The job config of ``ppo-core``: YAML + dotted overrides (Hydra habits), errors naming the dotted key, the worker
dicts checked against the chosen workers, and the trainer's ``PPOConfig`` derived from it."""

from __future__ import annotations

import copy
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("omegaconf")

from ppo_core.trainer import PPOConfig
from ppo_core_cli.config import JobConfig
from ppo_core_cli.loading import dump_job_config, load_job_config

# at most 60 examples under the ci profile (the dev profile's 30 stay 30): each example is slow, and the suite
# must stay within its 10-minute budget on the 2-core CI machine
_CI_EXAMPLES = min(60, settings.default.max_examples)

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
TINY = os.path.join(CONFIGS, "tiny_cpu.yaml")


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def _raises(exc: type, start: str, path: str | None, *overrides: str) -> str:
    with pytest.raises(exc) as err:
        load_job_config(path, overrides)
    message = str(err.value)
    assert message.startswith(start), message
    return message


# ----- every shipped config loads --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(os.listdir(CONFIGS)))
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    job = load_job_config(os.path.join(CONFIGS, name))
    assert isinstance(job.ppo_config(), PPOConfig)
    again = load_job_config(dump_job_config(job, tmp_path / "job.yaml"))
    assert again == job


def test_tiny_config_is_ppo_with_a_critic_and_kl_in_the_reward():
    job = load_job_config(TINY)
    ppo = job.ppo_config()
    assert ppo.algorithm.adv_estimator == "gae" and ppo.use_critic and ppo.algorithm.use_kl_in_reward
    assert job.backend == "local" and job.workers == "torch"


# ----- overrides ------------------------------------------------------------------------------------------------
def test_overrides_interpolations_and_path_resolution(tmp_path):
    job = load_job_config(
        TINY,
        [
            "trainer.total_training_steps=5",
            "vars.root=/data/x",
            "data.train_files=[a.parquet,b.parquet]",
            "actor.worker.optim.lr=1e-4",
            "+trainer.seed=3",  # Hydra's "add" prefix is accepted
            "run_dir=/tmp/r",
            "trainer.log_dir=logs",
        ],
    )
    assert job.trainer.total_training_steps == 5 and job.trainer.seed == 3
    assert job.model.path == "/data/x/sft_model" and job.sft.files == ["/data/x/data/sft.parquet"]
    assert job.data.train_files == ["a.parquet", "b.parquet"]
    assert job.actor.worker.optim.lr == 1e-4
    assert job.checkpoint_dir == "/tmp/r/checkpoints" and job.log_dir == "/tmp/r/logs"
    assert job.export_path == "/tmp/r/export"
    ppo = job.ppo_config()
    assert ppo.trainer.default_local_dir == "/tmp/r/checkpoints" and ppo.trainer.log_dir == "/tmp/r/logs"
    assert ppo.data.train_batch_size == job.data.train_batch_size
    absolute = load_job_config(None, ["trainer.default_local_dir=/abs/ckpt", "export_dir=/abs/out"])
    assert absolute.checkpoint_dir == "/abs/ckpt" and absolute.export_path == "/abs/out"


def _set(tree: dict, dotted: str, value) -> None:
    *heads, last = dotted.split(".")
    for head in heads:
        tree = tree.setdefault(head, {})
    tree[last] = value


SCALARS = {
    "trainer.total_training_steps": st.integers(1, 10**6),
    "trainer.seed": st.integers(0, 2**31),
    "trainer.val_before_train": st.booleans(),
    # multiples of the tiny config's ppo_mini_batch_size (64), which must divide train_batch_size x n
    "data.train_batch_size": st.integers(1, 64).map(lambda k: 64 * k),
    "data.max_prompt_length": st.integers(1, 8192),
    "rollout.n": st.integers(1, 16),
    "algorithm.gamma": st.floats(0, 1),
    "algorithm.kl_ctrl.kl_coef": st.floats(0, 1),
    "actor.worker.optim.lr": st.floats(1e-8, 1.0),
    "rollout.max_new_tokens": st.integers(1, 4096),
    "critic.worker.cliprange_value": st.floats(0.01, 10),
    "reward.num_workers": st.integers(0, 8),
    "sft.steps": st.integers(1, 1000),
    "model.dtype": st.sampled_from(
        ["float32", "bfloat16"]
    ),  # float16 needs a larger optim.eps (refused alone)
}


@pytest.fixture(scope="module")
def tiny_dict() -> dict:
    """The tiny config without overrides, as a plain dict: loaded once, copied by each example."""
    return load_job_config(TINY).to_dict()


@settings(max_examples=_CI_EXAMPLES)
@given(
    st.dictionaries(st.sampled_from(sorted(SCALARS)), st.none(), min_size=1).flatmap(
        lambda keys: st.fixed_dictionaries({k: SCALARS[k] for k in keys})
    )
)
def test_overrides_set_exactly_their_keys(tiny_dict, values):
    """``key=value`` strings give the config a dict with the value at the dotted path gives (a plain reference)."""
    expected = copy.deepcopy(tiny_dict)
    for key, value in values.items():
        _set(expected, key, value)
    texts = [f"{k}={'true' if v is True else 'false' if v is False else repr(v)}" for k, v in values.items()]
    assert load_job_config(TINY, texts) == JobConfig.from_dict(expected)


# ----- errors name the dotted key ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "exc", "start"),
    [
        (
            ["trainer.totl_steps=5"],
            ValueError,
            "unknown config key trainer.totl_steps; valid keys under trainer:",
        ),
        (["modell.path=x"], ValueError, "unknown config key modell (did you mean model?); valid keys:"),
        (  # verl's spelling of the key
            ["trainer.logger=[console]"],
            ValueError,
            "unknown config key trainer.logger (did you mean trainer.loggers?); valid keys under trainer:",
        ),
        (
            ["actor.worker.optim.lrr=1"],
            ValueError,
            "unknown config key actor.worker.optim.lrr (did you mean actor.worker.optim.lr?); valid keys under",
        ),
        (["reward.scorers.gsm.functon=x"], ValueError, "unknown config key reward.scorers.gsm.functon"),
        (  # an engine without settings: no empty list of valid keys
            ["rollout.engine=reference", "rollout.engine_config.kv_bucket=3"],
            ValueError,
            "unknown config key rollout.engine_config.kv_bucket; rollout.engine_config takes no keys here",
        ),
        (["trainer.seed=abc"], TypeError, "trainer.seed must be an int, got str 'abc'"),
        (["trainer.seed=-1"], ValueError, "trainer.seed must be >= 0, got -1"),
        (["data.truncation=middle"], ValueError, "unknown data.truncation 'middle'; valid values:"),
        (["data.max_prompt_length=0"], ValueError, "data.max_prompt_length must be >= 1, got 0"),
        (["actor.worker.optim.lr=-1"], ValueError, "actor.worker.optim.lr must be a finite number > 0"),
        (
            ["critic.worker.ppo_epochs=two"],
            TypeError,
            "critic.worker.ppo_epochs must be an int, got str 'two'",
        ),
        (["rollout.top_p=0"], ValueError, "rollout.top_p must be > 0"),
        (["backend=ray"], ValueError, "unknown backend 'ray'; valid values: local, monarch"),
        (["workers=fsdp"], ValueError, "unknown workers 'fsdp'; valid values: megatron, torch"),
        (["model.init_shape=qwen3"], ValueError, "unknown model.init_shape 'qwen3'; valid values:"),
        (
            ["reward.scorers.x.function=nodots"],
            ValueError,
            "reward.scorers['x'].function must be 'gsm8k', 'math'",
        ),
        (
            ["actor.world_size=2"],
            ValueError,
            "actor.world_size is 2 (critic.world_size 1); the local backend",
        ),
        (
            ["backend=monarch", "actor.world_size=2"],
            ValueError,
            "critic.world_size (1) must equal actor.world_size (2) when the roles are colocated",
        ),
        (
            ["workers=megatron", "actor.worker.model.num_layers=3"],
            ValueError,
            "actor.worker.model.num_layers is set",
        ),
        (
            ["workers=megatron", "critic.worker.hf_checkpoint=/x"],
            ValueError,
            "critic.worker.hf_checkpoint is set",
        ),
        (
            ["workers=megatron", "actor.worker.model.attention=flash"],
            ValueError,
            "unknown actor.worker.model.attention",
        ),
        (["sft.lr=0"], ValueError, "sft.lr must be a finite number > 0"),
        (  # the monarch settings are MonarchConfig's, checked with the job (any backend)
            ["monarch.call_timeout=5"],
            ValueError,
            "unknown config key monarch.call_timeout (did you mean monarch.call_timeout_s?); valid keys under monarch:",
        ),
        (
            ["backend=monarch", "monarch.call_timeout_s=abc"],
            TypeError,
            "monarch.call_timeout_s must be a float",
        ),
        (["monarch.call_timeout_s=-1"], ValueError, "monarch.call_timeout_s must be a finite number > 0"),
        (["monarch.device=tpu"], ValueError, "unknown monarch.device 'tpu'; valid values: auto, cpu, cuda"),
        (  # float16 Adam state with the default eps: NaN at the first update
            ["model.dtype=float16"],
            ValueError,
            "model.dtype=float16 trains the torch workers' float16 parameters with float16 Adam state, and "
            "actor.worker.optim.eps=1e-08 is below float16's smallest normal number (6.1e-05;",
        ),
        (
            ["model.dtype=float16", "actor.worker.optim.eps=1e-4"],
            ValueError,
            "model.dtype=float16 trains the torch workers' float16 parameters with float16 Adam state, and "
            "critic.worker.optim.eps=1e-08",
        ),
        (["model.path=${vars.nope}"], ValueError, "model.path: cannot resolve an interpolation"),
        (["trainer.seed"], ValueError, "override 'trainer.seed' must be a dotted key, '=' and a YAML value"),
        (["=5"], ValueError, "override '=5' must be a dotted key"),
        (  # malformed YAML in a value: one error naming the override, no YAML traceback
            ["trainer.seed=1", "trainer.loggers=[console,"],
            ValueError,
            "cannot read the override 'trainer.loggers=[console,': ",
        ),
    ],
)
def test_errors_name_the_dotted_key(overrides, exc, start):
    _raises(exc, start, TINY, *overrides)


def test_an_unknown_worker_key_lists_the_moved_keys_apart():
    """``actor.worker.rollout`` and ``actor.worker.use_kl_loss`` are deprecated aliases: the valid keys under
    ``actor.worker`` leave them out and say where they moved."""
    with pytest.raises(ValueError) as err:
        load_job_config(TINY, ["actor.worker.bogus=1"])
    message = str(err.value)
    valid, moved = message.split("; valid keys under actor.worker: ")[1].split("; moved: ")
    assert "ppo_epochs" in valid.split(", ")
    assert not {"rollout", "use_kl_loss"} & set(valid.split(", "))
    assert moved == "actor.worker.rollout -> rollout, actor.worker.use_kl_loss -> actor.use_kl_loss"


def test_a_config_path_that_is_no_file_is_named(tmp_path):
    _raises(
        FileNotFoundError,
        f"config file {str(tmp_path / 'nope.yaml')!r} does not exist",
        str(tmp_path / "nope.yaml"),
    )
    _raises(
        FileNotFoundError, f"config file {str(tmp_path)!r} is a directory, not a YAML file", str(tmp_path)
    )


def test_yaml_errors(tmp_path):
    _raises(ValueError, "unknown config key trainer.bogus", _yaml(tmp_path, "trainer:\n  bogus: 1\n"))
    _raises(
        TypeError, "trainer must be a TrainerConfig or a dict, got int 3", _yaml(tmp_path, "trainer: 3\n")
    )
    _raises(TypeError, "the config must be a mapping", _yaml(tmp_path, "- a\n- b\n"))
    _raises(ValueError, "cannot read the config", _yaml(tmp_path, "a: [1\n"))
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_job_config(tmp_path / "nope.yaml")


def test_megatron_workers_accept_model_options_but_not_the_shape():
    from ppo_core.workers.megatron.config import MEGATRON_SHAPE_KEYS, MegatronActorConfig

    job = load_job_config(None, ["workers=megatron", "actor.worker.model.attention=local", "model.path=m"])
    assert isinstance(job.actor.worker, MegatronActorConfig) and job.actor.worker.model.attention == "local"
    written = job.to_dict()["actor"]["worker"]  # the shape is the run's (from model.path), not the job's
    assert written["model"]["attention"] == "local" and not set(MEGATRON_SHAPE_KEYS) & set(written["model"])
    assert "hf_checkpoint" not in written and JobConfig.from_dict(job.to_dict()) == job
    _raises(
        ValueError,
        "actor.worker.model.num_layers is set by the run from the model's checkpoint",
        None,
        "workers=megatron",
        "actor.worker.model.num_layers=2",
    )
    # the torch workers would not know these keys
    _raises(ValueError, "unknown config key actor.worker.model", None, "actor.worker.model.attention=local")


def test_defaults_build_a_torch_ppo_job():
    job = JobConfig()
    assert (job.backend, job.workers, job.run_dir) == ("local", "torch", "runs/ppo")
    assert job.use_critic  # gae by default
    assert JobConfig.from_dict(job.to_dict()) == job
    # the job leaves ppo_mini_batch_size to the worker's default (256), which must divide 8 x 1 to run
    with pytest.raises(ValueError, match=r"actor\.worker\.ppo_mini_batch_size=256 does not divide"):
        job.check_before_run()
    with pytest.raises(ValueError, match=r"actor\.worker\.ppo_mini_batch_size=256 does not divide"):
        job.ppo_config()  # what the trainer receives is what runs


# ----- the command line: overrides before or after the options ---------------------------------------------------
@pytest.mark.parametrize("after", [False, True])
def test_command_reads_overrides_on_either_side_of_the_options(after, capsys, tmp_path):
    from ppo_core_cli.main import main

    options = ["--timings-json", str(tmp_path / "t.json")]
    override = ["trainer.no_such_key=1"]
    argv = ["train", TINY, *(options + override if after else override + options)]
    assert main(argv) == 2  # the override reached the config loader, which names the dotted key
    assert "trainer.no_such_key" in capsys.readouterr().err


def test_command_still_rejects_unknown_options(capsys):
    from ppo_core_cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["train", TINY, "--no-such-option", "trainer.seed=1"])
    assert exc.value.code == 2
    assert "--no-such-option" in capsys.readouterr().err


def test_package_dir_interpolation_names_an_installed_package_folder(tmp_path, monkeypatch) -> None:
    """``${package_dir:NAME}`` is the folder of an installed package, found without importing it (its
    ``__init__`` raises here); a missing package is an error naming the key and the package."""
    pkg = tmp_path / "site" / "shipped_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs a dependency that is not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    job = load_job_config(None, ["model.path=${package_dir:shipped_model_pkg}"])
    assert job.model.path == str(pkg)
    with pytest.raises(ValueError, match=r"model\.path.*no installed Python package 'no_such_pkg_xyz'"):
        load_job_config(None, ["model.path=${package_dir:no_such_pkg_xyz}"])


def test_presets_fill_in_what_the_job_leaves_out(caplog):
    """The tiny config is ``preset: ppo``; ``preset=grpo`` switches the algorithm, explicit keys still win."""
    import logging

    tiny = load_job_config(TINY)
    assert tiny.preset == "ppo" and tiny.algorithm.adv_estimator == "gae" and tiny.algorithm.use_kl_in_reward
    grpo = load_job_config(TINY, ["preset=grpo"])
    assert grpo.algorithm.adv_estimator == "grpo" and not grpo.use_critic and grpo.rollout.n == 8
    assert grpo.actor.use_kl_loss and grpo.actor.worker.use_kl_loss and not grpo.algorithm.use_kl_in_reward
    with caplog.at_level(logging.INFO, logger="ppo_core_cli.loading"):
        mine = load_job_config(TINY, ["preset=grpo", "rollout.n=4"])
    assert mine.rollout.n == 4 and "preset grpo: the job's rollout.n=4 replaces the preset's 8" in caplog.text
    with pytest.raises(ValueError, match="unknown preset 'dapo'; valid values: grpo, ppo, rloo"):
        load_job_config(TINY, ["preset=dapo"])


def test_the_kl_loss_switch_reaches_the_worker():
    """``actor.use_kl_loss=true`` alone: the trainer computes reference log-probs and the worker's loss uses them."""
    from ppo_core.workers.torch import TorchActorConfig

    ppo = load_job_config(TINY, ["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false"]).ppo_config()
    assert (
        ppo.use_reference and isinstance(ppo.actor.worker, TorchActorConfig) and ppo.actor.worker.use_kl_loss
    )
    assert not load_job_config(TINY).ppo_config().actor.worker.use_kl_loss
