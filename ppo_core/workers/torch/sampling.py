"""Batched autoregressive sampling from a causal LM: temperature, nucleus (top-p), EOS, left-padded prompts.

The model is any ``nn.Module`` called as ``model(input_ids, attention_mask=mask)`` that returns logits
``[B, T, V]`` (or an object with a ``.logits`` attribute). If it has a ``new_cache()`` method (like
:class:`ppo_core.models.TinyGPT`), decoding is incremental: ``model(new_ids, attention_mask=mask, cache=cache)``
sees one new token per call; otherwise the whole sequence is recomputed each step (same result, slower).

Output keys (verl's layout): ``prompts [B, P]`` (left-padded, as given), ``responses [B, R]`` (right-padded with
``pad_token_id``, ``R = max_new_tokens``), ``input_ids [B, P+R]``, ``attention_mask [B, P+R]`` and
``response_mask [B, R]``: 1 up to and including the first EOS, 0 after it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import nn

from ppo_core._checks import check_mask, check_ndim, check_tensor, check_unit_interval
from ppo_core._config import ConfigBase
from ppo_core.rollout.sampler import sample_tokens, top_p_filter

__all__ = ["SamplingConfig", "generate", "logits_of", "sample_from_logits", "top_p_filter"]


@dataclass(kw_only=True)
class SamplingConfig(ConfigBase):
    """How to sample responses."""

    max_new_tokens: int = 16
    """Response length ``R``: tokens sampled per prompt (responses are padded to it)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (1 keeps all)."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens before sampling (0 keeps all)."""
    eos_token_id: int | None = None
    """Token that ends a response (kept, with mask 1); None means every response has ``max_new_tokens`` tokens."""
    pad_token_id: int = 0
    """Token written after EOS (mask 0)."""
    use_cache: bool = True
    """Decode incrementally with the model's KV cache when it has ``new_cache()``."""

    def __post_init__(self) -> None:
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        check_unit_interval("top_p", self.top_p)
        if int(self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p == 0:
            raise ValueError("top_p must be > 0 (use temperature=0 for greedy decoding)")


def logits_of(output: object) -> torch.Tensor:
    """The logits tensor of a model output: the output itself, or its ``.logits`` (Hugging Face style)."""
    return output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]


def sample_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, V]``: greedy when ``temperature == 0``, else sampled.

    Draws ``[B, V]`` uniform noise from ``generator`` and applies
    :func:`ppo_core.rollout.sampler.sample_tokens` (the Gumbel-max draw every decoding path shares).

    Args:
        logits: ``[B, V]`` next-token logits.
        temperature: divides the logits; 0 picks the argmax.
        top_p: nucleus mass (see :func:`top_p_filter`). top_k: most likely tokens kept (0: all).
        generator: RNG on ``logits.device``; required unless decoding greedily.

    Returns:
        ``[B]`` int64 token ids.

    Example:
        >>> sample_from_logits(torch.tensor([[0.0, 9.0]]), temperature=0, generator=None)
        tensor([1])
    """
    if temperature == 0:
        return sample_tokens(logits, None, temperature=0.0)[0]
    if generator is None:
        raise ValueError("generator is required when temperature > 0 (ppo-core never uses the global RNG)")
    noise = torch.empty(logits.shape, device=logits.device).uniform_(generator=generator)
    return sample_tokens(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)[0]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: SamplingConfig,
    *,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """Sample one response per (left-padded) prompt.

    Args:
        model: the causal LM (see the module docstring for the calling convention). Put it in eval mode if it
            has dropout; this function does not change its mode.
        prompts: ``[B, P]`` int64 token ids, left-padded.
        prompt_mask: ``[B, P]`` 1 on prompt tokens, 0 on left padding.
        config: sampling settings.
        generator: RNG on the model's device (required unless ``config.temperature == 0``).

    Returns:
        A ``TensorDict`` of batch size ``[B]`` with ``prompts``, ``responses``, ``input_ids``, ``attention_mask``
        and ``response_mask`` (see the module docstring).

    Example:
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> lm = TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_layers=1, n_heads=2))
        >>> out = generate(lm, torch.tensor([[0, 3], [4, 5]]), torch.tensor([[0, 1], [1, 1]]),
        ...                SamplingConfig(max_new_tokens=4, eos_token_id=7), generator=torch.Generator().manual_seed(0))
        >>> out["input_ids"].shape
        torch.Size([2, 6])
    """
    check_ndim("prompts", check_tensor("prompts", prompts), 2)
    mask_BP = check_mask("prompt_mask", prompt_mask, like=prompts, like_name="prompts").long()
    if config.temperature > 0 and generator is None:
        raise ValueError("generator is required when temperature > 0 (ppo-core never uses the global RNG)")
    if config.use_cache and _is_hf_causal_lm(model):
        from ppo_core.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model).generate(prompts, mask_BP, config, generator=generator)
    B, R = prompts.shape[0], config.max_new_tokens
    device = prompts.device
    use_cache = config.use_cache and callable(getattr(model, "new_cache", None))
    cache = model.new_cache() if use_cache else None
    responses = torch.full((B, R), config.pad_token_id, dtype=torch.long, device=device)
    response_mask = torch.zeros(B, R, dtype=torch.long, device=device)
    log_probs = torch.zeros(B, R, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    ids, mask = prompts, mask_BP
    step_ids = prompts
    for t in range(R):
        if cache is not None:
            logits = logits_of(model(step_ids, attention_mask=mask, cache=cache))
        else:
            logits = logits_of(model(ids, attention_mask=mask))
        last = logits[:, -1]
        noise = None
        if config.temperature > 0:  # the draw every decoding path shares, from the same generator stream
            noise = torch.empty(last.shape, device=device).uniform_(generator=generator)
        tok, logp = sample_tokens(
            last, noise, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        running = ~done
        tok = torch.where(running, tok, config.pad_token_id)
        responses[:, t] = tok
        response_mask[:, t] = running.long()
        log_probs[:, t] = torch.where(running, logp, 0.0)
        mask = torch.cat([mask, response_mask[:, t : t + 1]], dim=1)
        ids = torch.cat([ids, tok[:, None]], dim=1)
        step_ids = tok[:, None]
        if config.eos_token_id is not None:
            done = done | (running & (tok == config.eos_token_id))
            if bool(done.all()):
                break
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([mask_BP, response_mask], dim=1),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
        },
        batch_size=[B],
    )


def _is_hf_causal_lm(model: nn.Module) -> bool:
    """A ``transformers`` model (checked without importing ``transformers`` when nothing has)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel) and hasattr(model, "lm_head")
