"""Randomly initialised Qwen2 checkpoints of known shapes, written offline (``model.init_shape``).

Benchmarks and machines without a model hub need a checkpoint of a real model's *shape* only: the random weights
of :func:`write_random_checkpoint` cost the same per step as trained ones. The tokenizer comes from another
directory (the example tokenizer of ``ppo-core make-data``); a shape keeps its own vocabulary size when the
tokenizer is smaller (``qwen2.5-*``: 151936 rows, as the real models), so the embedding and output layers have
the real cost. Token ids the tokenizer does not know are dropped when responses are decoded.

Example:
    >>> SHAPES["qwen2.5-0.5b"]["num_hidden_layers"], SHAPES["qwen2.5-1.5b"]["hidden_size"]
    (24, 1536)
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

__all__ = ["SHAPES", "write_random_checkpoint"]

logger = logging.getLogger(__name__)

_QWEN25 = {
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_theta": 1e4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": None,  # the tokenizer's
    },
    "qwen2.5-0.5b": {
        **_QWEN25,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
    "qwen2.5-1.5b": {
        **_QWEN25,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    },
}
"""Qwen2 shapes by name (the Qwen2.5 ones are the published models' configurations)."""


def write_random_checkpoint(
    path: str | os.PathLike[str],
    shape: str,
    tokenizer_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: str = "float32",
) -> str:
    """Write a randomly initialised ``Qwen2ForCausalLM`` of ``shape`` with the tokenizer of ``tokenizer_dir``.

    The directory appears whole or not at all (written to ``path.tmp``, then renamed). The global RNG is left as
    it was.

    Args:
        path: the checkpoint directory to create (it must not hold a ``config.json`` yet).
        shape: a key of :data:`SHAPES`.
        tokenizer_dir: where the tokenizer files come from (EOS and padding ids too).
        seed: seeds the initialisation.
        dtype: dtype of the saved weights.

    Raises:
        ValueError: an unknown shape, or a tokenizer larger than the shape's vocabulary.
    """
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from ppo_core.models.hf import TOKENIZER_FILES

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid shapes: {', '.join(SHAPES)}")
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"path={path!r} already holds a checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer_dir), local_files_only=True)
    dims = dict(SHAPES[shape])
    rope_theta = dims.pop("rope_theta")
    vocab = dims.pop("vocab_size") or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens, more than the {vocab} rows of shape {shape!r}"
        )
    config = Qwen2Config(
        **dims,
        vocab_size=vocab,
        rope_theta=rope_theta,  # transformers 5 moves it into rope_parameters
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    tmp = path.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        src = os.path.join(os.fspath(tokenizer_dir), name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tmp, name))
    if os.path.isdir(path):
        os.rmdir(path)  # an empty directory left by a caller (else os.rename fails)
    os.rename(tmp, path)
    n = sum(p.numel() for p in model.parameters())
    logger.info("wrote a random-init %s checkpoint (%.3g parameters, %s) to %s", shape, n, dtype, path)
    return path
