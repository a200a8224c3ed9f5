"""A small byte-level BPE tokenizer trained with the ``tokenizers`` library, saved as a Hugging Face tokenizer.

Digits are split one per token (as Qwen2's tokenizer does), so numbers of any size share ten digit tokens.
Special tokens: ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>`` (end of a turn: the EOS of
generation). The chat template is ChatML-style, written into ``tokenizer_config.json`` (where every
``transformers`` version reads it), so ``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages,
add_generation_prompt=True)`` renders ``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["CHAT_TEMPLATE", "EOS_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "train_bpe_tokenizer"]

PAD_TOKEN = "<|endoftext|>"
"""Padding token (id 0)."""
EOS_TOKEN = "<|im_end|>"
"""Ends every turn; generation stops at it."""
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
"""The special tokens, with ids 0, 1, 2."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML-style Jinja template (no default system prompt)."""


def train_bpe_tokenizer(
    texts: Iterable[str], out_dir: str | os.PathLike[str], *, vocab_size: int = 512
) -> Any:
    """Train a byte-level BPE tokenizer on ``texts`` and save it to ``out_dir`` as a Hugging Face tokenizer.

    Args:
        texts: the training corpus (iterated once).
        out_dir: created if needed; receives ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat
            template).
        vocab_size: upper bound of the vocabulary (256 byte tokens + special tokens + merges); training stops
            earlier when no pair occurs twice.

    Returns:
        The tokenizer, as ``AutoTokenizer.from_pretrained(out_dir)`` loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if int(vocab_size) < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    hf.save_pretrained(out)
    # one copy of the template, in tokenizer_config.json: newer transformers would write chat_template.jinja,
    # which older ones do not read
    jinja = os.path.join(out, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    config_path = os.path.join(out, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return AutoTokenizer.from_pretrained(out, local_files_only=True)
