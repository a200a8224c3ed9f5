"""The config reference (``ppo-core config``): help from the field docstrings, the YAML of a job with every default
(read back, the same job), the committed reference page equal to what the generator prints."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import pytest
import yaml

pytest.importorskip("omegaconf")

from ppo_core._config_base import ConfigBase
from ppo_core_cli.config import JobConfig, worker_config_classes
from ppo_core_cli.loading import load_job_config
from ppo_core_cli.main import main
from ppo_core_cli.reference import REGENERATE, config_keys, field_help, render_markdown, render_yaml

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PAGE = os.path.join(ROOT, "docs", "config-reference.md")
CONFIGS = os.path.join(ROOT, "examples", "configs")


@dataclass(kw_only=True)
class _Base(ConfigBase):
    """A config to read docstrings from."""

    alpha: int = 1
    """The first
    key, on ``two`` lines (see :class:`~ppo_core.trainer.PPOConfig`)."""
    beta: str = "b"
    gamma: float = 0.5
    """Gamma."""


@dataclass(kw_only=True)
class _Child(_Base):
    """Overrides one docstring."""

    gamma: float = 0.25
    """Gamma, redefined."""


def test_help_is_the_field_docstring_on_one_line_from_the_class_that_declares_it():
    assert field_help(_Base, "alpha") == "The first key, on `two` lines (see `PPOConfig`)."
    assert field_help(_Base, "beta") == ""  # no docstring
    assert field_help(_Child, "alpha") == field_help(_Base, "alpha")
    assert (field_help(_Base, "gamma"), field_help(_Child, "gamma")) == ("Gamma.", "Gamma, redefined.")


@pytest.mark.parametrize("workers", ["torch", "megatron"])
def test_every_key_of_a_job_has_help_and_every_worker_key_is_listed(workers):
    keys = config_keys(JobConfig.from_dict({"workers": workers}))
    assert [k.path for k in keys if not k.help] == []
    paths = {k.path for k in keys}
    actor_cls, critic_cls = worker_config_classes(workers)
    for role, cls in (("actor", actor_cls), ("critic", critic_cls)):
        flat = _flat(cls.unresolved({}).to_dict(), f"{role}.worker.")
        shown_elsewhere = {
            k for k in flat if k.startswith(("actor.worker.rollout.", "actor.worker.use_kl_loss"))
        }
        assert set(flat) - shown_elsewhere <= paths
        assert (
            not shown_elsewhere & paths
        )  # the actor's sampling and KL switch: at rollout.*, actor.use_kl_loss


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same_job(a: JobConfig, b: JobConfig) -> None:
    """Equal sections, typed worker configs included."""
    for f in dataclasses.fields(JobConfig):
        assert getattr(a, f.name) == getattr(b, f.name), f.name


_OVERRIDES = [
    [
        "workers=megatron",
        "backend=monarch",
        "actor.world_size=2",
        "critic.world_size=2",
        "actor.worker.parallel.tensor_model_parallel_size=2",
    ],
    ["reward.scorers.x.function=math", "reward.scorers.x.kwargs={a: 1}", "trainer.seed=3"],
    ["actor.use_kl_loss=true", "rollout.eos_token_id=5", "data.train_files=[a.parquet,b.jsonl]"],
    ["actor.worker.rollout.temperature=0.5", "actor.worker.use_kl_loss=true"],  # deprecated keys
]


@pytest.mark.parametrize(
    ("name", "overrides"),
    [(None, []), *((name, []) for name in sorted(os.listdir(CONFIGS))), *((None, o) for o in _OVERRIDES)],
)
def test_the_yaml_of_a_job_reads_back_as_the_same_job(tmp_path, name, overrides):
    job = load_job_config(None if name is None else os.path.join(CONFIGS, name), overrides)
    text = render_yaml(job)
    path = tmp_path / "full.yaml"
    path.write_text(text)
    _same_job(load_job_config(path), job)
    bare = tmp_path / "bare.yaml"
    bare.write_text(render_yaml(job, help=False))
    _same_job(load_job_config(bare), job)
    comments = [line.strip() for line in bare.read_text().splitlines() if line.strip().startswith("#")]
    assert all(re.fullmatch(r"# \w+: [^#]*\(.+\)", line) for line in comments), comments  # keys only, no help


def test_the_yaml_says_which_keys_the_run_sets():
    text = render_yaml(load_job_config(None, ["workers=megatron"]))
    assert "# num_layers: (set by the run from model.path's config.json)" in text
    assert "# dtype: (set by the run from model.dtype)" in text
    assert "# value_head_init_std: (set by the run from model.value_head_init_std)" in text
    assert (
        "# ppo_mini_batch_size: 256 (not set: the worker's default; it must divide data.train_batch_size x "
        "rollout.n to run)" in text
    )
    tree = yaml.safe_load(text)
    assert "rollout" not in tree["actor"]["worker"] and "use_kl_loss" not in tree["actor"]["worker"]
    assert tree["rollout"]["max_new_tokens"] == 16 and tree["rollout"]["eos_token_id"] is None
    set_eos = render_yaml(load_job_config(None, ["rollout.eos_token_id=5"]))
    assert yaml.safe_load(set_eos)["rollout"]["eos_token_id"] == 5


def test_help_comments_sit_above_their_keys():
    lines = render_yaml(JobConfig.from_dict({})).splitlines()
    i = lines.index("  total_training_steps: null")
    help_lines = []
    while lines[i - 1].lstrip().startswith("#"):
        i -= 1
        help_lines.insert(0, lines[i].strip("# "))
    assert " ".join(help_lines) == field_help(type(JobConfig().trainer), "total_training_steps").replace(
        "`", ""
    )


def test_the_committed_reference_page_is_what_the_generator_prints():
    with open(PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == render_markdown(), f"docs/config-reference.md is stale: run `{REGENERATE}`"


def test_the_page_lists_every_key_with_its_default():
    page = render_markdown()
    for workers in ("torch", "megatron"):
        assert f"### `actor.worker` with `workers: {workers}`" in page
        assert f"### `critic.worker` with `workers: {workers}`" in page
    assert "| `total_training_steps` | `int \\| None` | `null` |" in page
    assert "| `ppo_mini_batch_size` | `int` | `256` |" in page
    assert "| `call_timeout_s` | `float` | `1800.0` |" in page  # the monarch mapping's keys
    assert "| `function` | `str` | `gsm8k` |" in page  # a scorer entry's keys


def test_the_config_command(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("trainer:\n  seed: 4\n")
    assert main(["config", str(job), "trainer.total_epochs=2"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert (tree["trainer"]["seed"], tree["trainer"]["total_epochs"]) == (4, 2)
    assert main(["config", "--defaults", "workers=megatron", "--no-comments"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["workers"] == "megatron" and "# Seeds" not in out
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown()
    assert main(["config"]) == 2
    assert "config needs a job file" in capsys.readouterr().err
    assert main(["config", "--defaults", "trainer.sed=1"]) == 2
    assert "unknown config key trainer.sed" in capsys.readouterr().err
    assert main(["config", "--markdown", "trainer.seed=1"]) == 2
    capsys.readouterr()
    # options between the job file and its overrides, as train and eval take them
    assert main(["config", str(job), "--no-comments", "trainer.total_epochs=3"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["trainer"]["total_epochs"] == 3 and "# Seeds" not in out
    assert main(["config", str(job), "--defaults"]) == 2
    assert f"config --defaults takes no job file ({str(job)!r})" in capsys.readouterr().err


def test_train_help_says_where_the_reference_is(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "ppo-core config --defaults" in out and "docs/config-reference.md" in out


def test_scorer_patterns_that_yaml_must_quote_read_back(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        'reward:\n  scorers:\n    "*gsm8k*": {function: math}\n'
        '    "my.source": {function: gsm8k, kwargs: {method: flexible}}\n'
    )
    job = load_job_config(job_file)
    full = tmp_path / "full.yaml"
    full.write_text(render_yaml(job))
    _same_job(load_job_config(full), job)
    assert {k.path: k.name for k in config_keys(job)}["reward.scorers.my.source.function"] == "function"
