"""Temperature sampling (and greedy decoding) of a batch of next-token logits in two Triton kernels.

The rule of :func:`ppo_core.rollout.sampling.sample_tokens` without truncation (``top_k = 0``, ``top_p = 1``, the
usual setting of RL rollouts), with ``x = logits / T`` (computed as ``logits * (1 / T)``): a token drawn from
``softmax(x)`` (greedy: ``argmax(logits)``, ties to the lowest index as ``torch.argmax``), and its log-probability
``x[token] - logsumexp(x)`` (greedy: at ``T = 1``).

The first kernel splits every row into blocks of ``BLOCK_V`` entries, reads each logit once and keeps per block
``m_b``, the largest ``x``, and ``s_b = sum exp(x - m_b)`` (greedy: also the block's argmax); the second combines
the blocks of a row into ``logsumexp(x)`` and the token. Both are plain launches with fixed shapes, so a decode
step that samples with them is captured in its CUDA graph. Unfused, PyTorch reads the ``[B, V]`` logits and noise
several times (log-softmax, noise transform, argmax, gather), a large share of a decode step at a 128k
vocabulary.

How the token is drawn depends on where the randomness comes from:

- **uniform noise from the caller** (:func:`fused_sample` with ``noise``, a ``[B, V]`` tensor filled from its
  generator): Gumbel-max, ``argmax(x - log(-log u))``, as ``sample_tokens`` draws from the same noise. The first
  kernel ranks a block's entries by ``exp(x - m_b) / (-log u)``, which orders them as the Gumbel scores do with
  one logarithm an entry instead of two. Rounding can order two entries whose scores agree to about ``1e-6``
  differently from the PyTorch rule; an entry whose ``exp(x - m_b)`` underflows to 0 is more than 87 below the
  block's largest, where no noise can lift it.
- **in-kernel randomness** (``seed`` and ``step``: two device scalars; the decoder's mode): two uniforms a row,
  ``u_0`` and ``u_1``, words 0 and 1 of Philox-4x32-10 keyed by ``seed`` at counter ``(0, row, step, 1)``, each
  ``(2k + 1) / 2**24`` from the word's top 23 bits, strictly inside ``(0, 1)``. The draw is by the inverse of the
  cumulative distribution in two levels (:func:`inverse_cdf_draw` in PyTorch): the block is the first whose
  running mass ``sum_{c <= b} s_c exp(m_c - m)`` exceeds ``u_0`` times the row's total, and the token the first
  entry of that block whose running ``exp(x - m_b)`` exceeds ``u_1`` times the block's sum. Its probability is the
  block's share times the entry's share of its block, ``softmax(x)[token]``, up to fp32 rounding of the running
  sums (about ``1e-7`` of the total) and the 2^-23 steps of the uniforms. The entries get no noise of their own:
  the first kernel does an exponential and a sum an entry, where a Gumbel draw there also needs a Philox word, a
  logarithm and a division (``benchmarks/sampling.py`` times both). Every
  ``(seed, step, row)`` has its own counter, so no randomness is reused within a generation; the step is read
  from device memory, so a captured CUDA graph replays the next step's draw. :func:`fused_sampling_uniforms`
  materialises the uniforms.

:func:`fused_sample_record` is the decoder's step (:mod:`ppo_core_decode.decoding`): the second kernel also writes
the token, its response-mask bit and log-prob at column ``step`` and advances ``done``, the fed token and ``step``,
so that drawing and recording a token is two launches. On Hopper both launch with programmatic dependent launch
(:mod:`ppo_core_decode.pdl`): each is scheduled while the kernel before it finishes and waits for it before its
first read.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the tests).
"""

from __future__ import annotations

import torch

from ppo_core.kernels.launch_sizes import cdiv, next_power_of_2
from ppo_core_decode.pdl import pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None
    tl = None

__all__ = [
    "fused_sample",
    "fused_sample_record",
    "fused_sampling_available",
    "fused_sampling_uniforms",
    "fused_token_log_probs",
    "inverse_cdf_draw",
]

BLOCK_V = 4096
"""Vocabulary entries per program of the first kernel (and the entries the second searches for a row's token)."""

_NO_NOISE, _TENSOR_NOISE, _KERNEL_NOISE = 0, 1, 2
_BLOCK_WARPS = 8
"""Warps of the first kernel."""
_COMBINE_WARPS = {False: 1, True: 4}
"""Warps of the combining kernel: one to combine a row's blocks; four to also search the chosen block."""


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
    def _uniforms(seed, step, rows):
        """The two uniforms of each of ``rows`` (``[R]`` int32) at ``step`` (module docstring): words 0 and 1 of
        Philox-4x32-10 keyed by ``seed`` at counter ``(0, row, step, 1)``, each ``(2k + 1) / 2**24``."""
        zero = rows.to(tl.uint32) * 0
        r0, r1, _r2, _r3 = tl.philox(seed, zero, rows.to(tl.uint32), zero + step.to(tl.uint32), zero + 1)
        u0 = (r0 >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08
        u1 = (r1 >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08
        return u0, u1

    @triton.jit
    def _uniforms_kernel(seed_ptr, step_ptr, out_ptr, n_rows, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        u0, u1 = _uniforms(tl.load(seed_ptr), tl.load(step_ptr), rows)
        tl.store(out_ptr + 2 * rows, u0, mask=rows < n_rows)
        tl.store(out_ptr + 2 * rows + 1, u1, mask=rows < n_rows)

    @triton.jit
    def _sample_blocks(
        logits_ptr,
        noise_ptr,
        step_ptr,
        step_copy_ptr,
        part_ptr,
        index_ptr,
        vocab,
        stride_l,
        stride_n,
        n_blocks,
        inv_temperature,
        NOISE: tl.constexpr,
        RECORD: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        if PDL:  # scheduled while the logits' kernel finishes; everything below reads or writes after it
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        ok = offs < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=ok, other=float("-inf")).to(
            tl.float32
        )
        if NOISE != 0:
            x = x * inv_temperature
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp(x - m_safe)  # 0 where x = -inf (outside the vocabulary too)
        s = tl.sum(p, axis=0)
        base = (row * n_blocks + blk) * 3
        tl.store(part_ptr + base, m)
        tl.store(part_ptr + base + 1, s)
        # in-kernel noise (NOISE == 2): the combine kernel draws from the blocks' masses; nothing more per entry
        if NOISE == 0:
            # the lowest index holding the block's largest logit (torch.argmax's tie rule)
            index = tl.min(tl.where(x == m, offs, vocab + BLOCK), axis=0)
            tl.store(part_ptr + base + 2, m)
            tl.store(index_ptr + row * n_blocks + blk, index)
        if NOISE == 1:
            u = tl.load(noise_ptr + row.to(tl.int64) * stride_n + offs, mask=ok, other=0.5).to(tl.float32)
            # argmax(x - log(e)) with e = -log(u) ~ Exp(1) is argmax(p / e) (exp(x - m) / e, the same order): one
            # logarithm an entry instead of two, and p is the softmax's term already
            race = p / -tl.log(u)
            top = tl.max(race, axis=0)
            index = tl.min(tl.where(race == top, offs, vocab + BLOCK), axis=0)
            # the winner's score x - log(e), comparable across blocks
            tl.store(part_ptr + base + 2, m_safe + tl.log(top))
            tl.store(index_ptr + row * n_blocks + blk, index)
        if RECORD:
            # the combine kernel advances the step: its programs read this copy, so none reads what another wrote
            tl.store(step_copy_ptr, tl.load(step_ptr), mask=(row == 0) & (blk == 0))

    @triton.jit
    def _sample_combine(
        logits_ptr,
        part_ptr,
        index_ptr,
        token_ptr,
        logp_ptr,
        mask_ptr,
        done_ptr,
        last_tok_ptr,
        last_valid_ptr,
        step_ptr,
        step_copy_ptr,
        seed_ptr,
        noise_step_ptr,
        vocab,
        stride_l,
        stride_t,
        stride_m,
        stride_p,
        n_cols,
        n_blocks,
        inv_temperature,
        eos,
        pad,
        STOCHASTIC: tl.constexpr,
        RECORD: tl.constexpr,
        HAS_EOS: tl.constexpr,
        CDF: tl.constexpr,
        GIVEN: tl.constexpr,
        BLOCKS: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        if PDL:  # scheduled while the first kernel finishes; everything below reads or writes after it
            tl.extra.cuda.gdc_wait()
        b = tl.arange(0, BLOCKS)
        ok = b < n_blocks
        base = (row * n_blocks + b) * 3
        m = tl.load(part_ptr + base, mask=ok, other=float("-inf"))
        s = tl.load(part_ptr + base + 1, mask=ok, other=0.0)
        m_all = tl.max(m, axis=0)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        mass = s * tl.exp(m - m_safe)  # [BLOCKS]: each block's share of the row's sum of exp(x - m_safe)
        total = tl.sum(mass, axis=0)
        lse = m_safe + tl.log(total)
        if GIVEN:  # the log-prob of a token drawn before (token_ptr holds it): the same lse, no draw
            token = tl.load(token_ptr + row)
        elif CDF:
            lanes = tl.zeros([2], dtype=tl.int32) + row  # Philox on a tensor of two equal lanes, then scalars
            u_blocks, u_entries = _uniforms(tl.load(seed_ptr), tl.load(noise_step_ptr), lanes)
            u_block, u_entry = tl.max(u_blocks, axis=0), tl.max(u_entries, axis=0)
            # the block: the first whose running mass exceeds u_block * total (a block of no mass never is)
            running_mass = tl.cumsum(mass, axis=0)
            chosen = tl.min(tl.where(running_mass > u_block * total, b, BLOCKS), axis=0)
            # (rounding can leave u_block * total at the total: the last block with mass)
            chosen = tl.where(chosen < BLOCKS, chosen, tl.max(tl.where(mass > 0, b, 0), axis=0))
            m_block = tl.sum(tl.where(b == chosen, m, 0.0), axis=0)
            m_block = tl.where(m_block == float("-inf"), 0.0, m_block)
            # the entry: the same rule inside the chosen block, on exp(x - m_block)
            offs = chosen * BLOCK + tl.arange(0, BLOCK)
            xs = tl.load(
                logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf")
            )
            p = tl.exp(xs.to(tl.float32) * inv_temperature - m_block)
            running_p = tl.cumsum(p, axis=0)
            entry = tl.min(
                tl.where(running_p > u_entry * tl.max(running_p, axis=0), offs, 2147483647), axis=0
            )
            last_entry = tl.max(tl.where(p > 0, offs, chosen * BLOCK), axis=0)
            token = tl.minimum(tl.where(entry < 2147483647, entry, last_entry), vocab - 1)
        else:
            best = tl.load(part_ptr + base + 2, mask=ok, other=float("-inf"))
            index = tl.load(index_ptr + row * n_blocks + b, mask=ok, other=2147483647)
            top = tl.max(best, axis=0)
            # (clamped: with NaN logits no score equals the best one; the row is garbage but must stay in bounds)
            token = tl.minimum(tl.min(tl.where(best == top, index, 2147483647), axis=0), vocab - 1)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + token).to(tl.float32)
        if STOCHASTIC:
            x = x * inv_temperature
        if RECORD:
            col = tl.load(step_copy_ptr)
            in_range = (col >= 0) & (
                col < n_cols
            )  # an out-of-range step writes nothing rather than elsewhere
            running = tl.load(done_ptr + row) == 0
            fed = tl.where(running, token.to(tl.int64), pad)
            tl.store(token_ptr + row.to(tl.int64) * stride_t + col, fed, mask=in_range)
            tl.store(mask_ptr + row.to(tl.int64) * stride_m + col, running, mask=in_range)
            tl.store(
                logp_ptr + row.to(tl.int64) * stride_p + col, tl.where(running, x - lse, 0.0), mask=in_range
            )
            if HAS_EOS:
                # done | (running & eos) == done | eos: a finished row stays finished
                tl.store(done_ptr + row, (running == 0) | (token == eos))
            tl.store(last_tok_ptr + row, fed)
            tl.store(last_valid_ptr + row, running)
            tl.store(step_ptr, col + 1, mask=row == 0)
        elif GIVEN:
            tl.store(logp_ptr + row, x - lse)
        else:
            tl.store(token_ptr + row, token.to(tl.int64))
            tl.store(logp_ptr + row, x - lse)


def _check_scalar(name: str, value: torch.Tensor, device: torch.device) -> None:
    if value.dtype != torch.int64 or value.numel() != 1 or value.device != device:
        raise ValueError(
            f"{name} must be a one-element int64 tensor on {device}, got {tuple(value.shape)} {value.dtype} on "
            f"{value.device}"
        )


def _noise_mode(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    seed: torch.Tensor | None,
    step: torch.Tensor | None,
    temperature: float,
) -> int:
    if temperature <= 0:
        return _NO_NOISE
    if seed is not None:
        if noise is not None:
            raise ValueError("pass noise or seed, not both: seed draws the noise in the kernel")
        _check_scalar("seed", seed, logits.device)
        if step is None:
            raise ValueError("step is required with seed (it keys the in-kernel noise)")
        return _KERNEL_NOISE
    if noise is None or noise.shape != logits.shape or noise.stride(-1) != 1:
        got = None if noise is None else tuple(noise.shape)
        raise ValueError(f"noise must be a [B, V] = {tuple(logits.shape)} tensor when sampling, got {got}")
    return _TENSOR_NOISE


def _launch_blocks(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    seed: torch.Tensor | None,
    step: torch.Tensor | None,
    mode: int,
    inv_t: float,
    record: bool,
    pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first kernel: per-block partials ``[B, n_blocks, 3]``, indices ``[B, n_blocks]`` and the step's copy."""
    rows, vocab = logits.shape
    n_blocks = cdiv(vocab, BLOCK_V)
    parts = torch.empty(rows, n_blocks, 3, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, n_blocks, dtype=torch.int32, device=logits.device)
    step_copy = torch.empty(1, dtype=torch.int64, device=logits.device)
    noise_arg = noise if mode == _TENSOR_NOISE else logits
    _sample_blocks[(rows, n_blocks)](
        logits,
        noise_arg,
        step if step is not None else step_copy,
        step_copy,
        parts,
        index,
        vocab,
        logits.stride(0),
        noise_arg.stride(0),
        n_blocks,
        inv_t,
        NOISE=mode,
        RECORD=record,
        BLOCK=BLOCK_V,
        PDL=pdl,
        num_warps=_BLOCK_WARPS,
        **({"launch_pdl": True} if pdl else {}),
    )
    return parts, index, step_copy


def _launch_combine(
    logits: torch.Tensor,
    parts: torch.Tensor,
    index: torch.Tensor,
    tokens: torch.Tensor,
    log_probs: torch.Tensor,
    step_copy: torch.Tensor,
    seed: torch.Tensor | None,
    step: torch.Tensor | None,
    mode: int,
    temperature: float,
    pdl: bool,
    given: bool = False,
) -> None:
    """The combining kernel without the decoder's bookkeeping: writes ``tokens [B]`` (or, ``given``, reads them)
    and their ``log_probs [B]``. Its warps are the mode's, whether it draws or reads the token (the reduction of the
    blocks' masses then runs in the same order as the decoder's)."""
    rows, vocab = logits.shape
    n_blocks = index.shape[1]
    _sample_combine[(rows,)](
        logits,
        parts,
        index,
        tokens,
        log_probs,
        tokens,  # mask, done, last token, last valid, step: unused without RECORD
        tokens,
        tokens,
        tokens,
        step_copy,
        step_copy,
        seed if seed is not None else step_copy,
        step if step is not None else step_copy,
        vocab,
        logits.stride(0),
        0,
        0,
        0,
        0,
        n_blocks,
        1.0 / temperature if temperature > 0 else 1.0,
        0,
        0,
        STOCHASTIC=temperature > 0,
        RECORD=False,
        HAS_EOS=False,
        CDF=mode == _KERNEL_NOISE and not given,
        GIVEN=given,
        BLOCKS=max(16, next_power_of_2(n_blocks)),
        BLOCK=BLOCK_V,
        PDL=pdl,
        num_warps=_COMBINE_WARPS[mode == _KERNEL_NOISE],
        **({"launch_pdl": True} if pdl else {}),
    )


def fused_sample(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    temperature: float,
    *,
    seed: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probabilities by the rule of the module docstring.

    Args:
        logits: ``[B, V]`` next-token logits (fp32, bf16 or fp16; read in fp32), last dimension contiguous.
        noise: ``[B, V]`` uniform noise in ``[0, 1)``, last dimension contiguous; unused when ``temperature == 0``;
            None with ``seed``.
        temperature: > 0 samples, 0 decodes greedily.
        seed: ``[]`` (or ``[1]``) int64 device tensor: draw the noise in the kernel (module docstring).
        step: ``[]`` (or ``[1]``) int64 device tensor, required with ``seed``: the decode step the noise is for.

    Returns:
        ``(tokens [B] int64, log_probs [B] fp32)``.

    Example:
        >>> logits = torch.tensor([[0.0, 2.0, 1.0]], device="cuda")
        >>> fused_sample(logits, None, 0.0)[0]
        tensor([1], device='cuda:0')
    """
    if triton is None:
        raise RuntimeError("fused_sample needs Triton")
    mode = _noise_mode(logits, noise, seed, step, temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, log_probs
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    pdl = pdl_enabled(logits.device)  # both launches take part in PDL, or neither
    parts, index, step_copy = _launch_blocks(logits, noise, seed, step, mode, inv_t, record=False, pdl=pdl)
    _launch_combine(logits, parts, index, tokens, log_probs, step_copy, seed, step, mode, temperature, pdl)
    return tokens, log_probs


def fused_sample_record(
    logits: torch.Tensor,
    temperature: float,
    *,
    step: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    done: torch.Tensor,
    last_tok: torch.Tensor,
    last_valid: torch.Tensor,
    eos_token_id: int | None,
    pad_token_id: int,
    seed: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> None:
    """Draw token ``t = step`` of every row (module docstring) and record it in place, in two launches.

    With ``running = ~done``: ``responses[:, t]`` gets the token where running, else ``pad_token_id``;
    ``response_mask[:, t] = running``; ``log_probs[:, t]`` the log-prob where running, else 0; ``done |= token ==
    eos_token_id`` (unchanged when it is None); ``last_tok`` gets what ``responses[:, t]`` got; ``last_valid =
    running``; ``step += 1``. A step outside ``[0, R)`` writes no column.

    Args:
        logits: ``[B, V]`` next-token logits (fp32, bf16 or fp16), last dimension contiguous.
        temperature: > 0 samples, 0 decodes greedily (and needs neither ``seed`` nor ``noise``).
        step: ``[]`` int64 device tensor, the column ``t`` (and the in-kernel noise's step).
        responses: ``[B, R]`` int64. response_mask: ``[B, R]`` bool. log_probs: ``[B, R]`` fp32 (last dimensions
            contiguous).
        done: ``[B]`` bool. last_tok: ``[B]`` int64. last_valid: ``[B]`` bool (contiguous).
        eos_token_id: ends a row; None: rows never finish.
        pad_token_id: written where a row has finished.
        seed: ``[]`` int64 device tensor: in-kernel noise (the decoder's mode).
        noise: ``[B, V]`` uniform noise instead of ``seed`` (the tests compare the two rules with it).
    """
    if triton is None:
        raise RuntimeError("fused_sample_record needs Triton")
    mode = _noise_mode(logits, noise, seed, step, temperature)
    _check_scalar("step", step, logits.device)
    rows, vocab = logits.shape
    for name, buf, dtype, shape in (
        ("responses", responses, torch.int64, None),
        ("response_mask", response_mask, torch.bool, None),
        ("log_probs", log_probs, torch.float32, None),
        ("done", done, torch.bool, (rows,)),
        ("last_tok", last_tok, torch.int64, (rows,)),
        ("last_valid", last_valid, torch.bool, (rows,)),
    ):
        want = shape or (rows, responses.shape[-1])
        if (
            buf.dtype != dtype
            or tuple(buf.shape) != want
            or buf.stride(-1) != 1
            or buf.device != logits.device
        ):
            raise ValueError(
                f"{name} must be a {list(want)} {dtype} tensor on {logits.device} with a contiguous last dimension, "
                f"got {list(buf.shape)} {buf.dtype} on {buf.device}"
            )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if rows == 0:
        step += 1
        return
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    pdl = pdl_enabled(logits.device)  # both launches take part in PDL, or neither
    parts, index, step_copy = _launch_blocks(logits, noise, seed, step, mode, inv_t, record=True, pdl=pdl)
    n_blocks = index.shape[1]
    _sample_combine[(rows,)](
        logits,
        parts,
        index,
        responses,
        log_probs,
        response_mask,
        done,
        last_tok,
        last_valid,
        step,
        step_copy,
        seed if seed is not None else step_copy,
        step_copy,  # the step this draw is for (the kernel advances step itself)
        vocab,
        logits.stride(0),
        responses.stride(0),
        response_mask.stride(0),
        log_probs.stride(0),
        responses.shape[1],
        n_blocks,
        inv_t,
        0 if eos_token_id is None else int(eos_token_id),
        int(pad_token_id),
        STOCHASTIC=temperature > 0,
        RECORD=True,
        HAS_EOS=eos_token_id is not None,
        CDF=mode == _KERNEL_NOISE,
        GIVEN=False,
        BLOCKS=max(16, next_power_of_2(n_blocks)),
        BLOCK=BLOCK_V,
        PDL=pdl,
        num_warps=_COMBINE_WARPS[mode == _KERNEL_NOISE],
        **({"launch_pdl": True} if pdl else {}),
    )


def fused_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-probabilities that :func:`fused_sample_record` records for ``tokens`` drawn from ``logits``, bit for
    bit: the same first kernel (in-kernel noise when ``temperature > 0``, the decoder's mode; greedy otherwise)
    and the same combining kernel with as many warps, which reads the token instead of drawing it. Each row's
    result depends on that row alone (one program per row and block), so the rows may be any tokens of any
    sequences: training's exact log-probs (:mod:`ppo_core_decode.sequence_log_probs`).

    Args:
        logits: ``[N, V]`` next-token logits (fp32, bf16 or fp16) on CUDA, last dimension contiguous.
        tokens: ``[N]`` int64 token ids in ``[0, V)``.
        temperature: the sampling temperature (0: greedy, scored at ``T = 1``).

    Returns:
        ``[N]`` fp32 log-probabilities ``x[token] - logsumexp(x)``, ``x = logits / T``.
    """
    if triton is None:
        raise RuntimeError("fused_token_log_probs needs Triton")
    if logits.dim() != 2 or tokens.shape != logits.shape[:1] or tokens.dtype != torch.int64:
        raise ValueError(
            f"logits must be [N, V] and tokens [N] int64, got {tuple(logits.shape)} and {tuple(tokens.shape)} "
            f"{tokens.dtype}"
        )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = tokens.contiguous()
    rows = logits.shape[0]
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return log_probs
    mode = _KERNEL_NOISE if temperature > 0 else _NO_NOISE
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    pdl = pdl_enabled(logits.device)
    parts, index, step_copy = _launch_blocks(logits, None, None, None, mode, inv_t, record=False, pdl=pdl)
    _launch_combine(
        logits, parts, index, tokens, log_probs, step_copy, None, None, mode, temperature, pdl, given=True
    )
    return log_probs


def fused_sampling_uniforms(seed: torch.Tensor, step: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, 2]`` fp32 uniforms that :func:`fused_sample` draws in the kernel for ``seed`` and ``step``
    (module docstring): column 0 chooses a row's block, column 1 the entry inside it (:func:`inverse_cdf_draw` is
    the draw from them). For tests and debugging; sampling never stores them.

    Example:
        >>> seed, step = torch.tensor(7, device="cuda"), torch.tensor(0, device="cuda")
        >>> u = fused_sampling_uniforms(seed, step, 3)
        >>> u.shape, bool(((u > 0) & (u < 1)).all())
        (torch.Size([3, 2]), True)
    """
    if triton is None:
        raise RuntimeError("fused_sampling_uniforms needs Triton")
    _check_scalar("seed", seed, seed.device)
    _check_scalar("step", step, seed.device)
    out = torch.empty(rows, 2, dtype=torch.float32, device=seed.device)
    if rows:
        _uniforms_kernel[(cdiv(rows, 1024),)](seed, step, out, rows, BLOCK_R=1024)
    return out


def inverse_cdf_draw(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-kernel draw of :func:`fused_sample` in PyTorch (any device): tokens ``[B]`` and log-probabilities
    ``[B]`` (fp32) of ``logits [B, V]`` at ``temperature > 0`` from ``uniforms [B, 2]`` (module docstring).

    The vocabulary is cut into blocks of ``block`` entries (default :data:`BLOCK_V`, the kernel's); with
    ``x = logits * (1 / T)``, ``m_b`` the largest ``x`` of block ``b`` and ``s_b = sum exp(x - m_b)`` over it, the
    block is the first whose running mass ``sum_{c <= b} s_c exp(m_c - m)`` exceeds ``u_0`` times the total, and
    the token the first entry of that block whose running ``exp(x - m_b)`` exceeds ``u_1`` times the block's sum.
    The kernel sums in another order: it can choose a neighbour where ``u`` falls within fp32 rounding of a
    boundary.

    Example:
        >>> tokens, _ = inverse_cdf_draw(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, 0.75]]), 1.0)
        >>> tokens.tolist()
        [1]
    """
    block = BLOCK_V if block is None else block
    if logits.dim() != 2 or tuple(uniforms.shape) != (logits.shape[0], 2):
        raise ValueError(
            f"inverse_cdf_draw needs logits [B, V] and uniforms [B, 2]; got logits {tuple(logits.shape)} and "
            f"uniforms {tuple(uniforms.shape)}"
        )
    if temperature <= 0 or block < 1:
        raise ValueError(
            f"temperature must be > 0 and block >= 1, got temperature {temperature}, block {block}"
        )
    rows, vocab = logits.shape
    x = logits.float() * (1.0 / temperature)
    n_blocks = -(-vocab // block)
    padded = torch.full((rows, n_blocks * block), float("-inf"), device=x.device)
    padded[:, :vocab] = x
    xb = padded.view(rows, n_blocks, block)
    m = xb.amax(-1)
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(xb - m_safe[..., None])
    m_all = m.amax(-1, keepdim=True)
    m_all = torch.where(m_all == float("-inf"), 0.0, m_all)
    mass = p.sum(-1) * torch.exp(m - m_all)
    lse = m_all[:, 0] + torch.log(mass.sum(-1))
    blocks = torch.arange(n_blocks, device=x.device)
    exceeds = mass.cumsum(-1) > uniforms[:, :1].float() * mass.sum(-1, keepdim=True)
    chosen = torch.where(
        exceeds.any(-1),
        torch.where(exceeds, blocks, n_blocks).amin(-1),
        torch.where(mass > 0, blocks, 0).amax(-1),
    )
    p_chosen = p[torch.arange(rows, device=x.device), chosen]  # [B, block]
    entries = torch.arange(block, device=x.device)
    running = p_chosen.cumsum(-1)
    exceeds = running > uniforms[:, 1:].float() * running[:, -1:]
    entry = torch.where(
        exceeds.any(-1),
        torch.where(exceeds, entries, block).amin(-1),
        torch.where(p_chosen > 0, entries, 0).amax(-1),
    )
    tokens = (chosen * block + entry).clamp(max=vocab - 1)
    return tokens, x.gather(-1, tokens[:, None])[:, 0] - lse
