"""The built-in data-source patterns (imported by ``ppo_core.rewards``)."""

from __future__ import annotations

from ppo_core.rewards.gsm8k import gsm8k_score
from ppo_core.rewards.math_scorer import math_score
from ppo_core.rewards.registry import register_scorer

GSM8K_PATTERNS = ("openai/gsm8k", "*gsm8k*")
"""GSM8K itself and any data source whose name contains ``gsm8k`` (e.g. the synthetic example task)."""
MATH_PATTERNS = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
"""The usual MATH releases (exact names)."""

register_scorer(*GSM8K_PATTERNS)(gsm8k_score)
register_scorer(*MATH_PATTERNS)(math_score)
