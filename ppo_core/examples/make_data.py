"""Make the offline example from nothing: task data, tokenizer and a tiny random-init Qwen2 checkpoint.

``make_example_data(out_dir, seed=0)`` (or ``python -m ppo_core.examples.make_data OUT_DIR``) writes::

    OUT_DIR/data/train.parquet, OUT_DIR/data/test.parquet   # verl schema, synthetic/arith_gsm8k
    OUT_DIR/data/sft.parquet                                # format warm-up pairs: prompt, response ("#### N")
    OUT_DIR/model/                                          # config.json, model.safetensors, tokenizer files

With ``task=ArithmeticConfig(...)`` (``--task arithmetic``) the prompts are instead the arithmetic word problems of
:mod:`ppo_core.examples.arithmetic` (data sources ``arithmetic/gsm8k-format/level-{k}``, disjoint splits), the
task for a small pretrained instruct model; the tokenizer and the tiny model are still written (they make a quick
CPU run possible) unless ``--no-model``.

The tokenizer is trained on the task's text; the model is a ``Qwen2ForCausalLM`` sized for CPU training
(:class:`TinyModelConfig`), initialised under ``torch.random.fork_rng`` from the seed (the caller's global RNG is
left as it was). The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ppo_core._config_base import ConfigBase
from ppo_core.examples.arith_task import ArithTaskConfig, format_sft_pairs, make_arith_rows
from ppo_core.examples.arithmetic import LEVELS, ArithmeticConfig, make_arithmetic_splits
from ppo_core.examples.tokenizer import CHAT_TEMPLATE, train_bpe_tokenizer

__all__ = [
    "ExampleData",
    "TinyModelConfig",
    "add_arguments",
    "main",
    "make_example_data",
    "run",
    "write_parquet",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TinyModelConfig(ConfigBase):
    """Shape of the example Qwen2 checkpoint (the vocabulary comes from the tokenizer)."""

    hidden_size: int = 64
    """Residual width."""
    intermediate_size: int = 256
    """MLP hidden width."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads (must divide ``hidden_size``)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention; must divide ``num_attention_heads``)."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary embedding is configured for."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head (as the small Qwen2 models do)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )


@dataclass(kw_only=True)
class ExampleData:
    """Paths of the files :func:`make_example_data` wrote."""

    root: str
    """The output directory."""
    train_file: str
    """Training prompts (parquet)."""
    test_file: str
    """Validation prompts (parquet)."""
    sft_file: str
    """Format warm-up pairs (parquet: ``data_source``, ``prompt`` messages, ``response`` text) for ``ppo-core sft``."""
    model_dir: str | None
    """The Hugging Face checkpoint directory (model and tokenizer); None when none was written."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Sizes: ``vocab_size``, ``num_parameters``, ``n_train``, ``n_test``."""


def write_parquet(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> str:
    """Write verl-schema rows to a parquet file with pyarrow (nested columns as structs and lists)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _corpus(rows: list[dict[str, Any]]) -> list[str]:
    texts = []
    for row in rows:
        texts += [m["content"] for m in row["prompt"]]
        texts.append(row["extra_info"]["answer"])
    return [*texts, "user", "assistant", "system", "#### "]


def make_example_data(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_train: int = 2048,
    n_test: int = 128,
    task: ArithTaskConfig | ArithmeticConfig | None = None,
    model: TinyModelConfig | None = None,
    vocab_size: int = 512,
    write_model: bool = True,
) -> ExampleData:
    """Write the example's train/test parquet files and its tokenizer + Qwen2 checkpoint under ``out_dir``.

    Args:
        out_dir: output directory (created).
        seed: seeds the task (the example task: train ``seed``, test ``seed + 1``; the arithmetic word problems:
            :func:`~ppo_core.examples.arithmetic.make_arithmetic_splits`) and the model initialisation.
        n_train, n_test: number of problems per split.
        task: the example task's difficulty (:class:`~ppo_core.examples.arith_task.ArithTaskConfig`), or the
            arithmetic word problems (:class:`~ppo_core.examples.arithmetic.ArithmeticConfig`).
        model: shape of the checkpoint.
        vocab_size: upper bound of the BPE vocabulary.
        write_model: also write the tokenizer and the tiny checkpoint (``model/``).
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    root = os.fspath(out_dir)
    if isinstance(task, ArithmeticConfig):
        train_rows, test_rows = make_arithmetic_splits(n_train, n_test, seed=seed, config=task)
    else:
        train_rows = make_arith_rows(n_train, seed=seed, split="train", config=task)
        test_rows = make_arith_rows(n_test, seed=seed + 1, split="test", config=task)
    train_file = write_parquet(train_rows, os.path.join(root, "data", "train.parquet"))
    test_file = write_parquet(test_rows, os.path.join(root, "data", "test.parquet"))
    sft_rows = [
        {"data_source": row["data_source"], "prompt": messages, "response": response}
        for row, (messages, response) in zip(train_rows, format_sft_pairs(train_rows, seed=seed), strict=True)
    ]
    sft_file = write_parquet(sft_rows, os.path.join(root, "data", "sft.parquet"))

    sizes = {"n_train": len(train_rows), "n_test": len(test_rows)}
    if not write_model:
        logger.info("data in %s: %d train / %d test prompts", root, len(train_rows), len(test_rows))
        return ExampleData(
            root=root,
            train_file=train_file,
            test_file=test_file,
            sft_file=sft_file,
            model_dir=None,
            extra=sizes,
        )
    model_dir = os.path.join(root, "model")
    tokenizer = train_bpe_tokenizer(_corpus(train_rows), model_dir, vocab_size=vocab_size)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    shape = model or TinyModelConfig()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **shape.to_dict(),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = Qwen2ForCausalLM(config)
    lm.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    lm.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in lm.parameters())
    logger.info(
        "example data in %s: %d train / %d test prompts, vocab %d, %d parameters",
        root,
        len(train_rows),
        len(test_rows),
        len(tokenizer),
        n_params,
    )
    return ExampleData(
        root=root,
        train_file=train_file,
        test_file=test_file,
        sft_file=sft_file,
        model_dir=model_dir,
        extra={
            "vocab_size": len(tokenizer),
            "num_parameters": n_params,
            **sizes,
        },
    )


_LEVEL_HELP = {
    1: "one step, one-digit numbers (+, -, x)",
    2: "one step, two-digit numbers (+, -, two-digit x one-digit)",
    3: "two steps (a + b - c, a - b + c, a + b + c, a x b + c, a x b - c)",
}


_TASK_DEFAULTS = {"example": (2048, 128), "arithmetic": (4096, 256)}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command-line options of :func:`main` (shared with ``ppo-core make-data``)."""
    parser.add_argument("out_dir", help="output directory (data/, model/)")
    parser.add_argument(
        "--task",
        choices=sorted(_TASK_DEFAULTS),
        default="example",
        help="'example': the tiny model's task ('Mia has 7 shells. Mia finds one more. ...'); 'arithmetic': "
        "natural-language word problems (+, -, small x, two steps) by level, train/test disjoint, data sources "
        "arithmetic/gsm8k-format/level-K, for a small pretrained instruct model (default: example)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--n-train", type=int, help="training problems (default: 2048 example, 4096 arithmetic)"
    )
    parser.add_argument("--n-test", type=int, help="test problems (default: 128 example, 256 arithmetic)")
    parser.add_argument(
        "--levels",
        help="arithmetic only: comma-separated levels, each an equal share of both splits (default: 1,2,3); "
        + "; ".join(f"{k}: {_LEVEL_HELP[k]}" for k in sorted(LEVELS)),
    )
    parser.add_argument(
        "--no-model", action="store_true", help="write the data only (no tokenizer, no model/)"
    )
    parser.add_argument("--max-operand", type=int, help="example only: largest operand (default 9)")
    parser.add_argument("--ops", help="example only: operations, e.g. '+-' (default '+')")
    parser.add_argument(
        "--word-operands",
        help="example only: comma-separated values of the second operand, written as words (default '1': "
        "'finds one more', what the tiny model learns in minutes); 'none': a digit operand like the first "
        "(much harder)",
    )
    return parser


def _ints(option: str, text: str, alternative: str = "") -> list[int]:
    """The comma-separated integers of an option's value; ``ValueError`` naming the option otherwise."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers{alternative}, got {text!r}") from None


def _task(args: argparse.Namespace) -> ArithTaskConfig | ArithmeticConfig:
    if args.task == "arithmetic":
        given = [
            f"--{k.replace('_', '-')}" for k in ("max_operand", "ops", "word_operands") if getattr(args, k)
        ]
        if given:
            raise ValueError(f"{', '.join(given)} apply to --task example only")
        levels = [1, 2, 3] if args.levels is None else _ints("--levels", args.levels)
        return ArithmeticConfig(levels=levels)
    if args.levels is not None:
        raise ValueError("--levels applies to --task arithmetic only")
    words = "1" if args.word_operands is None else args.word_operands
    word_operands = None if words.strip().lower() == "none" else _ints("--word-operands", words, " or 'none'")
    return ArithTaskConfig(
        max_operand=9 if args.max_operand is None else args.max_operand,
        ops=list(args.ops or "+"),
        word_operands=word_operands,
    )


def run(args: argparse.Namespace) -> ExampleData:
    """Make the example from parsed :func:`add_arguments` options (``ValueError`` for options that conflict)."""
    n_train, n_test = _TASK_DEFAULTS[args.task]
    for flag, value, least in (("--n-train", args.n_train, 1), ("--n-test", args.n_test, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    return make_example_data(
        args.out_dir,
        seed=args.seed,
        n_train=n_train if args.n_train is None else args.n_train,
        n_test=n_test if args.n_test is None else args.n_test,
        task=_task(args),
        write_model=not args.no_model,
    )


def main(argv: list[str] | None = None) -> ExampleData:
    """Command line: ``python -m ppo_core.examples.make_data OUT_DIR [--seed S] [--n-train N] [--n-test N] ...``."""
    parser = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run(args)


if __name__ == "__main__":
    main()
