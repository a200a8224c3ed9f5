"""The real job's step time: ``ppo-core train`` with megatron workers under Monarch on one GPU, as one JSON object.

For the Qwen2.5-0.5B and 1.5B shapes (random init, written offline on the first run), PPO (GAE + critic, KL in the
reward, n = 1) or GRPO (n = 4, KL loss), 64 prompts per step of exactly ``--prompt-tokens`` tokens (the example
prompts, lengthened with filler text and cut from the left) and ``--response-tokens`` new tokens (random weights
almost never sample EOS: every response has the full length). It runs the one-H200 config of the shape and
algorithm (``examples/configs/qwen2.5-*_h200_*.yaml``) through :func:`ppo_core_cli.train.run_train` with the
timings JSON on, and prints that JSON with the reference of the same job measured before the command existed (one
H200, Qwen2.5-0.5B shape, PPO, 256 + 256 tokens: 12.7 s per step, generation 10.8 s) and the target (2.5 s).

Usage (one GPU; no network needed)::

    python benchmarks/real_job.py --shape qwen2.5-0.5b --algo ppo --response-tokens 256   # the reference's job
    python benchmarks/real_job.py --shape qwen2.5-0.5b --algo ppo                         # 512 new tokens
    python benchmarks/real_job.py --shape qwen2.5-1.5b --algo grpo --out runs/bench/1.5b_grpo.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

REFERENCE = {
    "what": "BasePPOTrainer, megatron actor and critic under Monarch, one H200, Qwen2.5-0.5B shape, random weights, "
    "PPO with critic and KL in the reward, 64 prompts of 256 tokens, 256 new tokens, no EOS",
    "step_s": 12.7,
    "generation_s": 10.8,
    "actor_update_s": 0.91,
    "critic_update_s": 0.75,
    "tokens_per_s": 2600.0,
    "target_step_s": 2.5,
}
"""The job as measured before the command existed (the issue's numbers)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=("qwen2.5-0.5b", "qwen2.5-1.5b"), default="qwen2.5-0.5b")
    p.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=512)
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the means")
    p.add_argument("--root", default="runs/bench", help="example data, checkpoints and runs go here")
    p.add_argument("--out", default=None, help="the JSON file (default: ROOT/<shape>_<algo>_<P>+<R>.json)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more job overrides")
    return p.parse_args(argv)


def long_prompts(train_file: str, tokenizer_dir: str, out: str, tokens: int) -> str:
    """The example prompts with filler text in front, each longer than ``tokens`` after the chat template (the job
    cuts them to exactly ``tokens`` from the left, keeping the question and the generation prompt)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from ppo_core.data import tokenize_chat
    from ppo_core.examples.make_data import write_parquet

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    filler = "Earlier that week the market by the river was busy and everyone talked about the weather. "
    per = len(tokenizer(filler, add_special_tokens=False)["input_ids"])
    rows = pq.read_table(train_file).to_pylist()
    repeat = math.ceil(tokens / per) + 1
    for row in rows:
        row["prompt"][0]["content"] = filler * repeat + row["prompt"][0]["content"]
    shortest = min(len(tokenize_chat(tokenizer, row["prompt"])) for row in rows[:16])
    assert shortest > tokens, (shortest, tokens)
    return write_parquet(rows, out)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from benchmarks._meta import emit
    from ppo_core.examples import make_example_data
    from ppo_core_cli.loading import load_job_config
    from ppo_core_cli.train import run_train

    root = os.path.abspath(args.root)
    if not os.path.isfile(os.path.join(root, "model", "tokenizer.json")):
        make_example_data(root, seed=0, n_train=1024, n_test=16)
    data = os.path.join(root, "data", f"long_{args.prompt_tokens}.parquet")
    if not os.path.isfile(data):
        long_prompts(
            os.path.join(root, "data", "train.parquet"), os.path.join(root, "model"), data, args.prompt_tokens
        )
    name = f"{args.shape}_{args.algo}_{args.prompt_tokens}+{args.response_tokens}"
    out = os.path.abspath(args.out or os.path.join(root, f"{name}.json"))
    config = os.path.join(ROOT, "examples", "configs", f"{args.shape}_h200_{args.algo}.yaml")
    job = load_job_config(
        config,
        [
            f"vars.root={root}",
            f"data.train_files=[{data}]",
            f"data.max_prompt_length={args.prompt_tokens}",
            "data.truncation=left",
            f"rollout.max_new_tokens={args.response_tokens}",
            f"trainer.total_training_steps={args.steps}",
            f"run_dir={os.path.join(root, 'runs', name)}",
            "trainer.resume_mode=disable",
            *args.overrides,
        ],
    )
    result = run_train(job, timings_json=out, warmup_steps=args.warmup_steps)
    with open(out, encoding="utf-8") as f:
        report = json.load(f)
    step = report["mean_s"]["step"]
    report["reference"] = REFERENCE
    same_job = (
        args.shape == "qwen2.5-0.5b"
        and args.algo == "ppo"
        and (args.prompt_tokens, args.response_tokens)
        == (
            256,
            256,
        )
    )
    report["vs_reference"] = {
        "same_job": same_job,
        "speedup": REFERENCE["step_s"] / step if step > 0 else None,
        "meets_target": step <= REFERENCE["target_step_s"],
    }
    report["export"] = result.export_dir
    return emit(report, out, indent=2)


if __name__ == "__main__":
    main()
