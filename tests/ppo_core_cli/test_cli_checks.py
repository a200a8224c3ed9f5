"""``ppo-core train``, ``eval`` and ``sft`` check the job's files and mini-batch rules before anything loads: one
``ppo-core: error:`` line naming the key and the path or values, exit status 2 (no traceback)."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("omegaconf")

from ppo_core_cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")


@pytest.fixture
def root(tmp_path):
    """An example root with a fake checkpoint (config.json) and prompt files that exist, nothing loadable."""
    for d in ("sft_model", "model"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    for f in ("train.parquet", "test.parquet", "sft.parquet"):
        (tmp_path / "data" / f).write_bytes(b"")
    return tmp_path


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppo-core: error: "), captured.err
    return lines[0].removeprefix("ppo-core: error: ")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "data.train_files=[{r}/data/nope.parquet]",
            "data.train_files[0]='{r}/data/nope.parquet': no such file",
        ),
        (
            "data.val_files=[{r}/data/test.parquet,{r}/x.jsonl]",
            "data.val_files[1]='{r}/x.jsonl': no such file",
        ),
        ("model.path={r}/none", "model.path='{r}/none': no such directory"),
        ("model.path={r}/data", "model.path='{r}/data' is not a Hugging Face checkpoint directory"),
        (
            "model.path={r}/data/test.parquet",
            "model.path='{r}/data/test.parquet' is a file, not a Hugging Face checkpoint directory",
        ),
        ("model.tokenizer_path={r}/tok", "model.tokenizer_path='{r}/tok': no such directory"),
        ("model.critic_path={r}/data", "model.critic_path='{r}/data' is not a Hugging Face checkpoint"),
        (
            "data.train_batch_size=96",
            "actor.worker.ppo_mini_batch_size=64 does not divide the responses of a step, "
            "data.train_batch_size x rollout.n = 96 x 1 = 96",
        ),
        (
            "critic.worker.ppo_mini_batch_size=48",
            "critic.worker.ppo_mini_batch_size=48 does not divide the responses of a step, "
            "data.train_batch_size x rollout.n = 128 x 1 = 128",
        ),
        (
            "actor.worker.use_reference=false",
            "actor.worker.use_reference=false, but algorithm.use_kl_in_reward",
        ),
        (
            "critic.enable=false",
            "algorithm.adv_estimator='gae' needs the critic's values, but critic.enable=False",
        ),
        (
            "rollout.engine=megatron",
            "rollout.engine='megatron' samples with the megatron actor's policy: it needs the megatron workers",
        ),
        (
            "model.attn_implementation=bogus",
            "unknown model.attn_implementation 'bogus'; valid values: eager,",
        ),
        (
            "trainer.resume_from_path={r}/model",
            "trainer.resume_from_path='{r}/model' is set but resume_mode is 'auto', which does not read it",
        ),
        (
            "trainer.resume_mode=path trainer.resume_from_path={r}/nope",
            "trainer.resume_from_path '{r}/nope' does not exist",
        ),
        (
            "trainer.resume_mode=path trainer.resume_from_path={r}/model",
            "trainer.resume_from_path '{r}/model' is not a checkpoint folder (no trainer_state.pt)",
        ),
    ],
)
def test_train_names_the_key_before_anything_loads(root, capsys, override, expected):
    r = str(root)
    overrides = override.format(r=r).split(" ")
    assert _error(capsys, "train", TINY, f"vars.root={r}", *overrides).startswith(expected.format(r=r))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the check for a machine without CUDA")
def test_settings_that_need_cuda_are_refused_without_it_before_anything_loads(root, capsys):
    r = str(root)
    message = _error(
        capsys, "train", TINY, f"vars.root={r}", "rollout.engine=hf", "rollout.engine_config.cuda_graphs=true"
    )
    assert message.startswith(
        "rollout.engine_config.cuda_graphs=true captures the decode steps as CUDA graphs"
    )


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("algorithm.adv_estimator=remax", "algorithm.adv_estimator='remax'"),
    ],
)
def test_resident_batches_refuse_what_they_do_not_serve_before_anything_loads(root, capsys, override, named):
    r = str(root)
    line = _error(capsys, "train", TINY, f"vars.root={r}", override, "trainer.resident_batches=true")
    assert line.startswith(f"trainer.resident_batches=True does not support {named}"), line


def test_a_worker_default_that_breaks_the_rule_is_found_too(root, capsys):
    # the tiny config without its mini-batch sizes: the workers' default (256) does not divide 128 x 1
    text = (pathlib.Path(TINY).read_text()).replace("ppo_mini_batch_size: 64", "")
    config = root / "job.yaml"
    config.write_text(text)
    err = _error(capsys, "train", str(config), f"vars.root={root}")
    assert err.startswith("actor.worker.ppo_mini_batch_size=256 does not divide"), err


def test_sft_names_the_key(root, capsys):
    r = str(root)
    assert (
        _error(capsys, "sft", TINY, f"vars.root={r}", f"sft.model_path={r}/x")
        == f"sft.model_path='{r}/x': no such directory"
    )
    err = _error(capsys, "sft", TINY, f"vars.root={r}", f"sft.files=[{r}/p.parquet]")
    assert err == f"sft.files[0]='{r}/p.parquet': no such file"


def test_the_tiny_config_asks_only_for_loggers_that_make_install_installs():
    from ppo_core_cli.loading import load_job_config

    assert set(load_job_config(TINY).trainer.loggers) <= {"console", "jsonl"}


def test_a_gguf_model_passes_the_check_and_is_converted_after_it(root, capsys):
    """``model.path`` may name a GGUF file or a folder holding one: the check accepts it, and a bad prompt file is
    named before any conversion starts; with the files right, the conversion names the bad GGUF file."""
    r = str(root)
    (root / "gguf").mkdir()
    (root / "gguf" / "m.gguf").write_bytes(b"not a model")
    common = ["train", TINY, f"vars.root={r}", f"model.path={r}/gguf", f"model.convert_dir={r}/converted"]
    err = _error(capsys, *common, f"data.train_files=[{r}/none.parquet]")
    assert err == f"data.train_files[0]='{r}/none.parquet': no such file"
    assert not (root / "converted").exists()
    assert "m.gguf" in _error(capsys, *common)
    err = _error(capsys, "train", TINY, f"vars.root={r}", f"model.path={r}/missing.gguf")
    assert err == f"model.path: the GGUF file '{r}/missing.gguf' does not exist"


def test_eval_checks_its_files_with_the_preset_applied(root, capsys):
    r = str(root)
    assert (
        _error(capsys, "eval", TINY, f"vars.root={r}", f"data.val_files=[{r}/v.parquet]")
        == f"data.val_files[0]='{r}/v.parquet': no such file"
    )
    assert (
        _error(capsys, "eval", TINY, f"vars.root={r}", "--model", f"{r}/none")
        == f"model.path='{r}/none': no such directory"
    )
    # 256 divides the preset's 128 x 8 responses of a step, not the tiny config's own 128 x 1
    big = ["actor.worker.ppo_mini_batch_size=256", "critic.worker.ppo_mini_batch_size=256"]
    assert "does not divide" in _error(capsys, "eval", TINY, f"vars.root={r}", *big)
    err = _error(
        capsys, "eval", TINY, f"vars.root={r}", "preset=grpo", *big, f"data.val_files=[{r}/v.parquet]"
    )
    assert err == f"data.val_files[0]='{r}/v.parquet': no such file"


def test_eval_builds_a_critic_free_job_from_a_gae_one():
    """The tiny config is GAE with a critic; the evaluation drops the critic, so the estimator must not need it
    (the config rules hold when the job is built)."""
    from ppo_core_cli.evaluate import _actor_only
    from ppo_core_cli.loading import load_job_config

    job = _actor_only(load_job_config(TINY))
    assert not job.use_critic and job.algorithm.adv_estimator == "reinforce_plus_plus"
    grpo = load_job_config(TINY, ["preset=grpo"])
    assert _actor_only(grpo).algorithm == grpo.algorithm


def test_eval_warns_of_no_training_steps():
    """The evaluation's trainer draws no training batch (its training set is one batch of validation prompts): the
    start warning about trainer.total_training_steps beyond the epochs is not the evaluation's."""
    from ppo_core.trainer.config import start_warnings
    from ppo_core_cli.evaluate import _actor_only
    from ppo_core_cli.loading import load_job_config

    job = load_job_config(TINY)
    assert start_warnings(job, steps_per_epoch=1)  # the tiny job's 200 steps, were it trained on one batch
    assert start_warnings(_actor_only(job), steps_per_epoch=1) == []


@pytest.mark.parametrize("command", ["eval", "train"])
def test_an_output_file_that_cannot_be_written_is_refused_before_anything_loads(root, capsys, command):
    r = str(root)
    option = "--json" if command == "eval" else "--timings-json"
    (root / "a_file").write_text("")
    for path, expected in (
        (r, f"{option} {r!r} is a directory; name the file to write"),
        (f"{r}/a_file/out.json", f"{option} '{r}/a_file/out.json': '{r}/a_file' is a file, not a folder"),
    ):
        assert _error(capsys, command, TINY, f"vars.root={r}", option, path) == expected


def test_check_output_file_accepts_a_new_file_in_folders_still_to_be_made(tmp_path):
    from ppo_core_cli.checks import check_output_file

    check_output_file("--json", str(tmp_path / "new" / "deeper" / "eval.json"))
    check_output_file("--json", None)
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_eval_of_a_training_checkpoint_points_to_export(root, capsys):
    r = str(root)
    step = root / "checkpoints" / "global_step_2"
    (step / "actor").mkdir(parents=True)
    line = _error(capsys, "eval", TINY, f"vars.root={r}", "--model", str(step))
    assert line.startswith(f"model.path={str(step)!r} is not a Hugging Face checkpoint directory"), line
    assert "it looks like a training checkpoint: `ppo-core export CHECKPOINT_DIR OUT_DIR`" in line


def test_export_into_a_file_is_refused_before_anything_loads(root, capsys):
    r = str(root)
    step = root / "checkpoints" / "global_step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")  # never read: the output folder is checked first
    (root / "a_file").write_text("")
    for out, expected in (
        (f"{r}/a_file", f"OUT_DIR {r + '/a_file'!r} is a file, not a folder"),
        (
            f"{r}/a_file/export",
            f"OUT_DIR {r + '/a_file/export'!r}: {r + '/a_file'!r} is a file, not a folder",
        ),
    ):
        assert _error(capsys, "export", str(step), out) == expected


@pytest.mark.parametrize("command", ["train", "eval"])
def test_workers_that_need_cuda_are_refused_without_it_before_anything_loads(
    root, capsys, monkeypatch, command
):
    import torch

    from ppo_core_cli.checks import check_train_inputs
    from ppo_core_cli.loading import load_job_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _error(capsys, command, TINY, f"vars.root={root}", "workers=megatron")
    assert line == (
        "workers=megatron needs CUDA (its training engine allocates its buffers on the GPU), and "
        "torch.cuda.is_available() is False here; use workers=torch on this machine"
    )
    check_train_inputs(load_job_config(TINY, [f"vars.root={root}"]))  # the torch workers run anywhere
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_train_inputs(load_job_config(TINY, [f"vars.root={root}", "workers=megatron"]))


def test_make_data_into_a_file_is_one_line(tmp_path, capsys):
    """``make-data OUT_DIR`` where OUT_DIR is a file, or lies below one: named before anything is written."""
    a_file = tmp_path / "job.yaml"
    a_file.write_text("x: 1\n")
    assert _error(capsys, "make-data", str(a_file)) == f"OUT_DIR {str(a_file)!r} is a file, not a folder"
    below = str(a_file / "ex")
    assert _error(capsys, "make-data", below) == f"OUT_DIR {below!r}: {str(a_file)!r} is a file, not a folder"
    assert a_file.read_text() == "x: 1\n"


def test_a_run_folder_as_the_model_points_at_its_export(root, capsys):
    run = root / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text("{}")
    err = _error(capsys, "eval", TINY, f"vars.root={root}", f"model.path={run}")
    assert err.endswith(f"; it looks like a run's folder: its exported model is {str(run / 'export')!r}"), err


def test_convert_verl_into_a_folder_is_one_line(tmp_path, capsys):
    verl = tmp_path / "verl.yaml"
    verl.write_text("actor_rollout_ref:\n  rollout:\n    n: 2\n")
    assert _error(capsys, "convert-verl", str(verl), "-o", str(tmp_path)) == (
        f"-o {str(tmp_path)!r} is a directory; name the file to write"
    )


def test_small_off_path_messages(tmp_path, capsys):
    """Each one ``ppo-core: error:`` line naming what is wrong (they were a decode error without a file name, a
    "does not exist" for a folder that exists, an empty training set written, a range that did not match the
    check)."""
    binary = tmp_path / "prompts.parquet"
    binary.write_bytes(b"PAR1\x80\x81\x00\xff")
    assert _error(capsys, "train", str(binary)) == f"cannot read the config {binary}: not a text (YAML) file"
    assert _error(capsys, "convert-verl", str(binary)).endswith("not a text (YAML) file")
    assert "is a folder; name the YAML file" in _error(capsys, "convert-verl", str(tmp_path))
    assert (
        _error(capsys, "make-data", str(tmp_path / "d"), "--n-train", "0") == "--n-train must be >= 1, got 0"
    )
    assert (
        _error(capsys, "make-data", str(tmp_path / "d"), "--n-test", "-5") == "--n-test must be >= 0, got -5"
    )
    assert not (tmp_path / "d").exists()
    assert _error(capsys, "config", TINY, "rollout.top_p=1.5") == "rollout.top_p must be in (0, 1], got 1.5"
