"""The command with megatron workers under Monarch on one GPU: a short PPO run of the tiny shape, the export at the
end and the export of its checkpoint are the same model, and ``transformers`` loads it."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.monarch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron workers need CUDA"),
]

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")
pytest.importorskip("monarch")

from ppo_core.trainer import read_metrics_jsonl  # noqa: E402
from ppo_core_cli.main import main  # noqa: E402

CONFIG = str(
    pathlib.Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen2.5-0.5b_h200_ppo.yaml"
)


def _printed(out: str, label: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(f"{label}:")]
    return line.split(":", 1)[1].strip()


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_megatron_workers_under_monarch_train_and_export(tmp_path, capsys, algo):
    data = str(tmp_path / "ex")
    assert main(["-q", "make-data", data, "--n-train", "64", "--n-test", "4"]) == 0
    config = CONFIG.replace("_ppo.yaml", f"_{algo}.yaml")
    timings = str(tmp_path / "timings.json")
    argv = [
        "train",
        config,
        f"vars.root={data}",
        "vars.shape=tiny",  # the tiny shape: seconds, not minutes
        f"run_dir={tmp_path / 'run'}",
        "model.dtype=float32",
        "data.train_batch_size=16",
        "actor.worker.ppo_mini_batch_size=16",
        "rollout.max_new_tokens=16",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "--timings-json",
        timings,
    ]
    if algo == "ppo":
        # The random tiny model scores 0 on every prompt and the KL penalty is 0 at step 1 (policy = reference):
        # with a zero-initialised value head every advantage, return and value is 0, no gradient is non-zero and
        # neither actor nor critic can ever move. A random head gives the critic values, hence advantages.
        argv += ["critic.worker.ppo_mini_batch_size=16", "model.value_head_init_std=0.02"]
    else:
        # Zero scores make every GRPO advantage 0 too, and the KL loss has a zero gradient at pi = pi_ref: only
        # rounding differences between the training and reference forwards could move the actor. An entropy
        # bonus gives a gradient whatever the rewards.
        argv.append("actor.worker.entropy_coeff=0.001")
    assert main(argv) == 0
    out = capsys.readouterr().out
    records = read_metrics_jsonl(_printed(out, "metrics"))
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/zero_grad_steps"] == 0 and r["actor/skipped_steps"] == 0 for r in records)
    assert all("reward/synthetic/arith_gsm8k/acc/mean" in r for r in records)
    report = json.loads(pathlib.Path(timings).read_text())
    assert report["peak_memory_gib"]["actor"][0]["cuda_allocated"] > 0
    # the end-of-run export (from save_weights) and the export of the step-2 checkpoint are the same model
    again = tmp_path / "again"
    assert main(["export", _printed(out, "checkpoint"), str(again)]) == 0
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (_printed(out, "export"), str(again)):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert os.path.isfile(os.path.join(_printed(out, "export"), "tokenizer_config.json"))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(pathlib.Path(data) / "tiny"), dtype=torch.float32
    )
    with torch.no_grad():
        assert not torch.equal(base(input_ids=ids).logits, logits[0])  # two updates moved the actor
