"""Prompt datasets in verl's schema (parquet / JSON Lines), tokenised once through the checkpoint's chat template.

Usage::

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = load_prompt_dataset("train.parquet", tokenizer, max_prompt_length=256, truncation="filter")
    trainer = MyTrainer(cfg, train_dataset=train, reward_fn=RuleBasedReward(tokenizer), ...)
"""

from __future__ import annotations

from ppo_core.data.prompts import (
    TRUNCATION_POLICIES,
    PromptDataset,
    PromptDatasetConfig,
    PromptDatasetStats,
    load_prompt_dataset,
    tokenize_chat,
)
from ppo_core.data.readers import PROMPT_FILE_SUFFIXES, RowOrigin, iter_prompt_rows
from ppo_core.data.schema import PromptRecord, PromptSchemaError, parse_prompt_row

__all__ = [
    "PROMPT_FILE_SUFFIXES",
    "TRUNCATION_POLICIES",
    "PromptDataset",
    "PromptDatasetConfig",
    "PromptDatasetStats",
    "PromptRecord",
    "PromptSchemaError",
    "RowOrigin",
    "iter_prompt_rows",
    "load_prompt_dataset",
    "parse_prompt_row",
    "tokenize_chat",
]
