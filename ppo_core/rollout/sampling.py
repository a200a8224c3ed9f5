"""Sampling settings and the per-step sampling rule: temperature, top-k, nucleus (top-p), greedy decoding.

A token is drawn with the Gumbel-max trick: ``argmax(filtered_logits / T - log(-log u))`` with ``u ~ U[0, 1)`` per
vocabulary entry is an exact draw from ``softmax(filtered_logits / T)``. The noise is an input
(:func:`sample_tokens`), filled by the caller from its ``torch.Generator``, so that

- the draw is reproducible from the generator alone (no global RNG),
- the same function runs inside a captured CUDA graph (no RNG state in the graph: the noise buffer is refilled
  before each replay),
- every decoding path (full recomputation, the model's own cache, the static-cache engines of
  :mod:`ppo_core_decode.decoding`) draws the same tokens from the same logits and the same generator, except
  the static-cache engines' CUDA temperature sampling without top-k/top-p: there the fused kernels of
  :mod:`ppo_core_decode.fused_sampling` make the noise themselves from a seed drawn from the generator (same
  generator, same tokens, with or without CUDA graphs, but not the tokens of the other paths).

The log-probability returned with each token (``rollout_log_probs``) is ``log_softmax(logits / T)`` at the drawn
token, *before* top-k/top-p truncation: what ``compute_log_prob`` computes for the same token, so comparing the
two measures the numerical mismatch between the engines only. Greedy decoding (``T = 0``) scores at ``T = 1``.

Example:
    >>> logits = torch.tensor([[0.0, 2.0, 1.0]])
    >>> sample_from_logits(logits, temperature=0, generator=None)
    tensor([1])
    >>> sampling_log_probs(logits, torch.tensor([1]), temperature=0)  # greedy scores at temperature 1
    tensor([-0.4076])
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ppo_core._checks import FieldTypeError, FieldValueError, check_int, check_number, check_positive
from ppo_core._config_base import ConfigBase, _nested
from ppo_core.kernels.compiled import cuda_compiled
from ppo_core.rollout.engine_config import RolloutEngineConfig
from ppo_core.rollout.registry import AUTO, auto_engine_name, check_engine_name, rollout_engine_config

__all__ = [
    "SamplingConfig",
    "logits_of",
    "sample_from_logits",
    "sample_tokens",
    "sampling_log_probs",
    "top_k_filter",
    "top_p_filter",
]


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
    """Decode with a KV cache: the static-cache engine for Hugging Face causal LMs, the model's own
    ``new_cache()`` when it has one; False recomputes the whole sequence for every token."""
    batch_invariant: bool = False
    """Sample with batch-invariant numerics (Llama-family Hugging Face models through
    :class:`~ppo_core_decode.hf.HFRolloutEngine`, the megatron engine at tensor-parallel size 1): each row's logits
    are the same bits whatever else is in the batch, so a prompt's response does not depend on its batch and cached
    decoding equals full recomputation bit for bit. Slower; an engine that cannot do it raises ``ValueError``."""
    engine: str = "auto"
    """The rollout engine, by its registered name (:mod:`~ppo_core.rollout.registry`): ``auto`` (the engine
    :func:`~ppo_core.rollout.registry.auto_engine_name` picks for the model, with its default settings),
    ``reference`` (the simple loop), ``hf`` (Hugging Face causal LMs), ``megatron`` (the megatron actor), or one
    you registered. An actor worker builds it once and reuses it for every step;
    :func:`~ppo_core.rollout.generate.generate` keeps the one it built for a model."""
    engine_config: dict[str, Any] | RolloutEngineConfig | None = None
    """The named engine's settings (its config class, :mod:`~ppo_core.rollout.engine_config`: ``hf`` takes
    ``kv_bucket``, ``check_every``, ``cuda_graphs``, ``keep_cache``...; the reference ``ppo-core config
    rollout.engine=hf`` lists them), checked when this config is built; an instance of that class once built.
    None: the engine's defaults. Needs a named ``engine`` (not ``auto``)."""

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_positive("temperature", self.temperature, allow_zero=True)
        if self.top_p == 0:
            raise FieldValueError("top_p", " must be > 0 (use temperature=0 for greedy decoding)")
        check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise FieldValueError("top_p", f" must be in (0, 1], got {self.top_p}")
        check_int("top_k", self.top_k, 0)
        try:
            check_engine_name(self.engine)
        except ValueError as err:
            raise FieldValueError("engine", str(err).removeprefix("engine")) from None
        generic = self.engine == "reference" or (self.engine == AUTO and not self.use_cache)
        if self.batch_invariant and generic:  # the generic loop refuses it at every step: say so now
            raise FieldValueError(
                "batch_invariant",
                f"=True needs the hf engine (a Llama-family Hugging Face causal LM) or megatron's, with use_cache=True; "
                f"engine={self.engine!r}, use_cache={self.use_cache} samples with the generic loop, which is not "
                "batch-invariant",
            )
        self.engine_config = self._typed_engine_config()

    def _typed_engine_config(self) -> RolloutEngineConfig | None:
        """``engine_config`` as the named engine's config class (its own checks run here, once)."""
        given = self.engine_config
        if self.engine == AUTO:
            if given:  # a non-empty mapping or a config instance
                raise FieldValueError(
                    "engine_config",
                    f" is set ({type(given).__name__}) but engine='auto' picks the engine per model; name the engine "
                    "whose settings these are (engine: hf, megatron, ...)",
                )
            return None
        cls = rollout_engine_config(self.engine)
        if isinstance(given, RolloutEngineConfig):
            if type(given) is not cls:
                raise FieldTypeError(
                    "engine_config",
                    f" must be a {cls.__name__} (the settings of engine={self.engine!r}), got {type(given).__name__}",
                )
            return given
        names = [f.name for f in dataclasses.fields(cls)]
        return _nested("engine_config", lambda: cls.from_dict(given or {}), fields=names)

    def sampling_fields(self) -> SamplingConfig:
        """This config's :class:`SamplingConfig` fields as a plain ``SamplingConfig``: how a section that extends it
        (the trainer's and the job's ``rollout``, which add ``n``...) hands its sampling to the actor worker. The
        values were checked when this config was built: they are copied, not checked again."""
        out = object.__new__(SamplingConfig)
        for f in dataclasses.fields(SamplingConfig):
            object.__setattr__(out, f.name, getattr(self, f.name))
        return out

    def with_special_tokens(self, *, eos_token_id: int | None, pad_token_id: int) -> SamplingConfig:
        """A copy with the run's EOS and padding ids (the tokenizer's): their types are checked here, the other
        settings are not checked again; an engine checks the ids against its vocabulary when it samples."""
        out = copy.copy(self)
        out.eos_token_id = None if eos_token_id is None else check_int("eos_token_id", eos_token_id)
        out.pad_token_id = check_int("pad_token_id", pad_token_id)
        return out

    def engine_settings(self, model: nn.Module, *, auto: str | None = None) -> RolloutEngineConfig:
        """The typed config of the engine that samples for ``model``: :attr:`engine_config` for a named engine,
        else the default config of the engine ``auto`` picks (``auto``: the caller's own pick, as the megatron
        actor makes; None: :func:`~ppo_core.rollout.registry.auto_engine_name`)."""
        if isinstance(self.engine_config, RolloutEngineConfig):
            return self.engine_config
        name = self.engine
        if name == AUTO:
            name = auto if auto is not None else auto_engine_name(model, use_cache=self.use_cache)
        return rollout_engine_config(name)()

    def build_engine(self, model: nn.Module, *, auto: str | None = None) -> Any:
        """The rollout engine for ``model`` (:meth:`engine_settings` ``.build(model, self)``): an actor worker calls
        this once and reuses the engine for every step."""
        return self.engine_settings(model, auto=auto).build_checked(model, self)


def logits_of(output: object) -> torch.Tensor:
    """The logits tensor of a model output: the output itself, or its ``.logits`` (Hugging Face style)."""
    return output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to ``-inf`` the logits outside the nucleus: the most likely tokens whose probability mass reaches ``top_p``.

    A token is kept when the mass of the strictly more likely tokens is below ``top_p``, so the most likely
    token is always kept.

    Args:
        logits: ``[..., V]``.
        top_p: in (0, 1]; 1 returns ``logits`` unchanged.

    Example:
        >>> top_p_filter(torch.tensor([2.0, 1.0, 0.0]).log(), 0.5)
        tensor([0.6931,   -inf,   -inf])
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set to ``-inf`` every logit below the ``top_k``-th largest of its row (ties at the boundary are kept).

    Args:
        logits: ``[..., V]``.
        top_k: tokens to keep; 0 (or >= V) keeps all.

    Example:
        >>> top_k_filter(torch.tensor([1.0, 3.0, 2.0]), 2)
        tensor([-inf, 3., 2.])
    """
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


@cuda_compiled
def _draw(
    logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(dtype)
    if temperature > 0:
        scaled = scaled / temperature
    log_probs = scaled.log_softmax(dim=-1)
    if temperature == 0:
        tokens = scaled.argmax(dim=-1)
    else:
        filtered = top_p_filter(top_k_filter(scaled, top_k), top_p)
        gumbel = -torch.log(-torch.log(noise.to(dtype)))
        tokens = (filtered + gumbel).argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` and its log-probability at the sampling temperature (see the module
    docstring): the draw of every decoding path.

    Args:
        logits: ``[B, V]`` next-token logits (the maths is fp32, fp64 for fp64 logits).
        noise: ``[B, V]`` uniform noise in ``[0, 1)``; ignored (may be None) when ``temperature == 0``.
        temperature: divides the logits; 0 decodes greedily.
        top_k: keep the ``top_k`` most likely tokens (0: all).
        top_p: nucleus mass in (0, 1] (1: all).

    Returns:
        ``(tokens [B] int64, log_probs [B])``; ``log_probs`` is ``log_softmax(logits / T)`` at the token (``T = 1``
        when greedy), before truncation.

    Raises:
        ValueError: ``noise`` is missing or not ``[B, V]`` while sampling.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> tok, _ = sample_tokens(torch.tensor([[0.0, 2.0, 1.0]]), torch.rand(1, 3, generator=g),
        ...                        temperature=1.0, top_k=1)
        >>> tok.tolist()
        [1]
    """
    if temperature > 0 and (noise is None or noise.shape != logits.shape):
        got = None if noise is None else tuple(noise.shape)
        raise ValueError(f"noise must be a [B, V] = {tuple(logits.shape)} tensor when sampling, got {got}")
    if logits.is_cuda:  # the Triton sampler lives in the decode package (imported on first use)
        from ppo_core_decode.fused_sampling import fused_sample, fused_sampling_available

        if fused_sampling_available(logits, top_k, top_p):  # no truncation: one read of logits and noise
            return fused_sample(logits, noise, float(temperature))
    return _draw(logits, noise, float(temperature), int(top_k), float(top_p))


def sample_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, V]``: greedy when ``temperature == 0``, else sampled.

    Draws ``[B, V]`` uniform noise from ``generator`` and applies :func:`sample_tokens`.

    Args:
        logits: ``[B, V]`` next-token logits.
        temperature: divides the logits; 0 picks the argmax.
        top_p: nucleus mass (see :func:`top_p_filter`). top_k: most likely tokens kept (0: all).
        generator: RNG on ``logits.device``; required unless decoding greedily.

    Returns:
        ``[B]`` int64 token ids.
    """
    if temperature == 0:
        return sample_tokens(logits, None, temperature=0.0)[0]
    if generator is None:
        raise ValueError("generator is required when temperature > 0 (ppo-core never uses the global RNG)")
    noise = torch.empty(logits.shape, device=logits.device).uniform_(generator=generator)
    return sample_tokens(logits, noise, temperature=temperature, top_k=top_k, top_p=top_p)[0]


def sampling_log_probs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Log-prob of ``tokens`` under the sampling distribution ``log_softmax(logits / T)``, in fp32 or fp64.

    ``T = temperature``, except that greedy decoding (``T = 0``) scores at ``T = 1``, as ``compute_log_prob`` does.
    Top-p truncation is not applied: this is the probability the training engine computes for the same token.

    Args:
        logits: ``[B, V]`` next-token logits.
        tokens: ``[B]`` int64 token ids.
        temperature: the sampling temperature (>= 0).

    Returns:
        ``[B]`` log-probabilities (fp64 for fp64 logits, else fp32).
    """
    t = temperature if temperature > 0 else 1.0
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    log_p = torch.log_softmax(logits.to(dtype) / t, dim=-1)
    return log_p.gather(-1, tokens[:, None]).squeeze(-1)
