"""One prompt row in verl's schema for a GSM8K-format word problem: the row both example tasks write.

Example:
    >>> row = gsm8k_prompt_row("synthetic/x_gsm8k", "Mia has 7 shells.", "Answer after ####.", 8, {"index": 0})
    >>> row["prompt"], row["reward_model"]
    ([{'role': 'user', 'content': 'Mia has 7 shells. Answer after ####.'}], {'style': 'rule', 'ground_truth': '8'})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["gsm8k_prompt_row"]


def gsm8k_prompt_row(
    data_source: str, question: str, instruction: str, answer: int, extra_info: Mapping[str, Any]
) -> dict[str, Any]:
    """``{data_source, prompt, ability, reward_model, extra_info}``: one user message (the question, then the
    instruction), ``ability`` ``"math"``, the rule-based ground truth ``str(answer)`` and ``extra_info`` as given."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": dict(extra_info),
    }
