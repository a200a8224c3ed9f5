"""Small Hugging Face pieces shared by the data, model, reward and rollout tests (imported as ``from _hf import ...``)."""

from __future__ import annotations

import os

import torch

CORPUS = [
    "Mia has 7 shells. She finds 5 more. How many shells does Mia have now?",
    "3 + 4 = 7\n#### 7",
    "the answer is \\boxed{\\frac{1}{2}} so x = -3.50 dollars, 1,234 apples",
    "user assistant system",
] * 20


def make_tokenizer(directory: str | os.PathLike[str]):
    """The example tokenizer (byte-level BPE + ChatML template) trained on a tiny corpus."""
    from ppo_core.examples.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(CORPUS, directory, vocab_size=300)


def make_checkpoint(directory: str | os.PathLike[str], arch: str, vocab_size: int = 96, seed: int = 0) -> str:
    """A random-init tiny ``llama`` or ``qwen2`` causal LM saved with ``save_pretrained`` (fp32, safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "dtype": "float32",
    }
    if arch == "llama":
        config, cls = LlamaConfig(**shape, tie_word_embeddings=False), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**shape, tie_word_embeddings=True), Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    path = os.fspath(directory)
    model.save_pretrained(path)
    return path


def tiny_llama(vocab_size: int, seed: int = 0):
    """A random-init one-layer ``LlamaForCausalLM`` (hidden 32, 4 query / 2 key-value heads, 32 positions) in eval
    mode, from ``seed`` without touching the global RNG."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()
