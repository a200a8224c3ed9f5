"""Hugging Face causal LMs as ppo-core models: a local checkpoint directory in, the same kind of directory out.

Shape legend: ``B`` batch, ``S`` tokens in the call, ``V`` vocabulary, ``D`` hidden width.

- :func:`load_causal_lm` wraps ``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` in
  :class:`HFCausalLM`, which follows the calling convention of the torch workers (``model(input_ids,
  attention_mask=mask)`` returns logits ``[B, S, V]``), takes the position ids from the attention mask
  (``cumsum - 1``, so a left-padded row is scored exactly like the unpadded row, also for models with absolute
  position embeddings) and exposes ``new_cache()`` so that sampling decodes incrementally with the model's KV cache.
  A weights file shorter than its header says raises ``ValueError`` naming it
  (:mod:`~ppo_core.models.safetensors_files`).
- :func:`load_value_model` builds :class:`CausalLMWithValueHead`, the checkpoint's transformer body plus a linear
  value head (``[B, S, 1]``, fp32), for the critic.
- :func:`export_hf` writes a model back as a Hugging Face directory (``config.json``, safetensors, tokenizer
  files) that ``AutoModelForCausalLM.from_pretrained`` loads with identical logits;
  :func:`export_actor_checkpoint` does it for the actor of a saved training checkpoint.

Factories for the workers must be picklable for process backends: ``functools.partial(load_causal_lm, path)`` is.

Usage::

    actor = TorchActorWorker(functools.partial(load_causal_lm, model_dir), actor_config)
    critic = TorchCriticWorker(functools.partial(load_value_model, model_dir), critic_config)
    ...
    export_hf(actor.module, model_dir, "runs/export")  # or export_actor_checkpoint(step_dir, model_dir, out)
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
from typing import Any

import torch
from torch import nn
from torch.nn.utils import skip_init

from ppo_core.models.safetensors_files import check_safetensors_file, hf_weight_files

__all__ = [
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "SPARSE_PACKED_ATTENTION_IMPLEMENTATIONS",
    "TOKENIZER_FILES",
    "CausalLMWithValueHead",
    "HFCausalLM",
    "export_actor_checkpoint",
    "export_hf",
    "load_causal_lm",
    "load_value_model",
    "positions_from_mask",
    "unwrap_hf_model",
]

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files :func:`export_hf` copies verbatim from the tokenizer directory (those that exist)."""


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, S]`` counting only attended tokens: ``cumsum(mask) - 1``, 0 on left padding.

    Example:
        >>> positions_from_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([[0, 0, 0, 1],
                [0, 1, 2, 3]])
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


PACKED_ATTENTION_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
"""Hugging Face attention implementations that separate packed documents: given ``position_ids`` restarting at 0
for each document and no attention mask, they attend within each document only (a block-causal mask, or the
FlashAttention kernels' variable-length form)."""


SPARSE_PACKED_ATTENTION_IMPLEMENTATIONS = (
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
"""The implementations among :data:`PACKED_ATTENTION_IMPLEMENTATIONS` that skip the work across packed documents
(variable-length kernels, a block-sparse mask); ``sdpa`` and ``eager`` build a dense ``[N, N]`` block-causal mask
over the whole packed length ``N``, so packing costs them the square of it (ten rows of 64 tokens: 640**2 scores
instead of 10 * 64**2)."""


def _packs(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) in PACKED_ATTENTION_IMPLEMENTATIONS


def _packs_sparsely(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) in SPARSE_PACKED_ATTENTION_IMPLEMENTATIONS


def _cache_keyword(model: nn.Module) -> str:
    # newer transformers name the KV-cache argument ``cache`` (``past_key_values`` is deprecated there)
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFCausalLM(nn.Module):
    """A Hugging Face ``*ForCausalLM`` called the ppo-core way: ``forward(input_ids, attention_mask)`` -> logits.

    Args:
        model: the Hugging Face model (``.model`` afterwards; its ``state_dict`` keys gain a ``model.`` prefix).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._cache_kw = _cache_keyword(model)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def config(self) -> Any:
        """The Hugging Face config of the wrapped model."""
        return self.model.config

    @property
    def supports_packed_sequences(self) -> bool:
        """Whether ``forward(input_ids [1, T], position_ids=[1, T])`` treats each run of positions from 0 as a
        separate document (padding-free batches): true for :data:`PACKED_ATTENTION_IMPLEMENTATIONS`."""
        return _packs(self.model.config)

    @property
    def packed_attention_is_sparse(self) -> bool:
        """Whether packed documents cost no attention across them (:data:`SPARSE_PACKED_ATTENTION_IMPLEMENTATIONS`);
        the torch engine packs by default only then (``use_remove_padding="auto"``)."""
        return _packs_sparsely(self.model.config)

    def new_cache(self) -> Any:
        """An empty KV cache for incremental decoding (``transformers.DynamicCache``)."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers versions whose DynamicCache takes no config
            return DynamicCache()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        logits_to_keep: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` of ``input_ids`` ``[B, S]``.

        Args:
            input_ids: ``[B, S]`` token ids (left-padded rows allowed).
            attention_mask: ``[B, S_past + S]`` 1 on real tokens (covers the cached tokens too); None: all ones, or,
                with ``position_ids`` and no cache, packed documents (each run of positions from 0 is one causal
                document, see :attr:`supports_packed_sequences`).
            position_ids: ``[B, S]``; default: from ``attention_mask`` (:func:`positions_from_mask`).
            cache: a :meth:`new_cache` to read and extend (incremental decoding), or None.
            logits_to_keep: compute the logits of these positions only (a ``[K]`` index tensor) or of the last
                ``K`` positions (an int); the result is then ``[B, K, V]``. None: every position.
        """
        packed = attention_mask is None and position_ids is not None and cache is None
        if attention_mask is None and not packed:
            past = 0 if cache is None else int(cache.get_seq_length())
            attention_mask = torch.ones(
                input_ids.shape[0], past + input_ids.shape[1], dtype=torch.long, device=input_ids.device
            )
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)[:, -input_ids.shape[1] :]
        kwargs: dict[str, Any] = {"use_cache": cache is not None}
        if cache is not None:
            kwargs[self._cache_kw] = cache
        keep_here = logits_to_keep is not None and not self._takes_logits_to_keep
        if logits_to_keep is not None and not keep_here:
            kwargs["logits_to_keep"] = logits_to_keep
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        logits = out.logits
        if keep_here:  # a model without the argument computed every position
            logits = (
                logits[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else logits[:, logits_to_keep]
            )
        return logits


class CausalLMWithValueHead(nn.Module):
    """A transformer body and a linear value head: ``forward(input_ids, attention_mask)`` -> values ``[B, S, 1]``.

    The head reads the body's last hidden state (``[B, S, D]``) in fp32 and returns fp32 values. With the default
    zero initialisation every value starts at 0 (the body still gets gradients once the head has moved).

    Args:
        body: a Hugging Face base model (``AutoModel``) returning ``last_hidden_state``.
        hidden_size: ``D``.
        head_init_std: standard deviation of the head's normal initialisation; 0 gives zeros.
        seed: seeds the head's initialisation (a local generator; the global RNG is not touched).
    """

    def __init__(
        self, body: nn.Module, hidden_size: int, *, head_init_std: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__()
        if head_init_std < 0:
            raise ValueError(f"head_init_std must be >= 0, got {head_init_std}")
        self.body = body
        # skip_init: nn.Linear's default initialisation would draw from the global RNG
        self.value_head = skip_init(nn.Linear, int(hidden_size), 1, dtype=torch.float32)
        with torch.no_grad():
            self.value_head.bias.zero_()
            if head_init_std > 0:
                gen = torch.Generator().manual_seed(int(seed))
                self.value_head.weight.copy_(
                    torch.randn(self.value_head.weight.shape, generator=gen) * head_init_std
                )
            else:
                self.value_head.weight.zero_()

    @property
    def supports_packed_sequences(self) -> bool:
        """Whether ``forward(input_ids [1, T], position_ids=[1, T])`` treats each run of positions from 0 as a
        separate document (see :attr:`HFCausalLM.supports_packed_sequences`)."""
        return _packs(getattr(self.body, "config", None))

    @property
    def packed_attention_is_sparse(self) -> bool:
        """See :attr:`HFCausalLM.packed_attention_is_sparse`."""
        return _packs_sparsely(getattr(self.body, "config", None))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values ``[B, S, 1]`` (fp32) of every position of ``input_ids`` ``[B, S]``; with ``position_ids`` and no
        ``attention_mask``, of packed documents (as :meth:`HFCausalLM.forward`)."""
        if attention_mask is None and position_ids is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.long)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden.float())


def _dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, its name (e.g. 'bfloat16') or 'auto', got {dtype!r}")
    return value


def _check_dir(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"path={path!r} is not a Hugging Face checkpoint directory (no config.json); models are loaded from "
            "local directories only"
        )
    return path


def _config_without_dropout(path: str) -> Any:
    """The checkpoint's config with every dropout probability (``*dropout``, ``*pdrop``) set to 0."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    configs = [config, *(getattr(config, name) for name in ("text_config",) if hasattr(config, name))]
    for cfg in configs:
        for name, value in list(vars(cfg).items()):
            if (name.endswith("dropout") or name.endswith("pdrop")) and isinstance(value, float):
                setattr(cfg, name, 0.0)
    return config


def _zero_dropout_modules(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _load(
    auto_cls: Any,
    path: str | os.PathLike[str],
    dtype: Any,
    attn_implementation: str | None,
    disable_dropout: bool,
) -> nn.Module:
    path = _check_dir(path)
    for weights in hf_weight_files(path):  # a truncated file names itself here, not in safetensors' reader
        check_safetensors_file(weights)
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "dtype": _dtype(dtype),
        "attn_implementation": attn_implementation,
    }
    if disable_dropout:
        kwargs["config"] = _config_without_dropout(path)
    model = auto_cls.from_pretrained(path, **kwargs)
    if disable_dropout:
        _zero_dropout_modules(model)
    return model


def load_causal_lm(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str | None = "sdpa",
    disable_dropout: bool = True,
) -> HFCausalLM:
    """Load a local Hugging Face causal-LM checkpoint as an :class:`HFCausalLM` (no network access).

    Args:
        path: the checkpoint directory (``config.json``, safetensors).
        dtype: parameter dtype (a ``torch.dtype``, its name, or ``"auto"`` for the checkpoint's own); fp32 by
            default, as the reference torch workers train in full precision.
        device: where to put the model (the workers move it to their own device anyway).
        attn_implementation: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...; None lets transformers choose.
        disable_dropout: set every dropout probability to 0 (config and modules), so that log-probabilities
            recomputed in training mode equal the sampling ones and PPO ratios start at exactly 1. The exported
            config then also says 0.
    """
    from transformers import AutoModelForCausalLM

    model = _load(AutoModelForCausalLM, path, dtype, attn_implementation, disable_dropout)
    if device is not None:
        model = model.to(device)
    return HFCausalLM(model)


def load_value_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str | None = "sdpa",
    disable_dropout: bool = True,
    head_init_std: float = 0.0,
    seed: int = 0,
) -> CausalLMWithValueHead:
    """The transformer body of a local causal-LM checkpoint (``AutoModel``, no LM head) with a value head.

    Args:
        path, dtype, device, attn_implementation, disable_dropout: as :func:`load_causal_lm` (the head is
            always fp32).
        head_init_std, seed: the head's initialisation (see :class:`CausalLMWithValueHead`).
    """
    from transformers import AutoModel

    body = _load(AutoModel, path, dtype, attn_implementation, disable_dropout)
    model = CausalLMWithValueHead(body, body.config.hidden_size, head_init_std=head_init_std, seed=seed)
    return model if device is None else model.to(device)


def unwrap_hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face ``PreTrainedModel`` inside ``model`` (through DDP / FSDP ``.module`` and :class:`HFCausalLM`)."""
    from transformers import PreTrainedModel

    seen = model
    for _ in range(4):
        if isinstance(seen, PreTrainedModel):
            return seen
        if isinstance(seen, HFCausalLM):
            seen = seen.model
        elif isinstance(getattr(seen, "module", None), nn.Module):
            seen = seen.module
        else:
            break
    raise TypeError(
        f"model must be a Hugging Face PreTrainedModel or an HFCausalLM wrapping one, got {type(model).__name__}"
    )


def export_hf(
    model: nn.Module,
    tokenizer_dir: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
) -> str:
    """Write ``model`` as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        model: an :class:`HFCausalLM` (or a Hugging Face model, possibly inside DDP).
        tokenizer_dir: directory whose tokenizer files (:data:`TOKENIZER_FILES`) are copied verbatim; None: none.
        out_dir: the output directory (created; files of the same names are overwritten).
        dtype: save the weights in this dtype (a copy is cast); None keeps the model's.

    Returns:
        ``out_dir`` as a string.
    """
    hf = unwrap_hf_model(model)
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    if dtype is not None:
        import copy

        hf = copy.deepcopy(hf).to(_dtype(dtype))
    hf.save_pretrained(out)
    if tokenizer_dir is not None:
        copied = []
        for name in TOKENIZER_FILES:
            src = os.path.join(os.fspath(tokenizer_dir), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out, name))
                copied.append(name)
        if not copied:
            raise FileNotFoundError(
                f"tokenizer_dir={os.fspath(tokenizer_dir)!r} holds none of {TOKENIZER_FILES}"
            )
    logger.info("exported %s to %s", type(hf).__name__, out)
    return out


def _actor_state_file(checkpoint_dir: str) -> str:
    for candidate in (
        os.path.join(checkpoint_dir, "actor", "rank_0.pt"),
        os.path.join(checkpoint_dir, "rank_0.pt"),
    ):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"checkpoint_dir={checkpoint_dir!r} holds neither actor/rank_0.pt (a trainer checkpoint) nor rank_0.pt "
        "(a TorchActorWorker checkpoint)"
    )


def export_actor_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    base_model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
) -> str:
    """Export the actor of a saved checkpoint as a Hugging Face directory.

    Args:
        checkpoint_dir: a trainer checkpoint (``global_step_k``, with ``actor/rank_0.pt``) or the directory a
            ``TorchActorWorker`` saved into (``rank_0.pt``); the model was built by ``load_causal_lm``.
        base_model_dir: the checkpoint the run started from (architecture and tokenizer).
        out_dir, dtype: as :func:`export_hf`.
    """
    model = load_causal_lm(base_model_dir)
    state = torch.load(_actor_state_file(os.fspath(checkpoint_dir)), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    return export_hf(model, base_model_dir, out_dir, dtype=dtype)
