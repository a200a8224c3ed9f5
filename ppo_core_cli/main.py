"""The ``ppo-core`` command: ``make-data``, ``sft``, ``train``, ``eval``, ``export``, ``convert``, ``convert-verl``
and ``config``.

::

    ppo-core make-data OUT_DIR                          # the offline example: prompts, tokenizer, tiny Qwen2
    ppo-core make-data OUT_DIR --task arithmetic        # word problems by level (GSM8K format, disjoint splits)
    ppo-core sft CONFIG.yaml [key=value ...]            # the format warm-up: a new checkpoint (sft.output_dir)
    ppo-core train CONFIG.yaml [key=value ...]          # PPO/GRPO, then the export; prints where outputs are
    ppo-core export CHECKPOINT_DIR OUT_DIR              # the actor of any saved checkpoint as a HF directory
    ppo-core convert MODEL.gguf OUT_DIR [--dtype D]     # a GGUF file as a HF directory (train does it itself)
    ppo-core convert-verl VERL.yaml [key=value ...] -o JOB.yaml   # a verl config (and overrides) as a job
    ppo-core config CONFIG.yaml [key=value ...]         # the job with every default and each key's help
    ppo-core config --defaults [key=value ...]          # the defaults (e.g. workers=megatron)
    ppo-core config --markdown                          # the reference page docs/config-reference.md
    ppo-core eval CONFIG.yaml [key=value ...] [--model DIR]   # greedy validation of a checkpoint (accuracy, format)

``key=value`` overrides use dotted keys (``trainer.total_training_steps=5``); see :mod:`ppo_core_cli.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppo_core_cli.train import TrainInterrupted, TrainResult

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


def _resolve_scorers(job, config_path: str) -> dict:
    """The job's scorers, imported before any model loads: a scorer that cannot be is a one-line error."""
    from ppo_core_cli.job import resolve_scorers

    try:
        return resolve_scorers(job, config_path)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc


_REFERENCE_HINT = (
    "Every key of a job with its default and help: `ppo-core config CONFIG.yaml [KEY=VALUE ...]` (this job, "
    "every default filled in), `ppo-core config --defaults`, or docs/config-reference.md."
)


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
            help="write the offline example (synthetic GSM8K-format prompts, tokenizer, tiny Qwen2 checkpoint) "
            "or, with --task arithmetic, arithmetic word problems for a small pretrained model",
        )
    )
    for name, text in (
        ("sft", "supervised warm-up on prompt/response pairs (the sft section); writes sft.output_dir"),
        ("train", "train with PPO/GRPO, then export the actor"),
    ):
        p = sub.add_parser(name, help=text, epilog=_REFERENCE_HINT)
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
    p = sub.add_parser(
        "config",
        help="print a job with every default and each key's help (YAML), or the config reference (Markdown)",
        description="Print the job CONFIG.yaml with the overrides applied, every default filled in and each key's "
        "help as a comment (the output is itself a job file).",
    )
    p.add_argument(
        "args", nargs="*", metavar="CONFIG.yaml [KEY=VALUE", help="the job's YAML file, then overrides]"
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--defaults", action="store_true", help="no job file: the defaults (with the overrides)"
    )
    what.add_argument(
        "--markdown", action="store_true", help="the reference page of every key (docs/config-reference.md)"
    )
    p.add_argument("--no-comments", action="store_true", help="the YAML without the help comments")
    p = sub.add_parser(
        "eval",
        help="greedy validation of a checkpoint on the job's validation prompts (accuracy, format rate), as train "
        "runs it",
    )
    p.add_argument("config", help="the job's YAML file (data.val_files, scorers, rollout length...)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    p.add_argument(
        "--model", help="the checkpoint to evaluate (a run's export, a GGUF file); default: model.path"
    )
    p.add_argument("--json", metavar="FILE", help="also write the result (every validation metric) to FILE")
    p = sub.add_parser("export", help="export the actor of a checkpoint as a Hugging Face directory")
    p.add_argument("checkpoint", help="a global_step_k folder, or a checkpoint root (its newest checkpoint)")
    p.add_argument("out_dir")
    p.add_argument("--model-dir", help="the checkpoint the run started from (torch workers without job.yaml)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype of the written weights")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the checksum verification of the checkpoint"
    )
    p = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face checkpoint directory")
    p.add_argument("gguf", help="the .gguf file (or a directory holding exactly one)")
    p.add_argument("out_dir", help="the directory to write (replaced once the conversion is complete)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the written weights",
    )
    p = sub.add_parser(
        "convert-verl",
        help="convert a verl config (composed, ppo_trainer.yaml with its defaults, or overrides) into a job YAML",
    )
    p.add_argument("config", help="the verl YAML file")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="verl overrides, as given to verl.trainer.main_ppo"
    )
    p.add_argument("-o", "--output", metavar="JOB.yaml", help="write the job here (default: print it)")
    return parser


def _make_data(args: argparse.Namespace) -> int:
    from ppo_core.examples.make_data import run
    from ppo_core_cli.checks import check_output_dir

    try:
        check_output_dir("OUT_DIR", args.out_dir)  # a file there: one line, before anything is made
        data = run(args)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    print(f"train prompts: {data.train_file} ({data.extra['n_train']})")
    print(f"test prompts:  {data.test_file} ({data.extra['n_test']})")
    print(f"sft pairs:     {data.sft_file}")
    if data.model_dir is not None:
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
    from ppo_core_cli.sft import SFTInputError, run_sft

    job = _load(args)
    _check(check_sft_inputs, job)
    if job.torch_threads:
        import torch

        torch.set_num_threads(job.torch_threads)
    from ppo_core_cli.job import checkpoint_dir_of

    sft = job.sft
    if sft.model_path:
        try:
            model_dir = checkpoint_dir_of(job, sft.model_path, "sft.model_path")
        except (ValueError, FileNotFoundError) as exc:  # a bad GGUF file: named in one line
            raise CommandError(str(exc)) from exc
        sft = dataclasses.replace(sft, model_path=model_dir)
    try:
        result = run_sft(
            sft,
            dtype=job.model.dtype,
            attn_implementation=job.model.attn_implementation,
            eos_token=job.model.eos_token,
            pad_token=job.model.pad_token,
        )
    except SFTInputError as exc:
        raise CommandError(str(exc)) from exc
    print(
        f"sft: {len(result.losses)} steps on {result.num_pairs} pairs in {result.seconds:.0f} s, loss "
        f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}"
    )
    print(f"checkpoint: {result.output_dir}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from ppo_core_cli.checks import check_output_file, check_train_inputs
    from ppo_core_cli.job import resolve_model_dirs

    job = _load(args)  # the preset applied, the config rules checked
    scorers = _resolve_scorers(job, args.config)
    _check(check_train_inputs, job)  # every named file and folder, before any model loads
    _check(lambda _: check_output_file("--timings-json", args.timings_json), job)
    try:  # the model files (a GGUF file is converted here): a bad one is named in one line
        job = resolve_model_dirs(job)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc
    from ppo_core_cli.train import JobInputError, TrainInterrupted, run_train  # torch...: after the checks

    try:
        result = run_train(
            job, scorers=scorers, timings_json=args.timings_json, warmup_steps=args.warmup_steps
        )
    except TrainInterrupted as stop:
        _print_interrupted(stop)
        return INTERRUPTED
    except JobInputError as exc:
        raise CommandError(str(exc)) from exc
    print(_train_summary(result))
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


def _train_summary(result: TrainResult) -> str:
    """The first line ``train`` prints: what this invocation trained (``nothing to do`` when a rerun finds the run
    done; the steps and ``(resumed)`` after a resume), its time, and the first and last validation's reward,
    accuracy and format rate (each when the run logged it; a run that validated once: that validation's)."""
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
        line = f"trained {result.steps} step{'s' if result.steps > 1 else ''} in {seconds:.0f} s"
    if result.initial_val_reward is not None and result.final_val_reward is not None:
        gain = result.final_val_reward - result.initial_val_reward
        line += f"; validation reward {result.initial_val_reward:.3f} -> {result.final_val_reward:.3f} ({gain:+.3f})"
    elif result.final_val_reward is not None:  # one validation: nothing to compare it with
        line += f"; validation reward {result.final_val_reward:.3f}"
    for name, before, after in (
        ("accuracy", result.initial_val_accuracy, result.final_val_accuracy),
        ("format rate", result.initial_val_format, result.final_val_format),
    ):
        if before is not None and after is not None:
            line += f", {name} {before:.1%} -> {after:.1%}"
        elif after is not None:
            line += f", {name} {after:.1%}"
    return line


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


def _config(args: argparse.Namespace) -> int:
    from ppo_core_cli.reference import render_markdown, render_yaml

    if args.markdown:
        if args.args:
            raise CommandError(
                "config --markdown takes no job file or overrides: it prints the reference page"
            )
        sys.stdout.write(render_markdown())
        return 0
    if args.defaults:
        files = [a for a in args.args if not _is_override(a)]
        if files:
            raise CommandError(
                f"config --defaults takes no job file ({files[0]!r}): it prints the defaults with the overrides; "
                "drop one of the two"
            )
        args.config, args.overrides = None, list(args.args)
    elif not args.args or _is_override(args.args[0]):
        raise CommandError(
            "config needs a job file (ppo-core config CONFIG.yaml [KEY=VALUE ...]) or --defaults"
        )
    else:
        args.config, args.overrides = args.args[0], list(args.args[1:])
    sys.stdout.write(render_yaml(_load(args), help=not args.no_comments))
    return 0


def _eval(args: argparse.Namespace) -> int:
    if args.model:
        args.overrides = [*args.overrides, f"model.path={args.model}"]
    from ppo_core_cli.checks import check_eval_inputs, check_output_file

    job = _load(args)  # the preset applied, as for train
    scorers = _resolve_scorers(job, args.config)
    _check(check_eval_inputs, job)
    _check(lambda _: check_output_file("--json", args.json), job)
    from ppo_core_cli.evaluate import evaluate_job

    try:
        result = evaluate_job(job, scorers=scorers)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc
    parts = [
        f"{name} {value:.1%}"
        for name, value in (("accuracy", result.accuracy), ("format rate", result.format_rate))
        if value is not None
    ]
    if result.reward is not None:
        parts.append(f"reward {result.reward:.3f}")
    print(f"{', '.join(parts)} on {result.num_prompts} prompts ({result.seconds:.0f} s)")
    print(f"model: {result.model_dir}")
    if args.json:
        import json

        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=2)
            f.write("\n")
        print(f"json:  {args.json}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ppo_core_cli.checks import check_output_dir
    from ppo_core_cli.export import export_checkpoint, resolve_checkpoint

    try:
        check_output_dir("OUT_DIR", args.out_dir)
        resolve_checkpoint(args.checkpoint)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            model_dir=args.model_dir,
            dtype=args.dtype,
            verify=not args.no_verify,
        )
    except (ValueError, FileNotFoundError) as exc:  # a corrupt checkpoint, no model to export into...
        hint = "" if args.model_dir else " (the model the run started from: pass --model-dir DIR)"
        raise CommandError(f"{exc}{hint if isinstance(exc, FileNotFoundError) else ''}") from exc
    except RuntimeError as exc:
        from ppo_core_cli.failures import weight_mismatch

        if weight_mismatch(str(exc)) is None:
            raise
        raise CommandError(
            f"the actor of {args.checkpoint!r} does not fit the model it is exported into (another shape or "
            "architecture): pass the model the run started from with --model-dir DIR"
        ) from exc
    print(f"export: {out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from ppo_core_cli.convert import convert_gguf, find_gguf_file

    try:
        gguf_file = find_gguf_file(args.gguf)
        if gguf_file is None:
            raise ValueError(f"{args.gguf!r} is neither a GGUF file nor a directory holding one")
        out = convert_gguf(gguf_file, args.out_dir, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc
    print(f"checkpoint: {out} (from {gguf_file}, {args.dtype})")
    return 0


def _convert_verl(args: argparse.Namespace) -> int:
    from ppo_core_cli.checks import check_output_file
    from ppo_core_cli.verl_job import job_from_verl, write_job

    try:
        check_output_file("-o", args.output)  # a folder there: one line, before the conversion
        converted = job_from_verl(args.config, args.overrides)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc
    source = " ".join([args.config, *args.overrides])
    text = write_job(converted, args.output, source)
    c = converted.conversion
    report = sys.stdout if args.output else sys.stderr  # without -o, stdout holds the job only
    if not args.output:
        print(text, end="")
    print(
        f"converted {c.total} verl keys: {len(c.mapped)} mapped, {len(c.quiet)} at verl's defaults or switched "
        f"off, {len(c.dropped)} dropped",
        file=report,
    )
    for key, reason in c.dropped.items():
        print(f"  dropped {key}: {reason}", file=report)
    for note in converted.notes:
        print(f"note: {note}", file=report)
    if args.output:
        print(f"job: {args.output}", file=report)
        print(f"train it: ppo-core train {args.output}", file=report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); returns the exit status.

    A mistake in the config or the named files (:class:`CommandError`: checked before anything loads) prints one
    line ``ppo-core: error: ...`` and returns 2; Ctrl-C prints where the run stopped, its newest checkpoint and how
    to resume, and returns 130; a scorer that fails during a run prints one line (scorer, data source, row, step,
    the line of its file, the run's ``reward_error.txt`` holding the traceback) and returns 2; anything else that
    fails while a run is under way raises with its traceback.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may also follow the options (``train job.yaml --timings-json t.json trainer.seed=1``), as in Hydra
    if extra and getattr(args, "overrides", None) is not None and all(_is_override(a) for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra and args.command == "config" and all(_is_override(a) for a in extra):
        args.args = [*args.args, *extra]  # config's job file and overrides share one list
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    _quiet_transformers()
    commands = {
        "make-data": _make_data,
        "sft": _sft,
        "train": _train,
        "export": _export,
        "convert": _convert,
        "convert-verl": _convert_verl,
        "config": _config,
        "eval": _eval,
    }
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
