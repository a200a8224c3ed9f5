"""The ``ppo-core`` command: ``make-data``, ``sft``, ``train`` and ``export``.

::

    ppo-core make-data OUT_DIR                          # the offline example: prompts, tokenizer, tiny Qwen2
    ppo-core sft CONFIG.yaml [key=value ...]            # the format warm-up: a new checkpoint (sft.output_dir)
    ppo-core train CONFIG.yaml [key=value ...]          # PPO/GRPO, then the export; prints where outputs are
    ppo-core export CHECKPOINT_DIR OUT_DIR              # the actor of any saved checkpoint as a HF directory

``key=value`` overrides use dotted keys (``trainer.total_training_steps=5``); see :mod:`ppo_core_cli.config`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppo_core_cli.train import TrainInterrupted

__all__ = ["CommandError", "main"]

logger = logging.getLogger(__name__)


INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, what a shell reports for a process killed by it)."""


class CommandError(Exception):
    """A mistake in the command line, the config or the named files: printed as one line, exit status 2."""


def _load(args: argparse.Namespace):  # -> JobConfig
    from ppo_core_cli.loading import load_job_config

    try:
        return load_job_config(args.config, args.overrides)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc


def _parser() -> argparse.ArgumentParser:
    from ppo_core.examples.make_data import add_arguments

    parser = argparse.ArgumentParser(
        prog="ppo-core", description="Post-train a Hugging Face model with PPO (ppo-core)."
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_arguments(
        sub.add_parser(
            "make-data",
            help="write the offline example (synthetic GSM8K-format prompts, tokenizer, tiny Qwen2 checkpoint)",
        )
    )
    for name, text in (
        ("sft", "supervised warm-up on prompt/response pairs (the sft section); writes sft.output_dir"),
        ("train", "train with PPO/GRPO, then export the actor"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="the job's YAML file")
        p.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.seed=1"
        )
        if name == "train":
            p.add_argument(
                "--timings-json",
                metavar="FILE",
                help="write the step-time breakdown, tokens/s and peak memory of the run to FILE",
            )
            p.add_argument(
                "--warmup-steps", type=int, default=1, help="first steps left out of the timings' means"
            )
    p = sub.add_parser("export", help="export the actor of a checkpoint as a Hugging Face directory")
    p.add_argument("checkpoint", help="a global_step_k folder, or a checkpoint root (its newest checkpoint)")
    p.add_argument("out_dir")
    p.add_argument("--model-dir", help="the checkpoint the run started from (torch workers without job.yaml)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype of the written weights")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the checksum verification of the checkpoint"
    )
    return parser


def _make_data(args: argparse.Namespace) -> int:
    from ppo_core.examples.make_data import run

    data = run(args)
    print(f"train prompts: {data.train_file}")
    print(f"test prompts:  {data.test_file}")
    print(f"sft pairs:     {data.sft_file}")
    print(f"model:         {data.model_dir} ({data.extra['num_parameters']} parameters)")
    return 0


def _check(check: Callable[[Any], None], job: Any) -> None:
    """Run one of :mod:`ppo_core_cli.checks` on the job, its errors as :class:`CommandError`."""
    try:
        check(job)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc


def _sft(args: argparse.Namespace) -> int:
    from ppo_core_cli.checks import check_sft_inputs
    from ppo_core_cli.sft import run_sft

    job = _load(args)
    _check(check_sft_inputs, job)
    if job.torch_threads:
        import torch

        torch.set_num_threads(job.torch_threads)
    result = run_sft(job.sft, dtype=job.model.dtype, attn_implementation=job.model.attn_implementation)
    print(
        f"sft: {len(result.losses)} steps on {result.num_pairs} pairs in {result.seconds:.0f} s, loss "
        f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}"
    )
    print(f"checkpoint: {result.output_dir}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from ppo_core_cli.checks import check_train_inputs
    from ppo_core_cli.train import JobInputError, TrainInterrupted, run_train

    job = _load(args)
    _check(check_train_inputs, job)
    try:
        result = run_train(job, timings_json=args.timings_json, warmup_steps=args.warmup_steps)
    except TrainInterrupted as stop:
        _print_interrupted(stop)
        return INTERRUPTED
    except JobInputError as exc:
        raise CommandError(str(exc)) from exc
    ran, seconds = result.steps - result.start_step, result.wall_seconds
    if ran == 0 and result.steps > result.total_steps:
        line = (
            f"nothing to do: the newest checkpoint is at step {result.steps}, beyond the {result.total_steps} "
            f"steps of {result.step_limit}; raise {result.limit_key} to train on"
        )
    elif ran == 0:
        line = (
            f"nothing to do: already trained {result.steps} steps ({result.step_limit}); raise "
            f"{result.limit_key} to train on"
        )
    elif result.start_step > 0:
        steps = f"{result.start_step + 1}-{result.steps}" if ran > 1 else f"{result.steps}"
        line = f"trained step{'s' if ran > 1 else ''} {steps} in {seconds:.0f} s (resumed)"
    else:
        line = f"trained {result.steps} steps in {seconds:.0f} s"
    if result.initial_val_reward is not None and result.final_val_reward is not None:
        gain = result.final_val_reward - result.initial_val_reward
        line += f"; validation reward {result.initial_val_reward:.3f} -> {result.final_val_reward:.3f} ({gain:+.3f})"
    print(line)
    print(f"metrics:    {result.metrics_file}")
    if result.plot:
        print(f"plot:       {result.plot}")
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}")
    if result.export_dir:
        print(f"export:     {result.export_dir}")
    if result.timings_json:
        print(f"timings:    {result.timings_json}")
    return 0


def _print_interrupted(stop: TrainInterrupted) -> None:
    def say(text: str) -> None:
        print(f"ppo-core: {text}", file=sys.stderr)

    if stop.step > stop.finished:
        first, last = stop.start_step + 1, stop.finished
        done = f"; steps {first}-{last} finished" if last > first else f"; step {last} finished"
        done = "" if last < first else done
        say(f"interrupted during step {stop.step}{done}; the workers are shut down")
    else:
        say(f"interrupted before step {stop.finished + 1} began; the workers are shut down")
    if stop.checkpoint is None:
        say("no checkpoint saved yet (trainer.save_freq sets how often): a rerun starts from step 1")
        return
    step = os.path.basename(stop.checkpoint).rpartition("_")[2]
    say(f"newest checkpoint: {stop.checkpoint} (step {step})")
    if stop.resume_mode == "auto":
        say("rerun the same command to resume from it")
    elif stop.resume_mode == "path":
        say(f"rerun with trainer.resume_from_path={stop.checkpoint} to resume from it")
    else:
        say("rerun with trainer.resume_mode=auto to resume from it")


def _export(args: argparse.Namespace) -> int:
    from ppo_core_cli.export import export_checkpoint, resolve_checkpoint

    try:
        resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as exc:
        raise CommandError(str(exc)) from exc
    out = export_checkpoint(
        args.checkpoint, args.out_dir, model_dir=args.model_dir, dtype=args.dtype, verify=not args.no_verify
    )
    print(f"export: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); returns the exit status.

    A mistake in the config or the named files (:class:`CommandError`: checked before anything loads) prints one
    line ``ppo-core: error: ...`` and returns 2; Ctrl-C prints where the run stopped, its newest checkpoint and how
    to resume, and returns 130; anything that fails later, while a run is under way, raises with its traceback.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may also follow the options (``train job.yaml --timings-json t.json trainer.seed=1``), as in Hydra
    if extra and getattr(args, "overrides", None) is not None and all(_is_override(a) for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    _quiet_transformers()
    commands = {"make-data": _make_data, "sft": _sft, "train": _train, "export": _export}
    try:
        return commands[args.command](args)
    except CommandError as exc:
        print(f"ppo-core: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a run's steps (loading, exporting): nothing to resume from
        print("ppo-core: interrupted", file=sys.stderr)
        return INTERRUPTED


def _is_override(arg: str) -> bool:
    """Whether a command-line word is a ``dotted.key=value`` override (not an option)."""
    return not arg.startswith("-") and "=" in arg


def _quiet_transformers() -> None:
    """No per-file progress bars from ``transformers`` (loading and saving the small checkpoints of a run)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
