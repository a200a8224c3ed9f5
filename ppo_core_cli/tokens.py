"""The tokenizer's contract with the model, checked at start: which token ends a response, which one pads, and
that every token id has a row in the model's embedding.

EOS (:func:`resolve_special_tokens`), first match wins:

1. ``model.eos_token`` when set (a token string of the vocabulary);
2. the token that ends an assistant turn in the chat template (:func:`end_of_turn_token`: ``<|im_end|>`` for
   ChatML, ``<|eot_id|>`` for Llama 3), even where the tokenizer names another EOS: a response is an assistant
   turn, and sampling must stop where the template ends one (SmolLM2's GGUF tokenizer names ``<|im_start|>``);
3. the tokenizer's EOS.

Padding: ``model.pad_token`` when set; else the tokenizer's pad token when it is a special token (never text a
prompt can contain); else the EOS. Padding with the EOS is safe in ppo-core because no mask is computed from pad
ids: prompt masks come from the prompts' lengths (:func:`ppo_core.trainer.data.collate_prompts`), response masks
from where sampling stopped (an EOS inside a response keeps mask 1, the padding after it 0), SFT masks from the
pairs' lengths.

The vocabulary check (:func:`check_vocabulary_fits`) turns a tokenizer larger than the model's embedding (an id
past the last row: an ``IndexError`` deep inside generation) into an error before any model is built.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SpecialTokens", "check_vocabulary_fits", "end_of_turn_token", "resolve_special_tokens"]

logger = logging.getLogger(__name__)

_USER = "What is 2 + 3?"
_ANSWER = "The answer is 5"


@dataclass(frozen=True)
class SpecialTokens:
    """The resolved EOS and padding tokens, and where each came from (for the log)."""

    eos_token: str
    """Ends a response: sampling stops at it, SFT appends it."""
    eos_token_id: int
    """Its id."""
    pad_token: str
    """Written into the left padding of prompts and after a response's end."""
    pad_token_id: int
    """Its id."""
    eos_source: str
    """``model.eos_token``, ``the chat template's end of turn`` or ``the tokenizer's EOS``."""
    pad_source: str
    """``model.pad_token``, ``the tokenizer's pad token`` or ``the EOS``."""


def _control_ids(tokenizer: Any) -> set[int]:
    """Ids of the added tokens marked special: tokens the tokenizer never makes out of text (``<|im_end|>``...).

    Named special tokens are not enough: a tokenizer may name an ordinary word its pad token."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i) for i, token in decoder.items() if getattr(token, "special", False)}


def end_of_turn_token(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The special token right after the assistant's text in the chat template, or None.

    A user message and an assistant answer are rendered with the template; the token that follows the answer's
    text is the end of the assistant's turn when it is a special token. None when the tokenizer has no template,
    the template cannot render that conversation, or what follows the answer is not one special token (a
    template that ends a turn with a newline only).
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **dict(chat_template_kwargs or {}))
    except Exception as exc:  # a template's own raise_exception, a missing variable...
        logger.warning(
            "the chat template cannot render a user/assistant exchange (%s): no end-of-turn token", exc
        )
        return None
    at = text.rfind(_ANSWER)
    if at < 0:
        return None
    ids = tokenizer(text[at + len(_ANSWER) :], add_special_tokens=False)["input_ids"]
    if not ids or int(ids[0]) not in _control_ids(tokenizer) | {tokenizer.eos_token_id}:
        return None
    return str(tokenizer.convert_ids_to_tokens(int(ids[0])))


def _configured(tokenizer: Any, token: str, key: str, where: str) -> tuple[str, int, str]:
    """``(token, id, key)`` of a token the config names; ``ValueError`` naming ``key`` when it is no token."""
    vocab = tokenizer.get_vocab()
    if token not in vocab:
        raise ValueError(f"{key}={token!r} is not a token of the tokenizer at {where!r}")
    return token, int(vocab[token]), key


def _eos(
    tokenizer: Any, eos_token: str | None, chat_template_kwargs: Mapping[str, Any] | None, where: str
) -> tuple[str, int, str]:
    if eos_token is not None:
        return _configured(tokenizer, eos_token, "model.eos_token", where)
    turn = end_of_turn_token(tokenizer, chat_template_kwargs)
    if turn is not None:
        turn_id = int(tokenizer.convert_tokens_to_ids(turn))
        if tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) != turn_id:
            logger.info(
                "the tokenizer's EOS %r does not end an assistant turn in the chat template: %r does, and is used",
                tokenizer.eos_token,
                turn,
            )
        return turn, turn_id, "the chat template's end of turn"
    if tokenizer.eos_token_id is not None:
        return str(tokenizer.eos_token), int(tokenizer.eos_token_id), "the tokenizer's EOS"
    raise ValueError(
        f"the tokenizer at {where!r} has no EOS token and its chat template names no end of turn: set "
        "model.eos_token"
    )


def _pad(
    tokenizer: Any, pad_token: str | None, eos: tuple[str, int, str], where: str
) -> tuple[str, int, str]:
    if pad_token is not None:
        return _configured(tokenizer, pad_token, "model.pad_token", where)
    if tokenizer.pad_token_id is not None and int(tokenizer.pad_token_id) in _control_ids(tokenizer):
        return str(tokenizer.pad_token), int(tokenizer.pad_token_id), "the tokenizer's pad token"
    return eos[0], eos[1], "the EOS"


def resolve_special_tokens(
    tokenizer: Any,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    where: str = "",
) -> SpecialTokens:
    """The EOS and padding tokens of a run (rules in the module docstring), logged once.

    Args:
        tokenizer: a Hugging Face tokenizer.
        eos_token, pad_token: the config's choices (``model.eos_token`` / ``model.pad_token``); None: resolved.
        chat_template_kwargs: extra variables of the chat template.
        where: the tokenizer's directory, for the error messages (default: its ``name_or_path``).

    Raises:
        ValueError: a configured token that is not in the vocabulary (naming the key), or no EOS at all.

    Example:
        >>> # resolve_special_tokens(tok).eos_token  -> '<|im_end|>' for a ChatML template
    """
    where = where or str(getattr(tokenizer, "name_or_path", ""))
    eos = _eos(tokenizer, eos_token, chat_template_kwargs, where)
    pad = _pad(tokenizer, pad_token, eos, where)
    tokens = SpecialTokens(
        eos_token=eos[0],
        eos_token_id=eos[1],
        eos_source=eos[2],
        pad_token=pad[0],
        pad_token_id=pad[1],
        pad_source=pad[2],
    )
    logger.info("EOS %r (id %d, from %s); padding %r (id %d, from %s)", *eos, *pad)
    return tokens


def _vocab_size(model_dir: str) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return None if size is None else int(size)


def check_vocabulary_fits(tokenizer: Any, tokenizer_dir: str, model_dir: str) -> None:
    """Raise ``ValueError`` when the tokenizer has more tokens than the model's embedding has rows.

    Only ``config.json`` is read (no model is built). A model with more rows than tokens is fine (vocabularies
    are often padded to a multiple of 64 or 128).
    """
    size = _vocab_size(os.fspath(model_dir))
    if size is not None and len(tokenizer) > size:
        raise ValueError(
            f"the tokenizer at {os.fspath(tokenizer_dir)!r} has {len(tokenizer)} tokens but the model at "
            f"{os.fspath(model_dir)!r} has an embedding of {size} rows (config.json vocab_size): token ids "
            f">= {size} have no embedding; use the tokenizer the model was trained with"
        )
