"""Offline example data: synthetic GSM8K-format tasks, a small BPE tokenizer and a tiny Qwen2 checkpoint.

Nothing here needs a model hub: ``python -m ppo_core.examples.make_data OUT_DIR`` writes everything from a seed.
"""

from __future__ import annotations

from typing import Any

from ppo_core.examples.arith_task import NUMBER_WORDS, ArithTaskConfig, format_sft_pairs, make_arith_rows
from ppo_core.examples.arithmetic import ArithmeticConfig, make_arithmetic_splits
from ppo_core.examples.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_bpe_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "NUMBER_WORDS",
    "SPECIAL_TOKENS",
    "ArithTaskConfig",
    "ArithmeticConfig",
    "ExampleData",
    "TinyModelConfig",
    "format_sft_pairs",
    "make_arith_rows",
    "make_arithmetic_splits",
    "make_example_data",
    "train_bpe_tokenizer",
]


def __getattr__(name: str) -> Any:
    # make_data is imported on first use, so ``python -m ppo_core.examples.make_data`` runs it only once
    if name in ("ExampleData", "TinyModelConfig", "make_example_data"):
        from ppo_core.examples import make_data

        return getattr(make_data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
