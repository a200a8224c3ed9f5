"""The README's "Post-train any Hugging Face model" path, short: ``ppo-core make-data``, ``sft``, ``train`` (with the
timings JSON), resume through the command, ``export``; the exports load in ``transformers`` with the trained actor's
logits. The learning itself (validation reward +0.3) takes minutes and is the README's claim, not this test's."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("omegaconf")

from ppo_core.models import load_causal_lm  # noqa: E402
from ppo_core.trainer import read_metrics_jsonl  # noqa: E402
from ppo_core.trainer.completions import read_completions  # noqa: E402
from ppo_core_cli.main import main  # noqa: E402
from ppo_core_cli.timings import STAGES  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu.yaml")
# a short version of the tiny config: small batches, a few steps
SHORT = [
    "data.train_batch_size=16",
    "actor.worker.ppo_mini_batch_size=8",
    "critic.worker.ppo_mini_batch_size=8",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
    "trainer.progress_bar=false",
    "trainer.loggers=[console,jsonl]",
    "actor.worker.entropy_coeff=0.01",  # the actor moves even when every sampled answer scores 0
]


def _run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _printed(out: str, label: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(f"{label}:")]
    assert len(lines) == 1, out
    return lines[0].split(":", 1)[1].strip()


def _logits(model_dir: str, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _actor_logits(checkpoint: str, base: str, ids: torch.Tensor) -> torch.Tensor:
    """The trained actor, from its checkpoint file, through ppo-core's own model wrapper."""
    model = load_causal_lm(base).eval()
    model.load_state_dict(
        torch.load(os.path.join(checkpoint, "actor", "rank_0.pt"), weights_only=True)["model"]
    )
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = str(root / "ex")
    assert main(["-q", "make-data", data, "--n-train", "64", "--n-test", "16"]) == 0
    assert main(["-q", "sft", TINY, f"vars.root={data}", "sft.steps=3", "sft.batch_size=8"]) == 0
    return root, data


@pytest.mark.slow
def test_train_resume_and_export(example, capsys):
    root, data = example
    run = str(root / "run")
    timings = str(root / "timings.json")
    common = [TINY, f"vars.root={data}", f"run_dir={run}", *SHORT]
    out = _run(capsys, "train", *common, "trainer.total_training_steps=3", "--timings-json", timings)
    # the command prints where everything is
    metrics, plot, export = _printed(out, "metrics"), _printed(out, "plot"), _printed(out, "export")
    checkpoint = _printed(out, "checkpoint")
    assert os.path.isfile(metrics) and os.path.getsize(plot) > 0 and checkpoint.endswith("global_step_3")
    assert "validation reward" in out and ", accuracy " in out and ", format rate " in out
    records = read_metrics_jsonl(metrics)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # three fixed validation prompts' completions as text, at every validation (before, step 2, the end)
    completions = read_completions(os.path.dirname(metrics))
    assert [(c["step"], c["index"]) for c in completions] == [(s, i) for s in (0, 2, 3) for i in (0, 5, 10)]
    assert all(c["prompt"].startswith("<|im_start|>user\n") for c in completions)
    assert all(
        r["reward/synthetic/arith_gsm8k/count"] == 16 for r in records[1:]
    )  # per-source reward metrics
    assert all("reward/synthetic/arith_gsm8k/acc/mean" in r for r in records[1:])
    # the export is the trained actor: transformers gives its logits
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    base = os.path.join(data, "sft_model")
    torch.testing.assert_close(_logits(export, ids), _actor_logits(checkpoint, base, ids))
    assert not torch.equal(_logits(export, ids), _logits(base, ids))  # three PPO steps moved it
    # the timings JSON breaks the step down into the stages of a PPO step
    report = json.loads(pathlib.Path(timings).read_text())
    assert report["steps"] == 3 and report["warmup_steps"] == 1
    assert set(report["mean_s"]) == {*STAGES, "everything_else", "step"}
    assert sum(report["mean_s"][k] for k in (*STAGES, "everything_else")) == pytest.approx(
        report["mean_s"]["step"]
    )
    assert report["tokens_per_s"]["step"] > 0 and report["peak_memory_gib"]["actor"][0]["host_rss"] > 0

    # resume through the command: a longer run continues from the last checkpoint
    out = _run(capsys, "train", *common, "trainer.total_training_steps=5")
    assert _printed(out, "checkpoint").endswith("global_step_5")
    assert [r["step"] for r in read_metrics_jsonl(metrics)] == [0, 1, 2, 3, 4, 5]
    # the resumed run keeps the completions up to its checkpoint and adds its own
    completions = read_completions(os.path.dirname(metrics))
    assert [c["step"] for c in completions] == [s for s in (0, 2, 3, 4, 5) for _ in range(3)]

    # export any checkpoint with the command
    out = _run(capsys, "export", os.path.join(run, "checkpoints", "global_step_4"), str(root / "x4"))
    step4 = os.path.join(run, "checkpoints", "global_step_4")
    torch.testing.assert_close(_logits(_printed(out, "export"), ids), _actor_logits(step4, base, ids))
    out = _run(
        capsys, "export", os.path.join(run, "checkpoints"), str(root / "latest"), "--dtype", "bfloat16"
    )
    assert transformers.AutoConfig.from_pretrained(_printed(out, "export")).dtype == torch.bfloat16


def test_config_errors_exit_with_status_2_and_name_the_key(example, capsys):
    _, data = example
    assert main(["train", TINY, f"vars.root={data}", "trainer.totl_steps=5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "ppo-core: error: unknown config key trainer.totl_steps; valid keys under trainer:"
    ), err
    assert main(["export", str(pathlib.Path(data) / "nowhere"), "out"]) == 2
    assert "is neither a checkpoint folder" in capsys.readouterr().err


def test_console_entry_point(tmp_path):
    """``python -m ppo_core_cli`` is the ``ppo-core`` script ([project.scripts] points at the same main)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "ppo_core_cli", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and all(c in done.stdout for c in ("make-data", "sft", "train", "export"))
    text = (ROOT / "pyproject.toml").read_text()
    assert 'ppo-core = "ppo_core_cli.main:main"' in text


@pytest.mark.monarch
@pytest.mark.slow
def test_monarch_backend(example, capsys):
    pytest.importorskip("monarch")
    root, data = example
    out = _run(
        capsys,
        "train",
        TINY,
        f"vars.root={data}",
        f"run_dir={root / 'monarch'}",
        *SHORT,
        "backend=monarch",
        "monarch.device=cpu",
        "monarch.torch_threads=1",
        "trainer.total_training_steps=2",
        "--timings-json",
        str(root / "monarch.json"),
    )
    records = read_metrics_jsonl(_printed(out, "metrics"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert os.path.isfile(os.path.join(_printed(out, "export"), "model.safetensors"))
    memory = json.loads((root / "monarch.json").read_text())["peak_memory_gib"]
    assert (
        memory["actor"][0]["host_rss"] > 0 and memory["critic"][0]["host_rss"] > 0
    )  # through the role views


def test_readme_commands_are_the_tested_path():
    """The README's commands are the ones above: make-data into the tiny config's root, sft, then train."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Post-train any Hugging Face model")[1].split("\n## ")[0]
    block = section.split("```bash\n")[1].split("```")[0]
    commands = [
        line.split("#")[0].split("&&")[-1].strip() for line in block.splitlines() if "ppo-core" in line
    ]
    from ppo_core_cli.loading import load_job_config

    root = load_job_config(TINY).vars["root"]
    config = os.path.relpath(TINY, ROOT)
    assert commands == [f"ppo-core make-data {root}", f"ppo-core sft {config}", f"ppo-core train {config}"]
    job = load_job_config(TINY)
    assert job.algorithm.adv_estimator == "gae" and job.ppo_config().use_critic  # "PPO (GAE + critic ...)"
    assert f"{job.trainer.total_training_steps} steps" in section


@pytest.mark.slow
def test_eval_of_the_export_is_the_last_validation(example, capsys, tmp_path):
    """``ppo-core eval`` is the trainer's own validation: on the run's export it reproduces the last validation's
    metrics (accuracy, format rate, lengths, per data source) exactly, and on the starting checkpoint the step-0
    validation's."""
    _, data = example
    run = str(tmp_path / "run")
    common = [TINY, f"vars.root={data}", f"run_dir={run}", *SHORT, "trainer.save_freq=0"]
    out = _run(capsys, "train", *common, "trainer.total_training_steps=2")
    export = _printed(out, "export")
    records = read_metrics_jsonl(_printed(out, "metrics"))

    def validation(record):
        return {k: v for k, v in record.items() if k.startswith("val-")}

    first, last = validation(records[0]), validation(records[-1])
    assert first and last and first != last  # two PPO steps changed what greedy decoding answers
    for model, expected in ((export, last), (os.path.join(data, "sft_model"), first)):
        result = str(tmp_path / "eval.json")
        out = _run(capsys, "eval", *common, "--model", model, "--json", result)
        assert " on 16 prompts " in out and "accuracy " in out and "format rate " in out
        assert json.loads(pathlib.Path(result).read_text())["metrics"] == expected


def test_eval_needs_validation_prompts(example, capsys):
    _, data = example
    assert main(["eval", TINY, f"vars.root={data}", "data.val_files=[]"]) == 2
    assert "data.val_files must name the prompts to evaluate on" in capsys.readouterr().err


@pytest.mark.slow
def test_console_logger_alone_keeps_the_record_and_a_missing_one_warns_once(
    example, capsys, caplog, monkeypatch
):
    """``trainer.loggers=[console]`` still writes ``metrics.jsonl`` (the printed path exists, the summary and
    the plot have data); a logger whose package is missing is one warning, before anything loads."""
    import logging

    root, data = example
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed, whatever this machine has
    common = [
        TINY,
        f"vars.root={data}",
        f"run_dir={root / 'console'}",
        *SHORT,
        "trainer.loggers=[console,tensorboard]",
    ]
    with caplog.at_level(logging.INFO):
        out = _run(capsys, "train", *common, "trainer.total_training_steps=2")
    metrics = _printed(out, "metrics")
    assert [r["step"] for r in read_metrics_jsonl(metrics)] == [0, 1, 2]
    assert "validation reward" in out and os.path.getsize(_printed(out, "plot")) > 0
    messages = [r.getMessage() for r in caplog.records]
    missing = [i for i, m in enumerate(messages) if "tensorboard is not installed" in m]
    # the prompts (a Monarch run earlier in this process prefixes messages with the actor's name)
    loaded = [i for i, m in enumerate(messages) if re.search(r"\bloaded \d+ prompts from ", m)]
    assert len(missing) == 1 and missing[0] < loaded[0], messages

    # a rerun of a finished job says it did nothing; a longer one names the steps it trained
    out = _run(capsys, "train", *common, "trainer.total_training_steps=2")
    assert out.startswith(
        "nothing to do: already trained 2 steps (trainer.total_training_steps=2); raise "
        "trainer.total_training_steps to train on"
    ), out
    out = _run(capsys, "train", *common, "trainer.total_training_steps=4")
    assert out.startswith("trained steps 3-4 in "), out


@pytest.mark.slow
def test_a_rerun_that_changes_what_the_run_means_is_an_error_message_not_a_traceback(example, capsys):
    root, data = example
    common = [
        TINY,
        f"vars.root={data}",
        f"run_dir={root / 'changed'}",
        *SHORT,
        "trainer.total_training_steps=2",
    ]
    _run(capsys, "train", *common)
    assert main(["train", *common, "rollout.n=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppo-core: error: resuming from "), err
    assert "rollout.n: 1 in the checkpoint, 2 now" in err and "trainer.resume_allow_changes" in err, err


@pytest.mark.slow
def test_ctrl_c_stops_shuts_down_and_says_how_to_resume(example, capsys):
    import signal
    import time

    root, data = example
    run = root / "interrupted"
    argv = ["train", TINY, f"vars.root={data}", f"run_dir={run}", *SHORT, "trainer.save_freq=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppo_core_cli", "-q", *argv, "trainer.total_training_steps=400"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not any(r["step"] >= 1 for r in read_metrics_jsonl(run)):  # the first step is done
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("ppo-core:")]
    assert len(lines) == 3 and "Traceback" not in err, err
    # the signal lands during a step or between two (after a step's metrics are written, before the next begins)
    assert lines[0].startswith(("ppo-core: interrupted during step ", "ppo-core: interrupted before step "))
    assert lines[0].endswith("; the workers are shut down"), lines[0]
    newest = max(int(p.name.split("_")[-1]) for p in (run / "checkpoints").glob("global_step_*"))
    assert (
        lines[1] == f"ppo-core: newest checkpoint: {run / 'checkpoints'}/global_step_{newest} (step {newest})"
    )
    assert lines[2] == "ppo-core: rerun the same command to resume from it"
    # the rerun resumes from that checkpoint
    out = _run(capsys, *argv, f"trainer.total_training_steps={newest + 1}")
    assert out.startswith(f"trained step {newest + 1} in "), out
