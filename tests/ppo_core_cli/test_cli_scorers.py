"""Custom rewards through the command: jobs with scorers are written to job.yaml and read back, a scorer module
next to the config is imported by the command wherever it runs, and one that cannot be is a one-line error naming
its key, found before any model loads."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("omegaconf")

from ppo_core_cli.config import JobConfig, ScorerConfig
from ppo_core_cli.job import resolve_scorer, resolve_scorers, scorer_search_path
from ppo_core_cli.loading import dump_job_config, load_job_config
from ppo_core_cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCORERS = [
    "reward.scorers.x.function=gsm8k",
    "reward.scorers.openai/gsm8k.function=math",
    "reward.scorers.openai/gsm8k.kwargs={format_score: 0.1, use_math_verify: false}",
    "reward.timeout_s=5",
]


# ----- job.yaml -------------------------------------------------------------------------------------------------
def test_a_job_with_scorers_round_trips_through_job_yaml(tmp_path):
    job = load_job_config(None, ["model.path=m", *SCORERS])
    assert isinstance(job.reward.scorers["x"], ScorerConfig)
    path = dump_job_config(job, tmp_path / "run" / "job.yaml")
    again = load_job_config(path)
    assert again == job
    assert again.reward.scorers["openai/gsm8k"].kwargs == {"format_score": 0.1, "use_math_verify": False}
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["job.yaml"]  # no temporary file left


def test_job_yaml_is_replaced_whole_or_not_at_all(tmp_path):
    job = load_job_config(None, ["model.path=m", *SCORERS])
    path = dump_job_config(job, tmp_path / "job.yaml")
    before = pathlib.Path(path).read_text()
    bad = dataclasses.replace(job, vars={"when": object()})  # a value YAML cannot write
    with pytest.raises(TypeError, match=r"^vars\.when: cannot write a object to job\.yaml"):
        dump_job_config(bad, path)
    assert pathlib.Path(path).read_text() == before  # the previous job.yaml, never an empty one
    assert os.listdir(tmp_path) == ["job.yaml"]


def test_job_yaml_writes_configs_nested_in_dicts_and_lists(tmp_path):
    job = load_job_config(None, ["model.path=m"])
    nested = dataclasses.replace(
        job, vars={"scorers": [ScorerConfig(function="math")], "path": pathlib.Path("a/b"), "t": (1, 2)}
    )
    text = pathlib.Path(dump_job_config(nested, tmp_path / "job.yaml")).read_text()
    again = load_job_config(tmp_path / "job.yaml")
    assert again.vars == {"scorers": [{"function": "math", "kwargs": {}}], "path": "a/b", "t": [1, 2]}, text


# ----- import path and errors -----------------------------------------------------------------------------------
SCORER_FILE = textwrap.dedent(
    """
    def score(solution_str, ground_truth, extra_info=None, bonus=0.0):
        return {"score": float(solution_str == ground_truth) + bonus, "exact": float(solution_str == ground_truth)}

    def one_arg(solution_str):
        return 0.0

    not_a_function = 3
    """
)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A config with a scorer module beside it, a working directory elsewhere, and sys.path restored after."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    module = (
        f"my_reward_{os.getpid()}_{len(list(tmp_path.parent.iterdir()))}"  # fresh per test: no import cache
    )
    (folder / f"{module}.py").write_text(SCORER_FILE)
    (folder / "broken_reward.py").write_text("import no_such_dependency_xyz\n")
    config = folder / "CONFIG.yaml"
    config.write_text("model:\n  path: /nowhere/model\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return folder, config, module


def test_a_scorer_beside_the_config_is_found_first(config_dir):
    folder, config, module = config_dir
    assert scorer_search_path(config) == [str(folder), os.getcwd()]
    job = load_job_config(
        config, [f"reward.scorers.t.function={module}:score", "reward.scorers.t.kwargs={bonus: 1}"]
    )
    scorer = resolve_scorers(job, config)["t"]
    assert scorer("7", "7", None) == {"score": 2.0, "exact": 1.0}
    assert sys.path[0] == str(folder)


@pytest.mark.parametrize(
    ("function", "kwargs", "message"),
    [
        (
            "no_such_reward_module:score",
            "{}",
            "reward.scorers.t.function='no_such_reward_module:score': cannot import module "
            "'no_such_reward_module' (looked in <folder>, <cwd>, then the installed packages): "
            "ModuleNotFoundError: No module named 'no_such_reward_module'",
        ),
        (
            "broken_reward:score",
            "{}",
            "reward.scorers.t.function='broken_reward:score': cannot import module 'broken_reward' (looked in "
            "<folder>, <cwd>, then the installed packages): ModuleNotFoundError: No module named "
            "'no_such_dependency_xyz'",
        ),
        (
            "<module>:scor",
            "{}",
            "reward.scorers.t.function='<module>:scor': module '<module>' (<folder>/<module>.py) has no "
            "attribute 'scor'",
        ),
        (
            "<module>:not_a_function",
            "{}",
            "reward.scorers.t.function='<module>:not_a_function' is not callable",
        ),
        (
            "<module>:score",
            "{bonnus: 1}",
            "reward.scorers.t.kwargs={'bonnus': 1}: <module>:score(solution_str, ground_truth, extra_info=None, "
            "bonus=0.0) cannot be called as a scorer, fn(solution_str, ground_truth, extra_info, **kwargs): got "
            "an unexpected keyword argument 'bonnus'",
        ),
        ("gsm8k", "{methd: flexible}", "reward.scorers.t.kwargs={'methd': 'flexible'}: gsm8k(solution_str"),
        (  # the function's own arguments are wrong, not the kwargs: the function's key is named
            "<module>:one_arg",
            "{bonus: 1}",
            "reward.scorers.t.function='<module>:one_arg': <module>:one_arg(solution_str) cannot be called as a "
            "scorer, fn(solution_str, ground_truth, extra_info, **kwargs): too many positional arguments",
        ),
    ],
)
def test_train_with_a_scorer_that_cannot_be_used_is_one_line_before_any_model_loads(
    config_dir, capsys, function, kwargs, message
):
    folder, config, module = config_dir
    fill = {"<folder>": str(folder), "<cwd>": os.getcwd(), "<module>": module}
    for marker, value in fill.items():
        function, message = function.replace(marker, value), message.replace(marker, value)
    # model.path does not exist: the scorer is checked before it is looked at
    argv = [
        "train",
        str(config),
        f"reward.scorers.t.function={function}",
        f"reward.scorers.t.kwargs={kwargs}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ppo-core: error: "), err
    assert err[len("ppo-core: error: ") :].startswith(message), err


def test_resolve_scorer_rejects_a_malformed_reference():
    with pytest.raises(ValueError, match="must be 'module:function'"):
        resolve_scorer(ScorerConfig(function="mod:"))


@pytest.mark.slow  # a fresh interpreter imports the command
def test_console_script_imports_the_scorer_beside_the_config_from_another_directory(tmp_path):
    """``python -m ppo_core_cli.main`` as the ``ppo-core`` script runs it: the working directory is elsewhere and
    the config's directory is on no import path until the command puts it there. Scorer ``a``, beside the config,
    imports; ``b`` does not exist: the one-line error names ``b`` only."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "beside_reward.py").write_text(SCORER_FILE)
    config = folder / "CONFIG.yaml"
    config.write_text(
        "model:\n  path: /nowhere/model\nreward:\n  scorers:\n"
        "    a: {function: 'beside_reward:score'}\n    b: {function: 'missing_reward:score'}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "ppo_core_cli.main", "train", str(config)]
    done = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "ppo-core: error: reward.scorers.b.function='missing_reward:score': cannot import module "
        f"'missing_reward' (looked in {folder}, {tmp_path}, then the installed packages): ModuleNotFoundError: "
        "No module named 'missing_reward'"
    ), done.stderr
    assert "beside_reward" not in done.stderr


def test_the_job_reads_timeout_s():
    assert JobConfig.from_dict({}).reward.timeout_s == 60.0
    assert load_job_config(None, ["reward.timeout_s=null"]).reward.timeout_s is None
    with pytest.raises(ValueError, match=r"reward\.timeout_s must be a finite number > 0"):
        load_job_config(None, ["reward.timeout_s=0"])


def test_the_readme_scorer_is_a_valid_scorer(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\n# my_reward.py\n") + len("```python\n")
    (tmp_path / "readme_reward.py").write_text(readme[start : readme.index("```", start)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    job = load_job_config(
        None, ["reward.scorers.s.function=readme_reward:score", "reward.scorers.s.kwargs={b: 1}"]
    )
    scorer = resolve_scorers(job, tmp_path / "CONFIG.yaml")["s"]
    assert scorer("so #### 7", 7, None) == {"score": 1.0, "acc": 1.0}
    assert scorer("so #### 8", "7", {}) == {"score": 0.0, "acc": 0.0}
