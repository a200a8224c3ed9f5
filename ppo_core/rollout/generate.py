"""Batched autoregressive sampling from a causal LM: left-padded prompts, temperature, nucleus (top-p), EOS.

The model is any ``nn.Module`` called as ``model(input_ids, attention_mask=mask)`` that returns logits
``[B, T, V]`` (or an object with a ``.logits`` attribute). ``config.engine`` names the engine that samples
(:mod:`~ppo_core.rollout.registry`); ``auto`` (the default) is
:func:`~ppo_core.rollout.registry.auto_engine_name`: a Hugging Face causal LM (a ``transformers.PreTrainedModel``
with an ``lm_head``, or a wrapper exposing one as ``.model``, like :class:`ppo_core.models.hf.HFCausalLM`) decodes
through the static KV cache of the ``hf`` engine (CUDA graphs on a GPU) unless ``use_cache=False``; any other model
runs the ``reference`` loop here. The first call for a model builds its engine and later calls reuse it
(:func:`engine_for`). In the reference loop a model with a ``new_cache()`` method (like
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

import copyreg
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from ppo_core.models.hf import positions_from_mask
from ppo_core.rollout.layout import rollout_batch
from ppo_core.rollout.prompt_checks import check_prompts, check_token_id, vocab_size_of
from ppo_core.rollout.registry import AUTO, auto_engine_name, hf_causal_lm
from ppo_core.rollout.sampling import SamplingConfig, logits_of, sample_tokens

__all__ = ["engine_for", "generate", "reference_generate"]


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
    name = config.engine  # a registered name: checked when the config was built
    if name == AUTO:
        name = auto_engine_name(model, use_cache=config.use_cache)
    if name != "reference":
        # the engine checks the generator, the prompts and the token ids (against the vocabulary it decodes)
        return engine_for(model, name, config).generate(prompts, prompt_mask, config, generator=generator)
    return reference_generate(model, prompts, prompt_mask, config, generator=generator)


@torch.no_grad()
def reference_generate(
    model: nn.Module,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    config: SamplingConfig,
    *,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """The ``reference`` engine's loop (what :func:`generate` runs for it, whatever ``config.engine`` says): full
    recomputation, or the model's own ``new_cache()``. Arguments, checks and output as :func:`generate`."""
    if config.temperature > 0 and generator is None:
        raise ValueError("generator is required when temperature > 0 (ppo-core never uses the global RNG)")
    vocab_size = vocab_size_of(model)
    checked = check_prompts(prompts, prompt_mask, vocab_size)
    check_token_id("config.eos_token_id", config.eos_token_id, vocab_size, optional=True)
    check_token_id("config.pad_token_id", config.pad_token_id, vocab_size)
    prompts, mask_BP = checked.prompts, checked.mask.long()
    if config.batch_invariant:
        raise ValueError(
            f"batch_invariant=True (SamplingConfig; rollout.batch_invariant in a job or trainer config) needs a "
            f"Llama-family Hugging Face causal LM with use_cache=True; "
            f"{type(model).__name__} is sampled by the generic loop"
        )
    B, R = prompts.shape[0], config.max_new_tokens
    device = prompts.device
    use_cache = config.use_cache and callable(getattr(model, "new_cache", None))
    cache = model.new_cache() if use_cache else None
    # a transformers causal LM called directly counts positions from 0 at the first column, left padding included:
    # its position ids are given, counted over the real tokens (a wrapper such as HFCausalLM does this itself)
    counts_positions = hf_causal_lm(model) is model
    responses = torch.full((B, R), config.pad_token_id, dtype=torch.long, device=device)
    response_mask = torch.zeros(B, R, dtype=torch.long, device=device)
    log_probs = torch.zeros(B, R, dtype=torch.float32, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    ids, mask = prompts, mask_BP
    step_ids = prompts
    for t in range(R if B else 0):  # B = 0: no row to decode, the empty outputs of the documented shapes
        if cache is not None:
            logits = logits_of(model(step_ids, attention_mask=mask, cache=cache))
        elif counts_positions:
            logits = logits_of(model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)))
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


_SLOT = "_ppo_core_rollout_engines"


class _EngineSlot(dict):
    """The engines :func:`engine_for` built for one model, kept on the model itself (so they live and die with it:
    a weak-keyed table would leak, since an engine holds its model). Copies and pickles of the model get an empty
    slot: an engine (graphs, caches) belongs to the module it was built on."""

    def __deepcopy__(self, memo: dict) -> _EngineSlot:
        return _EngineSlot()

    def __copy__(self) -> _EngineSlot:
        return _EngineSlot()


copyreg.pickle(_EngineSlot, lambda slot: (_EngineSlot, ()))


def engine_for(model: nn.Module, name: str, config: SamplingConfig) -> Any:
    """The rollout engine ``name`` for ``model``, built from its typed config on first use
    (:meth:`~ppo_core.rollout.sampling.SamplingConfig.build_engine`) and reused by every later call with the same
    engine settings and ``batch_invariant`` while the model keeps its device and dtype.

    An engine reads the model's current weights at every generation (the Hugging Face engine refreshes its
    concatenated weights every generation, and replays the previous generation's graphs only where every tensor they
    read is back at its address), so reusing it after a weight update is correct; a model moved to another device or
    dtype gets a new engine.
    """
    param = next(model.parameters(), None)
    placement = (None, None) if param is None else (param.device, param.dtype)
    settings = config.engine_settings(model, auto=name)
    key = (name, repr(settings), bool(config.batch_invariant), *placement)
    slot = model.__dict__.get(_SLOT)
    if slot is None:
        slot = _EngineSlot()
        object.__setattr__(model, _SLOT, slot)
    engine = slot.get(key)
    if engine is None:
        # an engine built for other options or an old placement is dropped (one engine per model and name)
        for stale in [k for k in slot if k[0] == name]:
            del slot[stale]
        engine = settings.build_checked(model, config)
        slot[key] = engine
    return engine
