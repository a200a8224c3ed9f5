"""A tiny causal transformer (GPT) for tests and examples: token ids in, logits (or values) out.

Shape legend (torchtitan style): ``B`` batch, ``T`` new tokens in this call, ``S`` tokens seen so far (cache
plus new), ``D`` model width, ``H`` heads, ``K`` head width, ``V`` vocabulary.

The model is deliberately plain: learned absolute positions, pre-norm blocks, no dropout (so recomputed
log-probabilities equal the sampling ones), and an optional scalar value head instead of the LM head for a
critic. Positions come from ``attention_mask`` (``cumsum - 1``), so a left-padded prompt gets the same positions
as an unpadded one and sampling from a batch of prompts of different lengths is exact.

Initialisation never touches the global RNG: parameters are created with ``torch.nn.utils.skip_init`` and then
filled from an explicit ``torch.Generator`` (``seed`` makes one).

Example:
    >>> cfg = TinyGPTConfig(vocab_size=16, max_seq_len=12, d_model=32, n_layers=1, n_heads=2)
    >>> model = TinyGPT(cfg, seed=0)
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 16])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ppo_core._checks import check_int
from ppo_core._config_base import ConfigBase

__all__ = ["KVCache", "TinyGPT", "TinyGPTConfig"]


@dataclass(kw_only=True)
class TinyGPTConfig(ConfigBase):
    """Sizes of a :class:`TinyGPT`."""

    vocab_size: int
    """Number of token ids ``V``."""
    max_seq_len: int = 64
    """Longest sequence (prompt plus response) the position table covers."""
    d_model: int = 64
    """Residual stream width ``D``."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads ``H``; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""
    value_head: bool = False
    """Replace the LM head by a scalar head: ``forward`` then returns values ``[B, T]`` (a critic)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            check_int(name, getattr(self, name), 1)
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")


class KVCache:
    """Keys and values of every layer for the tokens seen so far; grows by concatenation.

    ``keys[i]`` / ``values[i]`` are ``[B, H, S, K]``. Create an empty one with :meth:`TinyGPT.new_cache`.
    """

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    @property
    def seq_len(self) -> int:
        """Number of tokens already cached (``S`` before the next call)."""
        k = self.keys[0]
        return 0 if k is None else k.shape[2]

    def append(
        self, layer: int, k_BHTK: torch.Tensor, v_BHTK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this call's keys/values for ``layer`` and return the full ``[B, H, S, K]`` tensors."""
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None:
            k_BHTK = torch.cat([old_k, k_BHTK], dim=2)
            v_BHTK = torch.cat([old_v, v_BHTK], dim=2)
        self.keys[layer], self.values[layer] = k_BHTK, v_BHTK
        return k_BHTK, v_BHTK


class _Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = skip_init(nn.Linear, d, 3 * d)
        self.proj = skip_init(nn.Linear, d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.fc = skip_init(nn.Linear, d, hidden)
        self.fc_out = skip_init(nn.Linear, hidden, d)

    def forward(
        self, x_BTD: torch.Tensor, allowed_B1TS: torch.Tensor, cache: KVCache | None, layer: int
    ) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(self.ln_attn(x_BTD)).split(D, dim=-1)
        K = D // self.n_heads
        q_BHTK, k_BHTK, v_BHTK = (t.view(B, T, self.n_heads, K).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k_BHTK, v_BHTK = cache.append(layer, k_BHTK, v_BHTK)
        a_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, attn_mask=allowed_B1TS)
        x_BTD = x_BTD + self.proj(a_BHTK.transpose(1, 2).reshape(B, T, D))
        return x_BTD + self.fc_out(F.gelu(self.fc(self.ln_mlp(x_BTD))))


class TinyGPT(nn.Module):
    """A small pre-norm causal transformer mapping token ids ``[B, T]`` to logits ``[B, T, V]``.

    With ``config.value_head`` the output is values ``[B, T]`` instead (a critic sharing the architecture).

    Args:
        config: the sizes.
        seed: builds a ``torch.Generator`` for the initialisation when ``generator`` is None.
        generator: the initialisation RNG (CPU); takes precedence over ``seed``.

    Example:
        >>> cfg = TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_layers=1, n_heads=2)
        >>> ids = torch.tensor([[0, 5, 6], [4, 5, 6]])
        >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        >>> TinyGPT(cfg, seed=1)(ids, attention_mask=mask).shape
        torch.Size([2, 3, 8])
    """

    def __init__(
        self, config: TinyGPTConfig, *, seed: int = 0, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tok_emb = skip_init(nn.Embedding, config.vocab_size, d)
        self.pos_emb = skip_init(nn.Embedding, config.max_seq_len, d)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = skip_init(nn.Linear, d, 1 if config.value_head else config.vocab_size)
        self.reset_parameters(generator if generator is not None else torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator``: normal weights, zero biases, unit LayerNorm scales.

        Output projections of residual branches are scaled by ``1/sqrt(2 * n_layers)`` (GPT-2) so the residual
        stream keeps unit scale at initialisation, and the value head starts at zero so a fresh critic predicts 0.
        """
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)  # LayerNorm scale / any bias
                continue
            scale = (
                std / math.sqrt(2 * self.config.n_layers)
                if name.endswith(("proj.weight", "fc_out.weight"))
                else std
            )
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
        if self.config.value_head:
            self.head.weight.zero_()

    def new_cache(self) -> KVCache:
        """An empty :class:`KVCache` for incremental decoding (pass it to every ``forward`` call)."""
        return KVCache(self.config.n_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` (or values ``[B, T]`` with a value head) for ``input_ids`` ``[B, T]``.

        Args:
            input_ids: ``[B, T]`` token ids, the new tokens of this call.
            attention_mask: ``[B, S]`` 1 for real tokens, 0 for padding, covering the cached tokens and the new
                ones (``S = cache.seq_len + T``); None means all ones.
            position_ids: ``[B, T]``; by default ``cumsum(attention_mask) - 1`` of the new tokens.
            cache: a :class:`KVCache` to read and extend (incremental decoding), or None.

        Padding keys are never attended to; a padding query attends to itself only, so its (ignored) output
        stays finite.
        """
        B, T = input_ids.shape
        past = 0 if cache is None else cache.seq_len
        S = past + T
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=device)
        if attention_mask.shape != (B, S):
            raise ValueError(
                f"attention_mask must have shape {(B, S)} (cached + new tokens), got {tuple(attention_mask.shape)}"
            )
        if self.config.max_seq_len < S:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.config.max_seq_len}")
        key_ok_BS = attention_mask.bool()
        if position_ids is None:
            position_ids = (key_ok_BS.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        q_pos = torch.arange(past, S, device=device)
        k_pos = torch.arange(S, device=device)
        causal_TS = k_pos[None, :] <= q_pos[:, None]
        allowed_BTS = (causal_TS[None] & key_ok_BS[:, None, :]) | (
            k_pos[None, None, :] == q_pos[None, :, None]
        )
        x_BTD = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        for i, block in enumerate(self.blocks):
            x_BTD = block(x_BTD, allowed_BTS[:, None], cache, i)
        out = self.head(self.ln_f(x_BTD))
        return out.squeeze(-1) if self.config.value_head else out
