"""Causal attention over packed documents: several sequences laid end to end in one, each attending to itself only.

A padding-free micro-batch concatenates the valid tokens of its rows into one sequence of ``T`` tokens. Document
``i`` occupies tokens ``cu_seqlens[i] : cu_seqlens[i + 1]``; its token ``j`` attends to its tokens ``0 .. j`` and to
nothing of the other documents, and its positions restart at 0. That is exactly the attention a padded row gets
from a causal mask with its padding keys masked out, without computing a single padding token.

Shapes: ``q [T, H, d]``, ``k``/``v [T, G, d]`` (grouped-query attention: ``H % G == 0``, query head ``h`` reads
key/value head ``h // (H / G)``), output ``[T, H, d]``.

Backends (the same maths; :data:`PACKED_ATTENTION_BACKENDS`):

- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn``, PyTorch's variable-length FlashAttention kernel (CUDA,
  fp16/bf16): the work is ``sum_i L_i^2`` and nothing of size ``T x T`` exists.
- ``"flex"``: FlexAttention with a document-causal block mask (compiled on CUDA; eager, forward only, elsewhere).
- ``"sdpa"``: one ``scaled_dot_product_attention`` call per document (any device and dtype): the reference.
- ``"auto"``: ``"varlen"`` where it applies (CUDA, half precision, the kernel exists in this PyTorch), else
  ``"sdpa"``.

Example:
    >>> docs = PackedDocuments.from_seqlens([2, 3])
    >>> docs.position_ids.tolist(), docs.cu_seqlens.tolist()
    ([0, 1, 0, 1, 2], [0, 2, 5])
    >>> q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    >>> packed_causal_attention(q, k, v, docs).shape
    torch.Size([5, 4, 8])
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PACKED_ATTENTION_BACKENDS", "PackedDocuments", "packed_causal_attention", "varlen_available"]

PACKED_ATTENTION_BACKENDS = ("auto", "varlen", "flex", "sdpa")
"""Valid ``backend`` values of :func:`packed_causal_attention`."""


@dataclasses.dataclass(eq=False)
class PackedDocuments:
    """Where the documents of a packed sequence start and end, and their per-document positions.

    Build it with :meth:`from_seqlens`. Values derived from it (document ids, a FlexAttention block mask, rotary
    tables gathered at the positions) are cached on it with :meth:`cached`, so that every layer of one forward
    pass shares them.
    """

    seqlens: tuple[int, ...]
    """Length of each document (all >= 1), in order; their sum is ``T``."""
    cu_seqlens: torch.Tensor
    """``[D + 1]`` int32 offsets: ``0, L_0, L_0 + L_1, ..., T`` (on the device of the tokens)."""
    position_ids: torch.Tensor
    """``[T]`` int64 position of each token in its document (0 at each document's first token)."""
    max_seqlen: int
    """Longest document."""
    _cache: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_seqlens(
        cls, seqlens: Sequence[int], device: torch.device | str | None = None
    ) -> PackedDocuments:
        """Documents of the given lengths laid end to end (zero lengths are dropped: they hold no token).

        Raises:
            ValueError: a negative length, or no token at all.
        """
        lengths = [int(n) for n in seqlens]
        if any(n < 0 for n in lengths):
            raise ValueError(f"seqlens must be >= 0, got {lengths}")
        lengths = [n for n in lengths if n > 0]
        if not lengths:
            raise ValueError("a packed sequence needs at least one token (every seqlen is 0)")
        total = sum(lengths)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        host = torch.tensor(offsets, dtype=torch.int64)
        starts = torch.repeat_interleave(host[:-1], torch.tensor(lengths), output_size=total)
        positions = torch.arange(total, dtype=torch.int64) - starts
        return cls(
            seqlens=tuple(lengths),
            cu_seqlens=host.to(device=device, dtype=torch.int32),
            position_ids=positions.to(device),
            max_seqlen=max(lengths),
        )

    @property
    def total(self) -> int:
        """``T``: the number of packed tokens."""
        return int(self.position_ids.shape[0])

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` the first time ``key`` is asked for, the same object afterwards."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def document_ids(self) -> torch.Tensor:
        """``[T]`` int64 index of each token's document."""

        def build() -> torch.Tensor:
            counts = torch.tensor(self.seqlens, device=self.position_ids.device)
            ids = torch.arange(len(self.seqlens), device=self.position_ids.device)
            return torch.repeat_interleave(ids, counts, output_size=self.total)

        return self.cached("document_ids", build)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [T, heads, d], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.shape[0] == k.shape[0] == v.shape[0] == docs.total:
        raise ValueError(
            f"q, k, v must have the documents' {docs.total} tokens, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the query heads ({q.shape[1]}) must be a multiple of the key/value heads ({k.shape[1]}, {v.shape[1]})"
        )


@functools.cache
def _varlen() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """PyTorch's ``varlen_attn`` and the names of its keyword arguments (which changed between releases), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(q: torch.Tensor) -> bool:
    """Whether the ``"varlen"`` backend can run on ``q``: a CUDA fp16/bf16 tensor and a PyTorch that has the kernel.

    Example:
        >>> varlen_available(torch.zeros(2, 1, 8))
        False
    """
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen() is not None


def _attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments, scale: float | None
) -> torch.Tensor:
    found = _varlen()
    if found is None:
        raise ValueError("backend='varlen' needs torch.nn.attention.varlen (PyTorch >= 2.10)")
    varlen_attn, params = found
    kwargs: dict[str, Any] = {}
    # causal masking is spelled is_causal=True in PyTorch 2.10 and window_size=(-1, 0) from 2.11 on
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # the kernel's own scale is 1/sqrt(d)
            q = q * (scale * math.sqrt(q.shape[-1]))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # releases without the flag check that the head counts match
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu = docs.cu_seqlens
    return varlen_attn(q, k, v, cu, cu, docs.max_seqlen, docs.max_seqlen, **kwargs)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    from ppo_core.kernels.compiled import watch_recompile_limit

    watch_recompile_limit(flex_attention.__code__.co_name, "flex_attention (packed attention)")
    return torch.compile(flex_attention)


def _flex_block_mask(docs: PackedDocuments, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    doc = docs.document_ids()

    def document_causal(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    kwargs: dict[str, Any] = {"device": device}
    # compiled, the mask is built block by block instead of as a T x T tensor
    if device.type == "cuda" and "_compile" in inspect.signature(create_block_mask).parameters:
        kwargs["_compile"] = True
    return create_block_mask(document_causal, None, None, docs.total, docs.total, **kwargs)


def _attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments, scale: float | None
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = docs.cached(("flex_block_mask", str(q.device)), lambda: _flex_block_mask(docs, q.device))
    run = _compiled_flex() if q.is_cuda else flex_attention
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, d]
    out = run(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments, scale: float | None
) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs = []
    start = 0
    for length in docs.seqlens:
        piece = slice(start, start + length)
        q_d, k_d, v_d = (t[piece].transpose(0, 1) for t in (q, k, v))  # [heads, L, d]
        out = F.scaled_dot_product_attention(q_d, k_d, v_d, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(0, 1))
        start += length
    return torch.cat(outs)


_BACKENDS = {"varlen": _attention_varlen, "flex": _attention_flex, "sdpa": _attention_sdpa}


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: PackedDocuments,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of every document of a packed sequence to itself (see the module docstring).

    Args:
        q: ``[T, H, d]`` queries; k, v: ``[T, G, d]`` keys and values (``H`` a multiple of ``G``).
        docs: the documents of the ``T`` tokens.
        scale: the softmax scale; None: ``1 / sqrt(d)``.
        backend: one of :data:`PACKED_ATTENTION_BACKENDS`.

    Returns:
        ``[T, H, d]`` in ``q``'s dtype, differentiable (``"flex"`` only on CUDA).

    Raises:
        ValueError: mismatched shapes, an unknown backend, or ``"varlen"`` on a PyTorch without the kernel.
    """
    if backend not in PACKED_ATTENTION_BACKENDS:
        raise ValueError(f"backend must be one of {PACKED_ATTENTION_BACKENDS}, got {backend!r}")
    _check(q, k, v, docs)
    if backend == "auto":
        backend = "varlen" if varlen_available(q) else "sdpa"
    return _BACKENDS[backend](q, k, v, docs, scale)
