"""``ppo-core sft``: a short supervised warm-up on prompt/response pairs, written as a new checkpoint.

Its documented use is the *format* warm-up of the example: ``ppo-core make-data`` writes pairs whose responses
have the answer's layout (``#### N``) with a random ``N``, so the model learns where the answer goes but not what
it is, and PPO then has a well-formed answer to improve. Any pairs work (a real SFT set: the reference solutions).

Each pair is the prompt's chat template with the generation prompt (:func:`ppo_core.data.tokenize_chat`, exactly
what the PPO prompts are) followed by the response's tokens and the end-of-turn token (the run's EOS, which stops
sampling: :mod:`ppo_core_cli.tokens`); the loss is the mean next-token cross-entropy over the response tokens only
(:func:`response_nll`). Shape legend: ``B`` pairs, ``S`` tokens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ppo_core.data import iter_prompt_rows, parse_prompt_row, tokenize_chat
from ppo_core.data.readers import normalize_paths
from ppo_core.data.schema import PromptSchemaError
from ppo_core_cli.config import SFTConfig

__all__ = [
    "SFTPair",
    "SFTResult",
    "collate_sft",
    "load_sft_pairs",
    "response_nll",
    "run_sft",
    "tokenize_sft_pair",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTPair:
    """A tokenised pair: ``input_ids`` (prompt then response) and ``loss_mask`` (1 on the response tokens)."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass(kw_only=True)
class SFTResult:
    """What :func:`run_sft` did."""

    output_dir: str
    """The written checkpoint."""
    losses: list[float] = field(default_factory=list)
    """Loss of every step."""
    num_pairs: int = 0
    """Pairs read."""
    seconds: float = 0.0
    """Wall time of the optimisation."""


def tokenize_sft_pair(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    response: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    *,
    eos_token_id: int | None = None,
) -> SFTPair:
    """``chat_template(messages) + tokens(response) + [eos]``, with the loss on the response and the EOS.

    ``eos_token_id``: the end-of-turn token (the run's resolved EOS, :mod:`ppo_core_cli.tokens`); None: the
    tokenizer's EOS.

    Example:
        >>> # pair = tokenize_sft_pair(tok, [{"role": "user", "content": "1+1?"}], "#### 2")
    """
    prompt = tokenize_chat(tokenizer, messages, chat_template_kwargs)
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: the response could not end")
    answer = [int(i) for i in tokenizer(response, add_special_tokens=False)["input_ids"]]
    answer.append(int(eos))
    return SFTPair(input_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer))


class SFTInputError(ValueError):
    """The pairs' files cannot make a warm-up (a row without its prompt or response, a pair past
    ``sft.max_length``...): the command prints it as a ``ppo-core: error:`` line, no traceback."""


def load_sft_pairs(
    files: str | Sequence[str],
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    max_length: int = 1024,
    eos_token_id: int | None = None,
) -> list[SFTPair]:
    """Read and tokenise the pairs of parquet / JSON Lines files; errors name the file, the row and the field.

    ``eos_token_id`` ends every response (None: the tokenizer's EOS)."""
    pairs = []
    for origin, row in iter_prompt_rows(normalize_paths(files)):
        # only the messages are read here: the row need not carry a data source or a ground truth
        record = parse_prompt_row(
            origin,
            row,
            prompt_key=prompt_key,
            require_ground_truth=False,
            prompt_key_name="sft.prompt_key",
            default_data_source="sft",
        )
        response = row.get(response_key)
        # named as the prompt's missing column is: the row's own columns, and the key that names it
        if response_key not in row:
            columns = ", ".join(sorted(map(str, row))) or "none"
            raise PromptSchemaError(
                origin,
                response_key,
                f"missing: the row has no such column (its columns: {columns}); sft.response_key names the "
                "responses' column (a prompt file of the training's data has none: give the warm-up's pairs)",
            )
        if not isinstance(response, str) or not response:
            raise PromptSchemaError(origin, response_key, f"must be a non-empty string, got {response!r}")
        pair = tokenize_sft_pair(tokenizer, record.messages, response, eos_token_id=eos_token_id)
        if len(pair.input_ids) > max_length:
            raise ValueError(
                f"{origin}: the pair is {len(pair.input_ids)} tokens, more than sft.max_length={max_length}"
            )
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"no pair in {files}")
    return pairs


def collate_sft(pairs: Sequence[SFTPair], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask``, each ``[B, S]`` (int64).

    Example:
        >>> b = collate_sft([SFTPair([5, 6, 7], [0, 1, 1]), SFTPair([8], [1])], pad_token_id=0)
        >>> b["input_ids"].tolist(), b["loss_mask"].tolist()
        ([[5, 6, 7], [8, 0, 0]], [[0, 1, 1], [1, 0, 0]])
    """
    width = max(len(p.input_ids) for p in pairs)
    ids = torch.full((len(pairs), width), int(pad_token_id), dtype=torch.long)
    attention = torch.zeros((len(pairs), width), dtype=torch.long)
    loss = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, pair in enumerate(pairs):
        n = len(pair.input_ids)
        ids[i, :n] = torch.tensor(pair.input_ids)
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(pair.loss_mask)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def response_nll(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood over the tokens where ``loss_mask`` is 1.

    Token ``t`` is predicted by the logits at position ``t - 1``, so the first token is never a target.

    Args:
        logits: ``[B, S, V]`` (computed in fp32 whatever their dtype).
        input_ids: ``[B, S]``.
        loss_mask: ``[B, S]``, 1 on the target tokens.

    Returns:
        A scalar; 0 (still differentiable) when no target token is masked in.

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
        >>> round(float(response_nll(logits, torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]]))), 4)
        1.3863
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape or input_ids.shape != loss_mask.shape:
        raise ValueError(
            f"logits [B, S, V], input_ids and loss_mask [B, S] must agree, got {tuple(logits.shape)}, "
            f"{tuple(input_ids.shape)}, {tuple(loss_mask.shape)}"
        )
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(torch.float32)
    nll = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(mask)
    return (nll * mask).sum() / mask.sum().clamp(min=1.0)


def run_sft(
    cfg: SFTConfig,
    *,
    dtype: str = "float32",
    attn_implementation: str | None = "sdpa",
    eos_token: str | None = None,
    pad_token: str | None = None,
) -> SFTResult:
    """Train ``cfg.model_path`` on the pairs of ``cfg.files`` for ``cfg.steps`` steps and write ``cfg.output_dir``.

    Batches are drawn with replacement from a generator seeded by ``cfg.seed`` (the global RNG is not used), the
    optimiser is AdamW at a constant learning rate with the gradient norm clipped to 1, dropout is off. The EOS
    appended to every response and the padding are resolved as for training (``eos_token`` / ``pad_token``: the
    job's ``model.eos_token`` / ``model.pad_token``; :mod:`ppo_core_cli.tokens`); the written checkpoint's
    ``generation_config.json`` carries their ids.
    """
    from transformers import AutoTokenizer

    from ppo_core.models.hf import export_hf, load_causal_lm, unwrap_hf_model
    from ppo_core_cli.tokens import check_vocabulary_fits, resolve_special_tokens

    for name in ("model_path", "output_dir"):
        if not getattr(cfg, name):
            raise ValueError(f"sft.{name} must be set")
    if not cfg.files:
        raise ValueError("sft.files must name at least one file of prompt/response pairs")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path, local_files_only=True)
    check_vocabulary_fits(tokenizer, cfg.model_path, cfg.model_path)
    tokens = resolve_special_tokens(tokenizer, eos_token=eos_token, pad_token=pad_token, where=cfg.model_path)
    try:  # the files' contents (a row without its prompt, a pair too long...): one line, no traceback
        pairs = load_sft_pairs(
            cfg.files,
            tokenizer,
            prompt_key=cfg.prompt_key,
            response_key=cfg.response_key,
            max_length=cfg.max_length,
            eos_token_id=tokens.eos_token_id,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise SFTInputError(str(exc)) from exc
    pad = tokens.pad_token_id
    model = load_causal_lm(cfg.model_path, dtype=dtype, attn_implementation=attn_implementation)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    result = SFTResult(output_dir=os.fspath(cfg.output_dir), num_pairs=len(pairs))
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        rows = torch.randint(0, len(pairs), (cfg.batch_size,), generator=generator).tolist()
        batch = collate_sft([pairs[i] for i in rows], pad)
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = response_nll(logits, batch["input_ids"], batch["loss_mask"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result.losses.append(float(loss.detach()))
        if step % cfg.log_every == 0 or step == cfg.steps:
            logger.info("sft step %d/%d: loss %.4f", step, cfg.steps, result.losses[-1])
    result.seconds = time.perf_counter() - start
    model.eval()
    generation = unwrap_hf_model(model).generation_config
    generation.eos_token_id, generation.pad_token_id = tokens.eos_token_id, tokens.pad_token_id
    export_hf(model, cfg.model_path, cfg.output_dir)
    return result
