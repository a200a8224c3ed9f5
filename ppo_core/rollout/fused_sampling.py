"""Temperature sampling (and greedy decoding) of a batch of next-token logits in two Triton kernels.

The rule of :func:`ppo_core.rollout.sampling.sample_tokens` without truncation (``top_k = 0``, ``top_p = 1``, the
usual setting of RL rollouts): with ``x = logits / T``,

- the token is ``argmax(x - log(-log u))`` (``x`` computed as ``logits * (1 / T)``) (Gumbel-max with the caller's uniform noise ``u``; greedy:
  ``argmax(logits)``; ties go to the lowest index, as ``torch.argmax``),
- its log-probability is ``x[token] - logsumexp(x)`` (greedy: at ``T = 1``).

Unfused, PyTorch reads the ``[B, V]`` logits and noise several times (log-softmax, noise transform, argmax,
gather: about 110 us per decode step of a 128k vocabulary at ``B = 64`` on an H200). Here the first kernel splits
every row into blocks of ``BLOCK_V`` entries, reads each logit and noise value once and keeps per block the
``(max, sum of exp)`` of ``x`` and the best Gumbel score with its index; the second combines the blocks of a row.
Both are plain launches with fixed shapes, so a decode step that samples with them is captured in its CUDA graph.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = ["fused_sample", "fused_sampling_available"]

BLOCK_V = 4096
"""Vocabulary entries per program of the first kernel."""


def fused_sampling_available(logits: torch.Tensor, top_k: int, top_p: float) -> bool:
    """Whether :func:`fused_sample` applies: CUDA logits in fp32/bf16/fp16 and no top-k/top-p truncation."""
    return (
        triton is not None
        and logits.is_cuda
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (top_k <= 0 or top_k >= logits.shape[-1])
        and top_p >= 1.0
    )


if triton is not None:

    @triton.jit
    def _sample_blocks(
        logits_ptr,
        noise_ptr,
        part_ptr,
        index_ptr,
        vocab,
        stride_l,
        stride_n,
        n_blocks,
        inv_temperature,
        STOCHASTIC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        ok = offs < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=ok, other=float("-inf")).to(
            tl.float32
        )
        if STOCHASTIC:
            x = x * inv_temperature
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(x - m_safe), axis=0)
        if STOCHASTIC:
            u = tl.load(noise_ptr + row.to(tl.int64) * stride_n + offs, mask=ok, other=0.5).to(tl.float32)
            score = tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))
        else:
            score = x
        best = tl.max(score, axis=0)
        # the lowest index holding the block's best score (torch.argmax's tie rule)
        index = tl.min(tl.where(score == best, offs, vocab + BLOCK), axis=0)
        base = (row * n_blocks + blk) * 3
        tl.store(part_ptr + base, m)
        tl.store(part_ptr + base + 1, s)
        tl.store(part_ptr + base + 2, best)
        tl.store(index_ptr + row * n_blocks + blk, index)

    @triton.jit
    def _sample_combine(
        logits_ptr,
        part_ptr,
        index_ptr,
        token_ptr,
        logp_ptr,
        vocab,
        stride_l,
        n_blocks,
        inv_temperature,
        STOCHASTIC: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        b = tl.arange(0, BLOCKS)
        ok = b < n_blocks
        base = (row * n_blocks + b) * 3
        m = tl.load(part_ptr + base, mask=ok, other=float("-inf"))
        s = tl.load(part_ptr + base + 1, mask=ok, other=0.0)
        best = tl.load(part_ptr + base + 2, mask=ok, other=float("-inf"))
        index = tl.load(index_ptr + row * n_blocks + b, mask=ok, other=2147483647)
        m_all = tl.max(m, axis=0)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        lse = m_safe + tl.log(tl.sum(s * tl.exp(m - m_safe), axis=0))
        top = tl.max(best, axis=0)
        # (clamped: with NaN logits no score equals the best one; the row is garbage but must stay in bounds)
        token = tl.minimum(tl.min(tl.where(best == top, index, 2147483647), axis=0), vocab - 1)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + token).to(tl.float32)
        if STOCHASTIC:
            x = x * inv_temperature
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, x - lse)


def fused_sample(
    logits: torch.Tensor, noise: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probabilities by the rule of the module docstring.

    Args:
        logits: ``[B, V]`` next-token logits (fp32, bf16 or fp16; read in fp32), last dimension contiguous.
        noise: ``[B, V]`` uniform noise in ``[0, 1)``, last dimension contiguous; unused when ``temperature == 0``.
        temperature: > 0 samples, 0 decodes greedily.

    Returns:
        ``(tokens [B] int64, log_probs [B] fp32)``.

    Example:
        >>> logits = torch.tensor([[0.0, 2.0, 1.0]], device="cuda")
        >>> fused_sample(logits, None, 0.0)[0]
        tensor([1], device='cuda:0')
    """
    if triton is None:
        raise RuntimeError("fused_sample needs Triton")
    stochastic = temperature > 0
    if stochastic and (noise is None or noise.shape != logits.shape or noise.stride(-1) != 1):
        raise ValueError(f"noise must be a [B, V] = {tuple(logits.shape)} tensor when sampling")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    n_blocks = triton.cdiv(vocab, BLOCK_V)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, log_probs
    parts = torch.empty(rows, n_blocks, 3, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, n_blocks, dtype=torch.int32, device=logits.device)
    inv_t = 1.0 / temperature if stochastic else 1.0
    noise_arg = noise if stochastic else logits
    _sample_blocks[(rows, n_blocks)](
        logits,
        noise_arg,
        parts,
        index,
        vocab,
        logits.stride(0),
        noise_arg.stride(0),
        n_blocks,
        inv_t,
        STOCHASTIC=stochastic,
        BLOCK=BLOCK_V,
        num_warps=8,
    )
    _sample_combine[(rows,)](
        logits,
        parts,
        index,
        tokens,
        log_probs,
        vocab,
        logits.stride(0),
        n_blocks,
        inv_t,
        STOCHASTIC=stochastic,
        BLOCKS=max(16, triton.next_power_of_2(n_blocks)),
        num_warps=1,
    )
    return tokens, log_probs
