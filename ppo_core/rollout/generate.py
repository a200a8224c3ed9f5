"""Batched autoregressive sampling from a causal LM: left-padded prompts, temperature, nucleus (top-p), EOS.

The model is any ``nn.Module`` called as ``model(input_ids, attention_mask=mask)`` that returns logits
``[B, T, V]`` (or an object with a ``.logits`` attribute). A Hugging Face causal LM (a
``transformers.PreTrainedModel`` with an ``lm_head``, or a wrapper exposing one as ``.model``, like
:class:`ppo_core.models.hf.HFCausalLM`) decodes through the static KV cache of
:class:`ppo_core.rollout.hf.HFRolloutEngine` (CUDA graphs on a GPU). A model with a ``new_cache()`` method (like
:class:`ppo_core.models.TinyGPT`) decodes incrementally: ``model(new_ids, attention_mask=mask, cache=cache)``
sees one new token per call. Otherwise (or with ``use_cache=False``) the whole sequence is recomputed each step
(same tokens, slower).

Output keys (verl's layout, :func:`~ppo_core.rollout.layout.rollout_batch`): ``prompts [B, P]`` (left-padded:
as given, or right-padded ones left-padded), ``responses [B, R]`` (right-padded with ``pad_token_id``,
``R = max_new_tokens``), ``input_ids [B, P+R]``, ``attention_mask [B, P+R]``, ``response_mask [B, R]`` (1 up to
and including the first EOS, 0 after it) and ``rollout_log_probs [B, R]`` (see
:func:`~ppo_core.rollout.sampling.sampling_log_probs`; 0 after the end). Bad inputs raise before any forward
(:mod:`~ppo_core.rollout.prompt_checks`).
"""

from __future__ import annotations

import sys

import torch
from tensordict import TensorDict
from torch import nn

from ppo_core.rollout.layout import rollout_batch
from ppo_core.rollout.prompt_checks import check_prompts, check_token_id, vocab_size_of
from ppo_core.rollout.sampling import SamplingConfig, logits_of, sample_tokens

__all__ = ["generate"]


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
        prompts: ``[B, P]`` int64 token ids, left-padded (right-padded ones are left-padded first, and returned so:
            :func:`~ppo_core.rollout.prompt_checks.check_prompts`). ``B = 0`` returns empty outputs
            (``responses [0, max_new_tokens]``).
        prompt_mask: ``[B, P]`` 1 on prompt tokens, 0 on padding; every row needs a prompt token.
        config: sampling settings.
        generator: RNG on the model's device (required unless ``config.temperature == 0``).

    Raises ``ValueError`` naming the argument for a bad prompt batch (see
    :func:`~ppo_core.rollout.prompt_checks.check_prompts`) and for an EOS or pad id outside the model's vocabulary.

    Returns:
        A ``TensorDict`` of batch size ``[B]`` with ``prompts``, ``responses``, ``input_ids``, ``attention_mask``,
        ``response_mask`` and ``rollout_log_probs`` (see the module docstring).

    Example:
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> lm = TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_layers=1, n_heads=2))
        >>> out = generate(lm, torch.tensor([[0, 3], [4, 5]]), torch.tensor([[0, 1], [1, 1]]),
        ...                SamplingConfig(max_new_tokens=4, eos_token_id=7), generator=torch.Generator().manual_seed(0))
        >>> out["input_ids"].shape, out["rollout_log_probs"].shape
        (torch.Size([2, 6]), torch.Size([2, 4]))
    """
    if config.temperature > 0 and generator is None:
        raise ValueError("generator is required when temperature > 0 (ppo-core never uses the global RNG)")
    if config.use_cache:
        hf_model = _hf_causal_lm(model)
        if hf_model is not None:
            from ppo_core.rollout.hf import HFRolloutEngine

            # the engine's decoder checks the prompts and token ids (against the vocabulary it decodes)
            engine = HFRolloutEngine(hf_model, batch_invariant=config.batch_invariant)
            return engine.generate(prompts, prompt_mask, config, generator=generator)
    vocab_size = vocab_size_of(model)
    checked = check_prompts(prompts, prompt_mask, vocab_size)
    check_token_id("config.eos_token_id", config.eos_token_id, vocab_size, optional=True)
    check_token_id("config.pad_token_id", config.pad_token_id, vocab_size)
    prompts, mask_BP = checked.prompts, checked.mask.long()
    if config.batch_invariant:
        raise ValueError(
            f"batch_invariant=True (SamplingConfig; actor.worker.rollout.batch_invariant in a trainer config) needs a "
            f"Llama-family Hugging Face causal LM with use_cache=True; "
            f"{type(model).__name__} is sampled by the generic loop"
        )
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
    for t in range(R if B else 0):  # B = 0: no row to decode, the empty outputs of the documented shapes
        if cache is not None:
            logits = logits_of(model(step_ids, attention_mask=mask, cache=cache))
        else:
            logits = logits_of(model(ids, attention_mask=mask))
        last = logits[:, -1]
        noise = None
        if config.temperature > 0:  # the draw every decoding path shares, from the same generator stream
            noise = torch.empty(last.shape, device=device).uniform_(generator=generator)
        tok, step_lp = sample_tokens(
            last, noise, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
        )
        running = ~done
        tok = torch.where(running, tok, config.pad_token_id)
        responses[:, t] = tok
        response_mask[:, t] = running.long()
        log_probs[:, t] = torch.where(running, step_lp.float(), 0.0)
        mask = torch.cat([mask, response_mask[:, t : t + 1]], dim=1)
        ids = torch.cat([ids, tok[:, None]], dim=1)
        step_ids = tok[:, None]
        if config.eos_token_id is not None:
            done = done | (running & (tok == config.eos_token_id))
            if bool(done.all()):
                break
    # steps after every response ended (early break) were not decoded: log-prob 0, like every masked position
    return rollout_batch(prompts, mask_BP, responses, response_mask, log_probs)


def _hf_causal_lm(model: nn.Module) -> nn.Module | None:
    """The ``transformers`` causal LM behind ``model`` (itself, or a wrapper's ``.model``), else None.

    Checked without importing ``transformers`` when nothing has imported it.
    """
    tf = sys.modules.get("transformers")
    if tf is None:
        return None
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, tf.PreTrainedModel) and hasattr(candidate, "lm_head"):
            return candidate
    return None
