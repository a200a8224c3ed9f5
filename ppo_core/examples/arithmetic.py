"""Arithmetic word problems in GSM8K's format, by difficulty level, with train/test splits that share no problem.

A task a small pretrained instruct model can learn from a rule-based reward: natural-language problems ("Liam
has 7 marbles. He finds 5 more. How many marbles does Liam have now?") with people, objects and verbs drawn
from several templates per operation, each question followed by the same instruction, :data:`INSTRUCTION`
("Give the final answer after ####."); the model has to learn to end with ``#### N``.

Levels (:data:`LEVELS`):

- 1: one step, one-digit operands: ``a + b`` (1..9), ``a - b`` (``a`` up to 18: the subtraction facts within
  20), ``a * b`` (2..9 each);
- 2: one step, two-digit operands: ``a + b``, ``a - b`` (10..99), ``a * b`` (``a`` 10..30 groups of 2..9);
- 3: two steps: ``a + b - c``, ``a - b + c``, ``a + b + c`` (``a`` 10..60, ``b`` and ``c`` 1..20), ``a * b + c``
  and ``a * b - c`` (``a``, ``b`` 2..9).

Every result, intermediate or final, is at least 1. Every problem is an ``(operation, operands)`` key plus a wording;
the test split draws distinct keys first and the train split never uses one of them, so the splits are disjoint
by key and therefore by text (``3 + 4`` and ``4 + 3`` are different keys). Each level gets an equal share of
each split and each operation an equal share of its level, except that the test split takes at most half of an
operation's keys (the rest of its share goes to the level's other operations; too large a test split for the
level's keys is a ``ValueError``).

Rows follow verl's schema: ``data_source`` ``arithmetic/gsm8k-format/level-{k}`` (picked up by the GSM8K scorer's
``*gsm8k*`` pattern; one source per level, so validation reports each level's accuracy), ``prompt`` (one user
message: no system message, the model's chat template adds its own), ``ability`` ``"math"``,
``reward_model.ground_truth`` (the answer as a decimal string) and ``extra_info`` (``split``, ``index``,
``level``, ``operation``, ``operands``, ``question`` and ``answer``, a GSM8K-style solution ending in ``#### N``).

Everything is drawn from ``numpy`` generators seeded by the caller; the global RNGs are never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ppo_core._config_base import ConfigBase
from ppo_core.examples.rows import gsm8k_prompt_row

__all__ = [
    "DATA_SOURCE_PREFIX",
    "INSTRUCTION",
    "LEVELS",
    "OPERATIONS",
    "ArithmeticConfig",
    "data_source",
    "make_arithmetic_splits",
]

DATA_SOURCE_PREFIX = "arithmetic/gsm8k-format"
"""``data_source`` of level ``k`` is ``{DATA_SOURCE_PREFIX}/level-{k}``."""

INSTRUCTION = "Give the final answer after ####."
"""Appended to every question."""

# an operation: (value of the operands, the GSM8K-style solution lines)
_Op = tuple[Callable[..., int], Callable[..., list[str]]]
OPERATIONS: dict[str, _Op] = {
    "add": (lambda a, b: a + b, lambda a, b: [f"{a} + {b} = {a + b}"]),
    "sub": (lambda a, b: a - b, lambda a, b: [f"{a} - {b} = {a - b}"]),
    "mul": (lambda a, b: a * b, lambda a, b: [f"{a} * {b} = {a * b}"]),
    "add_sub": (
        lambda a, b, c: a + b - c,
        lambda a, b, c: [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"],
    ),
    "sub_add": (
        lambda a, b, c: a - b + c,
        lambda a, b, c: [f"{a} - {b} = {a - b}", f"{a - b} + {c} = {a - b + c}"],
    ),
    "add_add": (
        lambda a, b, c: a + b + c,
        lambda a, b, c: [f"{a} + {b} = {a + b}", f"{a + b} + {c} = {a + b + c}"],
    ),
    "mul_add": (
        lambda a, b, c: a * b + c,
        lambda a, b, c: [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"],
    ),
    "mul_sub": (
        lambda a, b, c: a * b - c,
        lambda a, b, c: [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"],
    ),
}
"""Operation name -> (its value from the operands, the lines of its worked solution)."""


def _pairs(a_range: range, b_of: Callable[[int], range]) -> list[tuple[int, ...]]:
    return [(a, b) for a in a_range for b in b_of(a)]


def _triples(pairs: list[tuple[int, ...]], c_of: Callable[[int, int], range]) -> list[tuple[int, ...]]:
    return [(a, b, c) for a, b in pairs for c in c_of(a, b)]


def _key_spaces() -> dict[int, dict[str, list[tuple[int, ...]]]]:
    # results are >= 1 (no "how many are left?" with none left), intermediate values >= 1 too
    one, two, teen = range(1, 10), range(10, 100), range(2, 19)
    small, upto20 = range(2, 10), range(1, 21)
    return {
        1: {
            "add": _pairs(one, lambda a: one),
            "sub": _pairs(teen, lambda a: range(1, min(a - 1, 9) + 1)),
            "mul": _pairs(small, lambda a: small),
        },
        2: {
            "add": _pairs(two, lambda a: two),
            "sub": _pairs(two, lambda a: range(10, a)),
            "mul": _pairs(range(10, 31), lambda a: small),
        },
        3: {
            "add_sub": _triples(
                _pairs(range(10, 61), lambda a: upto20), lambda a, b: range(1, min(a + b - 1, 20) + 1)
            ),
            "sub_add": _triples(
                _pairs(range(10, 61), lambda a: range(1, min(a - 1, 20) + 1)), lambda a, b: upto20
            ),
            "add_add": _triples(_pairs(range(10, 61), lambda a: upto20), lambda a, b: upto20),
            "mul_add": _triples(_pairs(small, lambda a: small), lambda a, b: upto20),
            "mul_sub": _triples(
                _pairs(small, lambda a: small), lambda a, b: range(1, min(a * b - 1, 20) + 1)
            ),
        },
    }


_KEYS = _key_spaces()
LEVELS: dict[int, tuple[str, ...]] = {level: tuple(ops) for level, ops in _KEYS.items()}
"""Level -> its operations (see the module docstring for the operand ranges)."""

# (name, subject pronoun, object pronoun, possessive)
_PEOPLE = (
    ("Mia", "she", "her", "her"), ("Liam", "he", "him", "his"), ("Ava", "she", "her", "her"),
    ("Noah", "he", "him", "his"), ("Sofia", "she", "her", "her"), ("Omar", "he", "him", "his"),
    ("Lena", "she", "her", "her"), ("Ravi", "he", "him", "his"), ("Chloe", "she", "her", "her"),
    ("Ben", "he", "him", "his"), ("Aisha", "she", "her", "her"), ("Tom", "he", "him", "his"),
    ("Yuki", "she", "her", "her"), ("Diego", "he", "him", "his"),
)  # fmt: skip
_ITEMS = (
    ("apple", "apples"), ("marble", "marbles"), ("sticker", "stickers"), ("book", "books"), ("shell", "shells"),
    ("coin", "coins"), ("pencil", "pencils"), ("card", "cards"), ("cookie", "cookies"), ("stamp", "stamps"),
    ("toy car", "toy cars"), ("flower", "flowers"), ("crayon", "crayons"), ("egg", "eggs"),
)  # fmt: skip
_CONTAINERS = (
    ("box", "boxes"),
    ("bag", "bags"),
    ("jar", "jars"),
    ("packet", "packets"),
    ("basket", "baskets"),
)

# {name} {he} {him} {his} {He} {friend} {friend2}; {a_items}: "7 marbles"; {items}: "marbles"; {a}: "7";
# {a_box}: "3 boxes", {box}: "box". Numbers appear in the order a, b, c.
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a_items}. {He} finds {b} more. How many {items} does {name} have now?",
        "{name} had {a_items} and bought {b} more. How many {items} does {he} have in total?",
        "{There_are} {a_items} in a basket. {name} puts in {b} more. How many {items} are in the basket now?",
        "{name} collected {a_items} on Monday and {b_items} on Tuesday. How many {items} did {he} collect in all?",
        "{name} has {a_items} and {friend} has {b_items}. How many {items} do they have together?",
    ),
    "sub": (
        "{name} has {a_items}. {He} gives {b} to {friend}. How many {items} does {name} have left?",
        "{name} had {a_items} and lost {b} of them. How many {items} does {he} have now?",
        "{There_are} {a_items} on the table. {name} takes {b} away. How many {items} are left on the table?",
        "{name} wants {a_items}. {He} already has {b}. How many more {items} does {he} need?",
    ),
    "mul": (
        "{name} has {a_box} of {items}. Each {box} holds {b_items}. How many {items} does {name} have?",
        "{name} buys {a_box} of {items} with {b_items} in each {box}. How many {items} does {he} buy in total?",
        "{name} fills {a_box} with {b_items} each. How many {items} does {he} use?",
    ),
    "add_sub": (
        "{name} has {a_items}. {He} buys {b} more and then gives {c} to {friend}. "
        "How many {items} does {name} have now?",
        "{name} had {a_items}. {He} found {b} more, then lost {c}. How many {items} does {he} have left?",
    ),
    "sub_add": (
        "{name} had {a_items}. {He} used {b} of them and then bought {c} more. How many {items} does {he} have now?",
        "{There_are} {a_items} in a jar. {name} takes out {b} and later puts back {c}. "
        "How many {items} are in the jar now?",
    ),
    "add_add": (
        "{name} collected {a_items} on Monday, {b} on Tuesday and {c} on Wednesday. "
        "How many {items} did {he} collect in all?",
        "{name} has {a_items}, {friend} has {b_items} and {friend2} has {c_items}. "
        "How many {items} do they have together?",
    ),
    "mul_add": (
        "{name} has {a_box} with {b_items} in each, and another {c_items} on the shelf. "
        "How many {items} does {he} have in all?",
        "{name} buys {a_box} of {items} with {b} in each {box}. {friend} gives {him} {c} more. "
        "How many {items} does {name} have now?",
    ),
    "mul_sub": (
        "{name} buys {a_box} of {items} with {b} in each {box}. {He} gives away {c} of them. "
        "How many {items} does {he} have left?",
        "A shop has {a_box} with {b_items} in each. {name} buys {c}. How many {items} are left in the shop?",
    ),
}


def data_source(level: int) -> str:
    """The ``data_source`` of a level's rows.

    Example:
        >>> data_source(2)
        'arithmetic/gsm8k-format/level-2'
    """
    return f"{DATA_SOURCE_PREFIX}/level-{level}"


@dataclass(kw_only=True)
class ArithmeticConfig(ConfigBase):
    """Which problems to write."""

    levels: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Difficulty levels to draw from (see :data:`LEVELS`), each an equal share of both splits."""

    def __post_init__(self) -> None:
        self.levels = list(self.levels)
        if (
            not self.levels
            or any(level not in LEVELS for level in self.levels)
            or len(set(self.levels)) != len(self.levels)
        ):
            raise ValueError(f"levels must be distinct values of {sorted(LEVELS)}, got {self.levels}")


def _shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts differing by at most one (the larger ones first)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _test_counts(total: int, level: int) -> dict[str, int]:
    """Test problems per operation of ``level``: equal shares, each at most half of the operation's keys."""
    caps = {op: len(keys) // 2 for op, keys in _KEYS[level].items()}
    if total > sum(caps.values()):
        raise ValueError(
            f"a test split of {total} level-{level} problems needs more than half of the level's "
            f"{sum(len(k) for k in _KEYS[level].values())} distinct problems; ask for fewer test problems "
            "or more levels"
        )
    counts = dict.fromkeys(caps, 0)
    while total:  # hand out the remainder to operations with room, equally
        open_ops = [op for op in counts if counts[op] < caps[op]]
        for op, share in zip(open_ops, _shares(total, len(open_ops)), strict=True):
            take = min(share, caps[op] - counts[op])
            counts[op] += take
            total -= take
    return counts


def _row(
    rng: np.random.Generator, level: int, op: str, operands: tuple[int, ...], split: str, index: int
) -> dict:
    value_of, solution_of = OPERATIONS[op]
    value = value_of(*operands)
    person, friend, friend2 = (_PEOPLE[int(i)] for i in rng.choice(len(_PEOPLE), size=3, replace=False))
    singular, plural = _ITEMS[int(rng.integers(len(_ITEMS)))]
    box, boxes = _CONTAINERS[int(rng.integers(len(_CONTAINERS)))]
    templates = _TEMPLATES[op]
    fields: dict[str, Any] = {
        "name": person[0], "he": person[1], "him": person[2], "his": person[3], "He": person[1].capitalize(),
        "There_are": "There is" if operands[0] == 1 else "There are",
        "friend": friend[0], "friend2": friend2[0], "items": plural, "box": box,
        "a_box": f"{operands[0]} {box if operands[0] == 1 else boxes}",
    }  # fmt: skip
    for letter, n in zip("abc", operands, strict=False):
        fields[letter] = n
        fields[f"{letter}_items"] = f"{n} {singular if n == 1 else plural}"
    question = templates[int(rng.integers(len(templates)))].format(**fields)
    extra = {
        "split": split,
        "index": index,
        "level": level,
        "operation": op,
        "operands": list(operands),
        "question": question,
        "answer": "\n".join([*solution_of(*operands), f"#### {value}"]),
    }
    return gsm8k_prompt_row(data_source(level), question, INSTRUCTION, value, extra)


def make_arithmetic_splits(
    n_train: int, n_test: int, *, seed: int, config: ArithmeticConfig | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_rows, test_rows)``: disjoint by ``(operation, operands)`` and by question text.

    The test split is drawn first, from its own generator: for a seed, it does not depend on ``n_train``. Test
    keys are distinct; train keys repeat (with other wordings) where a level has few.

    Args:
        n_train, n_test: rows per split (>= 0).
        seed: seeds both splits (``numpy.random.SeedSequence(seed).spawn(2)``).
        config: the levels (default: all).

    Raises:
        ValueError: a negative size, or a test split larger than half a level's distinct problems.

    Example:
        >>> train, test = make_arithmetic_splits(4, 2, seed=0, config=ArithmeticConfig(levels=[1]))
        >>> test[0]["data_source"], test[0]["prompt"][0]["content"].endswith("Give the final answer after ####.")
        ('arithmetic/gsm8k-format/level-1', True)
    """
    cfg = config or ArithmeticConfig()
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        if int(n) < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    test_rng, train_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    test: list[tuple[int, str, tuple[int, ...]]] = []
    for level, total in zip(cfg.levels, _shares(int(n_test), len(cfg.levels)), strict=True):
        for op, count in _test_counts(total, level).items():
            keys = _KEYS[level][op]
            test += [(level, op, keys[int(i)]) for i in test_rng.choice(len(keys), size=count, replace=False)]
    held_out = set(test)
    train: list[tuple[int, str, tuple[int, ...]]] = []
    for level, total in zip(cfg.levels, _shares(int(n_train), len(cfg.levels)), strict=True):
        ops = LEVELS[level]
        for _ in range(total):
            op = ops[int(train_rng.integers(len(ops)))]
            keys = _KEYS[level][op]
            while (key := (level, op, keys[int(train_rng.integers(len(keys)))])) in held_out:
                pass  # at most half of an operation's keys are held out: a few draws at most
            train.append(key)
    out = []
    for split, keys, rng in (("train", train, train_rng), ("test", test, test_rng)):
        order = rng.permutation(len(keys))
        out.append([_row(rng, *keys[int(j)], split, i) for i, j in enumerate(order)])
    return out[0], out[1]
