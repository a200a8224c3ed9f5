"""Rule-based rewards: scorers registered by ``data_source`` (GSM8K, MATH) and the trainer's reward function.

Example:
    >>> from ppo_core.rewards import get_scorer
    >>> get_scorer("openai/gsm8k")("3 + 4 = 7\\n#### 7", "7")["score"]
    1.0
    >>> get_scorer("HuggingFaceH4/MATH-500")(r"so \\boxed{\\frac{1}{2}}", "0.5")["acc"]
    1.0
"""

from __future__ import annotations

from ppo_core.rewards._builtin import GSM8K_PATTERNS, MATH_PATTERNS
from ppo_core.rewards.boxed import boxed_contents, last_boxed_answer
from ppo_core.rewards.deadline import DEADLINE_SIGNAL, CallDeadline, DeadlineExceeded
from ppo_core.rewards.gsm8k import extract_gsm8k_answer, gsm8k_score, has_gsm8k_answer, parse_number
from ppo_core.rewards.math_normalize import answers_match, normalize_math_answer, rational_value
from ppo_core.rewards.math_scorer import math_equivalent, math_score, math_verify_available
from ppo_core.rewards.metrics import reward_metrics_by_source
from ppo_core.rewards.registry import (
    Scorer,
    ScorerRegistry,
    get_scorer,
    global_registry,
    register_scorer,
    scorer_patterns,
)
from ppo_core.rewards.reward_fn import (
    RuleBasedReward,
    ScorerError,
    ScorerTimeoutError,
    score_rows,
    scorer_name,
)

__all__ = [
    "DEADLINE_SIGNAL",
    "GSM8K_PATTERNS",
    "MATH_PATTERNS",
    "CallDeadline",
    "DeadlineExceeded",
    "RuleBasedReward",
    "Scorer",
    "ScorerError",
    "ScorerRegistry",
    "ScorerTimeoutError",
    "answers_match",
    "boxed_contents",
    "extract_gsm8k_answer",
    "get_scorer",
    "global_registry",
    "gsm8k_score",
    "has_gsm8k_answer",
    "last_boxed_answer",
    "math_equivalent",
    "math_score",
    "math_verify_available",
    "normalize_math_answer",
    "parse_number",
    "rational_value",
    "register_scorer",
    "reward_metrics_by_source",
    "score_rows",
    "scorer_name",
    "scorer_patterns",
]
