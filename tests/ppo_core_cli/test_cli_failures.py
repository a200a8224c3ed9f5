"""A run stopped by the user's scorer: one message naming the scorer, data source, row, step and the user's line,
the whole traceback in the run's ``reward_error.txt`` (``ppo_core_cli.failures`` and ``ppo-core train``)."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys

import pytest

from ppo_core.rewards.reward_fn import ScorerError
from ppo_core.trainer.reward import RewardFunctionError
from ppo_core_cli.failures import reward_failure_message, user_frame, write_traceback
from ppo_core_cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCORER = "def score(solution_str, ground_truth, extra_info=None, **kwargs):\n    return 1.0 / 0\n"


def _load(path):
    spec = importlib.util.spec_from_file_location(f"user_scorer_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _failure(path) -> RewardFunctionError:
    """The chain the trainer raises: the scorer's error, wrapped by the reward, wrapped by the trainer."""
    scorer = _load(path).score
    try:
        try:
            try:
                scorer("x", "1")
            except ZeroDivisionError as exc:
                raise ScorerError(
                    "raised ZeroDivisionError: float division by zero", "task/a", "m.score", 3
                ) from exc
        except ScorerError as exc:
            raise RewardFunctionError(5, _empty_batch(), f"ScorerError: {exc}", "reward") from exc
    except RewardFunctionError as exc:
        return exc
    raise AssertionError("the scorer did not raise")


def _empty_batch():
    from tensordict import TensorDict

    return TensorDict({}, batch_size=[0])


def test_user_frame_is_the_users_line(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SCORER)
    assert user_frame(_failure(path)) == f"{path}:2 in score"


def test_user_frame_reads_a_process_pools_traceback_text(tmp_path):
    remote = RuntimeError("in the pool")
    remote.tb = (  # what concurrent.futures' _RemoteTraceback carries
        'Traceback (most recent call last):\n  File "/usr/lib/python3.11/concurrent/futures/process.py", line 1, '
        f'in _process_worker\n  File "{tmp_path}/r.py", line 7, in score\nZeroDivisionError\n'
    )
    err = ValueError("outer")
    err.__cause__ = remote
    assert user_frame(err) == f"{tmp_path}/r.py:7 in score"


def test_no_user_frame_when_only_library_code_ran():
    import ppo_core

    remote = RuntimeError("in the pool")
    remote.tb = (
        f'  File "{ppo_core.__file__}", line 3, in f\n  File "{importlib.util.__file__}", line 9, in g\n'
        '  File "<frozen runpy>", line 1, in h\n'
    )
    # ppo-core's, the standard library's and frozen frames are not the user's
    assert user_frame(remote) is None
    assert user_frame(ValueError("never raised")) is None


def test_message_names_scorer_step_line_and_traceback_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(SCORER)
    exc = _failure(path)
    trace = write_traceback(exc, str(tmp_path / "run" / "reward_error.txt"))
    text = reward_failure_message(exc, trace)
    assert text == (
        "scorer m.score of data_source 'task/a' (row 3) raised ZeroDivisionError: float division by zero (step 5); "
        f"at {path}:2 in score; traceback: {trace}"
    )
    written = (tmp_path / "run" / "reward_error.txt").read_text()
    assert "ZeroDivisionError" in written and "RewardFunctionError" in written and "return 1.0 / 0" in written


def test_message_without_a_scorer_error_is_the_reward_functions():
    exc = RewardFunctionError(2, _empty_batch(), "ValueError: bad shape", "my_fn")
    assert reward_failure_message(exc) == str(exc)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("fail")
    assert main(["-q", "make-data", str(root / "ex"), "--n-train", "16", "--n-test", "4"]) == 0
    return root


def _argv(data, run_dir, *extra, config=None):
    """``ppo-core -q train`` of ``config`` (None: the tiny example's) on the example's ``data`` folder: 4 prompts a
    step, 4 new tokens, no validation before training (``extra`` overrides last)."""
    return [
        "-q",
        "train",
        str(config or ROOT / "examples" / "configs" / "tiny_cpu.yaml"),
        f"model.path={data}/model",
        f"data.train_files=[{data}/data/train.parquet]",
        f"data.val_files=[{data}/data/test.parquet]",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "rollout.max_new_tokens=4",
        "actor.worker.ppo_mini_batch_size=4",
        "critic.worker.ppo_mini_batch_size=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        f"run_dir={run_dir}",
        *extra,
    ]


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ppo-core: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return err[err.index("ppo-core: error: ") :]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_train_stops_on_a_raising_scorer_with_one_message(
    example, tmp_path, capsys, monkeypatch, num_workers
):
    (tmp_path / "boom_reward.py").write_text(SCORER)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = tmp_path / "job.yaml"
    config.write_text("reward:\n  scorers: { '*': { function: boom_reward:score } }\n")
    extra = ("trainer.total_training_steps=1", f"reward.num_workers={num_workers}")
    assert main(_argv(example / "ex", tmp_path / "run", *extra, config=config)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("ppo-core: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "scorer boom_reward.score of data_source" in lines[0] and "(step 1)" in lines[0]
    assert f"at {tmp_path / 'boom_reward.py'}:2 in score" in lines[0]
    assert (tmp_path / "run" / "reward_error.txt").is_file()


def test_rerunning_off_the_path_ends_in_one_message(example, tmp_path, capsys):
    """A run, then: a rerun with another model (the KL reference would change under the checkpoint's weights), a
    tokenizer without the named EOS, every checkpoint truncated (train and export): one ``ppo-core: error:``
    message each, exit 2, no traceback."""
    data, run = example / "ex", tmp_path / "run"
    assert main(_argv(data, run, "trainer.total_training_steps=1", "trainer.save_freq=1")) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    assert main(["-q", "make-data", str(other), "--n-train", "16", "--n-test", "4", "--seed", "7"]) == 0
    capsys.readouterr()
    more = ("trainer.total_training_steps=2", "trainer.save_freq=1")
    assert main(_argv(data, run, *more, f"model.path={other}/model")) == 2
    message = _one_error(capsys)
    assert "actor.worker.hf_checkpoint:" in message and "are the job's model.path" in message
    assert "trainer.resume_allow_changes: [model.path] allows it" in message
    allowed = "trainer.resume_allow_changes=[model.path]"
    assert (
        main(_argv(data, tmp_path / "fresh", "trainer.total_training_steps=1", allowed)) == 0
    )  # accepted key
    capsys.readouterr()
    assert main(_argv(data, run, *more, "trainer.resume_allow_changes=[model.pth]")) == 2
    assert "names 'model.pth', which is no key of the job (did you mean model.path?)" in _one_error(capsys)
    # allowed: resumes; a model of another shape (its own vocabulary) then cannot take the checkpoint's weights
    assert main(_argv(data, run, *more, f"model.path={other}/model", allowed)) == 2
    message = _one_error(capsys)
    assert (
        "the checkpoint's weights do not fit the model of model.path=" in message
        and "size mismatch" in message
    )
    same = tmp_path / "same"
    shutil.copytree(data / "model", same)
    assert main(_argv(data, run, *more, f"model.path={same}", allowed)) == 0
    assert "(resumed)" in capsys.readouterr().out
    assert main(_argv(data, run, *more, "model.eos_token=<|nope|>")) == 2
    assert "model.eos_token='<|nope|>' is not a token of the tokenizer" in _one_error(capsys)
    for rank_file in run.glob("checkpoints/global_step_*/actor/rank_0.pt"):
        rank_file.write_bytes(rank_file.read_bytes()[:100])
    assert main(_argv(data, run, *more)) == 2
    message = _one_error(capsys)
    assert (
        message.startswith("ppo-core: error: no intact checkpoint under")
        and "trainer.resume_mode=disable" in message
    )
    step = next(run.glob("checkpoints/global_step_*"))
    assert main(["export", str(step), str(tmp_path / "out")]) == 2
    assert "has 100 bytes but" in _one_error(capsys)


def test_a_data_source_without_a_scorer_is_named_before_any_model_loads(
    example, tmp_path, capsys, monkeypatch
):
    """Prompts whose data_source no scorer matches: train and eval name the file key, the source and what to add
    to the job, before the models load (the run used to stop at the first step, after validation)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ppo_core_cli.job as job_module

    data = example / "ex"
    table = pq.read_table(data / "data" / "train.parquet")
    column = table.schema.get_field_index("data_source")
    table = table.set_column(column, "data_source", pa.array(["mystery"] * table.num_rows))
    pq.write_table(table, tmp_path / "mystery.parquet")
    import ppo_core_cli.train as train_module

    loaded = []
    build = job_module.build_trainer
    for module in (
        job_module,
        train_module,
    ):  # eval imports it from the job module when it runs, train at import
        monkeypatch.setattr(module, "build_trainer", lambda *a, **k: loaded.append(1) or build(*a, **k))
    mystery = f"[{tmp_path}/mystery.parquet]"
    assert (
        main(_argv(data, tmp_path / "run", "trainer.total_training_steps=1", f"data.train_files={mystery}"))
        == 2
    )
    message = _one_error(capsys)
    assert message.startswith("ppo-core: error: data.train_files: no scorer for data_source 'mystery'")
    assert "reward.scorers: {'mystery': {function: my_module:score}}" in message and "openai/gsm8k" in message
    # in-process: the run's folder lock is released though the caller keeps the exception (and its traceback)
    from ppo_core_cli.loading import load_job_config
    from ppo_core_cli.train import JobInputError, _lock_run_dir, run_train

    argv = _argv(data, tmp_path / "run", f"data.train_files={mystery}")
    with pytest.raises(JobInputError) as kept:
        run_train(load_job_config(argv[2], argv[3:]))
    _lock_run_dir(str(tmp_path / "run")).close()  # not refused: the failed run let go of it
    assert "no scorer for data_source" in str(kept.value)
    eval_argv = [
        "-q",
        "eval",
        str(ROOT / "examples" / "configs" / "tiny_cpu.yaml"),
        f"model.path={data}/model",
    ]
    assert main([*eval_argv, f"data.val_files={mystery}", "data.max_prompt_length=64"]) == 2
    assert "data.val_files: no scorer for data_source 'mystery'" in _one_error(capsys)
    assert loaded == []  # no worker was built


def test_a_second_run_into_the_same_folder_is_refused(tmp_path):
    """Two runs writing one folder's checkpoints and metrics would corrupt each other: the second is refused naming
    the first's pid, and the folder is free again once the first has closed its lock (or ended)."""
    import os

    from ppo_core_cli.train import JobInputError, _lock_run_dir

    first = _lock_run_dir(str(tmp_path / "run"))
    with pytest.raises(JobInputError, match=rf"another ppo-core run \(pid {os.getpid()}\) is writing to "):
        _lock_run_dir(str(tmp_path / "run"))
    first.close()
    _lock_run_dir(str(tmp_path / "run")).close()


def test_workers_that_cannot_be_built_from_the_job_are_one_line(example, tmp_path, capsys):
    """An engine setting the model does not support (the fused path forced for a GPT-2) stops where the workers
    are built, in one line naming the setting's complaint."""
    import transformers

    data = example / "ex"
    gpt2 = tmp_path / "gpt2"
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=512, n_embd=16, n_layer=1, n_head=2, n_positions=128)
    )
    model.save_pretrained(gpt2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / "model" / name, gpt2 / name)
    extra = ("trainer.total_training_steps=1", "rollout.engine=hf", "rollout.engine_config.fast_path=true")
    assert main(_argv(data, tmp_path / "run", f"model.path={gpt2}", *extra)) == 2
    assert _one_error(capsys).startswith(
        "ppo-core: error: the workers cannot be built from this job: fast_path=True but GPT2LMHeadModel is not"
    )
