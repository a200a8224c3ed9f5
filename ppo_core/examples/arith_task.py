"""A synthetic verifiable task in GSM8K's format: one-step arithmetic word problems, answers after ``####``.

Each problem adds or subtracts two small numbers in a short story ("Mia has 7 shells. Mia finds 5 more. How
many shells does Mia have now?"); the reference solution is ``"7 + 5 = 12\\n#### 12"`` and the ground truth
``"12"``. Rows follow verl's schema (``data_source``, ``prompt`` as chat messages, ``ability``,
``reward_model.ground_truth``, ``extra_info``) with the data source ``synthetic/arith_gsm8k``, which the GSM8K
scorer of :mod:`ppo_core.rewards` handles.

How hard it is for reinforcement learning from a format-only warm-up: with two digit operands (the default) a
tiny model must discover a 100-entry addition table from a reward that is 1 for about one sampled answer in 19,
which takes far longer than minutes on a CPU. With ``word_operands=[1]`` the second operand is written as a word
("Mia finds one more"): the answer is the one digit of the question plus one, which the tiny example model learns
from the reward in about a hundred PPO steps (the ``ppo-core make-data`` default).

Everything is drawn from a ``numpy.random.Generator`` seeded by the caller: the same seed gives the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ppo_core._config_base import ConfigBase
from ppo_core.examples.rows import gsm8k_prompt_row

__all__ = [
    "DATA_SOURCE",
    "INSTRUCTION",
    "NUMBER_WORDS",
    "ArithTaskConfig",
    "format_sft_pairs",
    "make_arith_rows",
]

DATA_SOURCE = "synthetic/arith_gsm8k"
"""``data_source`` of every row (matched by the GSM8K scorer's ``*gsm8k*`` pattern)."""

INSTRUCTION = "Write the final answer after ####."
"""Appended to every question."""

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
"""How ``word_operands`` are written (index = value)."""

_NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Ben", "Ivy", "Max")
_ITEMS = ("apples", "shells", "books", "coins", "stamps", "pens", "cards", "eggs")
_ADD = (
    "{name} has {a} {item}. {name} finds {b} more. How many {item} does {name} have now?",
    "{name} had {a} {item} and got {b} more. How many {item} does {name} have?",
)
_SUB = (
    "{name} has {a} {item}. {name} gives away {b}. How many {item} does {name} have left?",
    "{name} had {a} {item} and lost {b}. How many {item} are left?",
)


@dataclass(kw_only=True)
class ArithTaskConfig(ConfigBase):
    """Difficulty of the synthetic task."""

    max_operand: int = 9
    """Operands are drawn uniformly from ``0..max_operand``."""
    ops: list[str] = field(default_factory=lambda: ["+"])
    """Operations to draw from: ``"+"`` and/or ``"-"`` (subtraction never goes below 0)."""
    word_operands: list[int] | None = None
    """Draw the second operand from these values and write it as a word (``[1]``: "finds one more"); None: a
    digit operand drawn like the first."""

    def __post_init__(self) -> None:
        if int(self.max_operand) < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        self.ops = list(self.ops)
        if not self.ops or any(op not in ("+", "-") for op in self.ops):
            raise ValueError(f"ops must be a non-empty list of '+' and '-', got {self.ops}")
        if self.word_operands is not None:
            bad = [v for v in self.word_operands if not 0 <= v < len(NUMBER_WORDS)]
            if not self.word_operands or bad:
                raise ValueError(
                    f"word_operands must be a non-empty list of values in 0..{len(NUMBER_WORDS) - 1}, "
                    f"got {self.word_operands}"
                )


def make_arith_rows(
    n: int, *, seed: int, split: str = "train", config: ArithTaskConfig | None = None
) -> list[dict[str, Any]]:
    """``n`` problems as verl-schema rows.

    Args:
        n: number of rows.
        seed: seeds the draw (``numpy.random.default_rng(seed)``).
        split: written to ``extra_info.split``.
        config: difficulty (default :class:`ArithTaskConfig`).

    Example:
        >>> row = make_arith_rows(1, seed=0)[0]
        >>> row["data_source"], row["prompt"][0]["role"], row["reward_model"]["ground_truth"] == row["extra_info"]["answer"].split("#### ")[1]
        ('synthetic/arith_gsm8k', 'user', True)
    """
    cfg = config or ArithTaskConfig()
    if int(n) < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(int(n)):
        op = cfg.ops[int(rng.integers(len(cfg.ops)))]
        if cfg.word_operands is None:
            a, b = (int(x) for x in rng.integers(0, cfg.max_operand + 1, size=2))
            if op == "-" and b > a:
                a, b = b, a
            written_b: str | int = b
        else:
            b = int(cfg.word_operands[int(rng.integers(len(cfg.word_operands)))])
            low = b if op == "-" else 0  # a - b >= 0 (a may then exceed max_operand)
            a = int(rng.integers(low, max(low, cfg.max_operand) + 1))
            written_b = NUMBER_WORDS[b]
        value = a + b if op == "+" else a - b
        templates = _ADD if op == "+" else _SUB
        question = templates[int(rng.integers(len(templates)))].format(
            name=_NAMES[int(rng.integers(len(_NAMES)))],
            item=_ITEMS[int(rng.integers(len(_ITEMS)))],
            a=a,
            b=written_b,
        )
        extra = {
            "split": split,
            "index": index,
            "question": question,
            "answer": f"{a} {op} {b} = {value}\n#### {value}",
        }
        rows.append(gsm8k_prompt_row(DATA_SOURCE, question, INSTRUCTION, value, extra))
    return rows


def format_sft_pairs(
    rows: Sequence[dict[str, Any]], *, seed: int, max_value: int | None = None
) -> Iterator[tuple[list[dict[str, str]], str]]:
    """``(messages, response)`` pairs that teach the answer *format* only: ``"#### N"`` with a random ``N``.

    The values are drawn at random (uniform in ``0..max_value``, default: the largest ground truth of ``rows``),
    so a supervised warm-up on these pairs teaches where the answer goes, not what it is; PPO must learn the
    arithmetic.

    Example:
        >>> rows = make_arith_rows(3, seed=0)
        >>> [response.startswith("#### ") for _, response in format_sft_pairs(rows, seed=1)]
        [True, True, True]
    """
    rng = np.random.default_rng(seed)
    if max_value is None:
        max_value = max((abs(int(r["reward_model"]["ground_truth"])) for r in rows), default=0)
    for row in rows:
        yield list(row["prompt"]), f"#### {int(rng.integers(0, max_value + 1))}"
