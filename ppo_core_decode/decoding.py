"""KV-cached batched decoding with one CUDA graph per decode step: the engine behind the Hugging Face and
megatron-core rollout engines.

A model plugs in as a :class:`CachedForward`: ``forward(input_ids [B, S], positions [B, S], cache) -> logits
[B, V]`` (any floating dtype, read in fp32 by the sampler; the full vocabulary, last position only) that routes its attention through
:meth:`ppo_core_decode.kv_cache.KVCache.attend`. :class:`StaticCacheDecoder` then

1. allocates the cache for ``B`` rows of ``P + R`` slots,
2. runs the prompts of all rows at once (prefill) and draws the first response token,
3. runs ``R - 1`` decode steps of one token per row. On CUDA each step (model forward, sampling, bookkeeping:
   every tensor it touches is a fixed buffer, every index a device tensor) is captured as a CUDA graph and
   replayed, up to ``steps_per_graph`` consecutive steps in one graph (never past a check for finished rows), so
   steps cost one launch a group and no host synchronisation. Attention reads only the filled part of the cache:
   a step's graph attends to its ``kv_bucket``-multiple of cache length, and a group's graph is keyed by its
   steps' lengths. A decoder's first generation of given shapes and
   settings runs its first step eagerly (it compiles kernels and makes library handles) and captures from the
   second; a later generation of the same shapes and settings replays the previous one's graphs where every
   tensor they read is back at its address (see "Memory" below), else captures the first step's graph while the
   GPU runs its prefill (capturing records launches, executes nothing, and here neither synchronises the device nor
   empties the allocator's cache), so it pays no eager step and the capture hides behind the prefill,
4. stops early, checking every ``check_every`` steps, once every row has emitted EOS.

Sampling follows :func:`ppo_core.rollout.sampling.sample_tokens`. Where its fused Triton rule applies (CUDA logits,
no top-k/top-p truncation) a step draws and records its token in two launches
(:func:`ppo_core_decode.fused_sampling.fused_sample_record`) and, when sampling, the randomness is made inside the
second one: two uniforms a row from Philox keyed by a seed drawn once per :meth:`StaticCacheDecoder.generate` from
the caller's generator, with the step (read from the device tensor ``t``, so a replayed graph draws the next step's)
and the row as counter, which pick the token by the inverse of the cumulative distribution. No ``[B, V]`` noise is
stored and nothing is launched outside the graph. Elsewhere (CPU, top-k, top-p) a noise buffer is filled from the
caller's generator before each step (outside the graph) and ``sample_tokens`` (Gumbel-max) and a few PyTorch
operations record the token. Either way a seeded generator reproduces the tokens exactly, with or without graphs
(the eager and the captured step run the same kernels); the two modes draw differently, so they draw different
tokens from the same generator.

Output (verl's layout): ``prompts [B, P]``, ``responses [B, R]`` (right-padded with ``pad_token_id``),
``input_ids [B, P + R]``, ``attention_mask [B, P + R]``, ``response_mask [B, R]`` (1 up to and including the
first EOS) and ``rollout_log_probs [B, R]`` (0 where ``response_mask`` is 0).

Memory: the cache holds ``2 * layers * B * G * (P + R) * d`` elements of the model dtype. It is freed at the end of
:meth:`StaticCacheDecoder.generate` unless ``keep_cache=True``, in which case a following call with the same shapes
and sampling settings reuses it and the graphs (no allocation, no capture). Without ``keep_cache`` the rest of the
generation's state is kept: its small buffers, its graphs and their memory pool (the decode steps' intermediates,
tens of MB). The next call with the same shapes and settings allocates the cache again and, where the cache and every
tensor the forward holds (its weights and the per-generation copies the engines make of them) are back at the
addresses the graphs were captured with (:func:`~ppo_core_decode.graph_inputs.held_tensor_addresses`, compared
after the prefill), replays those graphs instead of capturing them again (``DecodeStats.graphs_reused``); otherwise
they are destroyed during that call's prefill, where the host waits for the device anyway, and captured anew. The
allocator usually hands a repeated generation its memory back at the same addresses; a training step in between may
move it. :meth:`StaticCacheDecoder.release` frees everything at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from tensordict import TensorDict
from torch import nn

from ppo_core._checks import check_ndim, check_tensor
from ppo_core.rollout.layout import rollout_batch
from ppo_core.rollout.prompt_checks import check_prompts, check_token_id
from ppo_core.rollout.sampling import SamplingConfig, sample_tokens
from ppo_core_decode.fused_sampling import fused_sample_record, fused_sampling_available
from ppo_core_decode.graph_inputs import fully_walked, held_tensor_addresses
from ppo_core_decode.kv_cache import KVCache

__all__ = ["CachedForward", "CachedRolloutEngine", "DecodeStats", "ModelSpec", "StaticCacheDecoder"]

logger = logging.getLogger(__name__)


class CachedForward(Protocol):
    """A model's forward through a :class:`~ppo_core_decode.kv_cache.KVCache`."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``input_ids``/``positions`` ``[B, S]`` -> logits ``[B, V]`` of the last position (any floating dtype)."""
        ...


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the cache needs to know about the model (per rank: ``kv_heads`` after tensor parallelism)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclasses.dataclass
class DecodeStats:
    """Measurements of the last :meth:`StaticCacheDecoder.generate` call (seconds, bytes)."""

    prefill_s: float = 0.0
    """The prefill, with the first decode step's capture where the host is still capturing when the device is done.
    On CUDA both spans are the device's time between events: the host does not wait for the prefill before it
    queues the first decode steps."""
    decode_s: float = 0.0
    """The decode steps, and the assembly of the outputs queued after them."""
    decode_steps: int = 0
    new_tokens: int = 0
    cache_bytes: int = 0
    peak_memory_bytes: int = 0
    graphs_captured: int = 0
    graphs_reused: int = 0
    """Decode graphs of the previous generation of the same shapes and settings replayed by this one (the tensors
    they read were back at their addresses), none of them captured again."""
    cuda_graphs: bool = False
    host_prefill_s: float = 0.0
    """Host time to queue the prefill (on CUDA the device runs it meanwhile; on the CPU it is the prefill)."""
    host_capture_s: float = 0.0
    """Host time capturing decode graphs during the call: the first steps' graph is captured while the device runs
    the prefill, so where this plus :attr:`host_prefill_s` outlasts the device's prefill the rest shows in
    :attr:`prefill_s`."""
    host_release_s: float = 0.0
    """Host time destroying the previous generation's graphs (done while the device runs this call's prefill)."""


@dataclasses.dataclass(eq=False)
class _State:
    """The fixed buffers of one generation (a graph replays over exactly these)."""

    key: tuple
    cache: KVCache
    prompt_len: torch.Tensor  # [B] valid prompt tokens per row
    t: torch.Tensor  # [] int64, index of the response token the next decode step draws
    last_tok: torch.Tensor  # [B] the token fed to the next step
    last_valid: torch.Tensor  # [B] bool, whether that token is part of its response
    done: torch.Tensor  # [B] bool, row has emitted EOS
    responses: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R] bool
    log_probs: torch.Tensor  # [B, R] fp32
    noise: torch.Tensor | None = None  # [B, V] uniform noise (PyTorch rule while sampling)
    seed: torch.Tensor | None = None  # [] int64, key of the in-kernel uniforms (fused rule while sampling)
    fused: bool | None = None  # the fused Triton rule draws and records (decided on the first logits)
    # the decode graphs, keyed by the cache lengths their steps attend to
    graphs: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)
    # what the graphs read: StaticCacheDecoder._addresses when the first of them was captured
    addresses: tuple | None = None

    @property
    def prompt_width(self) -> int:
        """``P``: the cache holds the prompt's ``P`` slots, then one per response token."""
        return self.cache.length - self.responses.shape[1]


class StaticCacheDecoder:
    """Batched generation through a static KV cache (see the module docstring).

    Args:
        forward: the model's :class:`CachedForward`.
        spec: cache shape and placement.
        vocab_size: ``V`` of the logits ``forward`` returns.
        cuda_graphs: capture decode steps as CUDA graphs; None: when the model is on a CUDA device.
        kv_bucket: granularity (slots) of the cache length a decode graph attends to.
        check_every: decode steps between two checks for "every row has finished" (each a host sync).
        steps_per_graph: most consecutive decode steps captured in one CUDA graph (never across a check): one
            launch instead of one a step. A graph's launch leaves the GPU idle briefly before each step, and
            inside a group the steps follow each other with no gap; but capturing a group costs its steps' host
            time, so a generation that captures its graphs anew (without ``keep_cache``) spends more than that
            saves. Worth raising with ``keep_cache=True`` (graphs captured once for every generation of the same
            shapes and settings).
        keep_cache: keep the cache and graphs for the next call with the same shapes and settings (without it the
            cache is freed at the end of a call, and the graphs are replayed by the next call of the same shapes and
            settings only where the tensors they read are back at their addresses: see the module docstring).
    """

    def __init__(
        self,
        forward: CachedForward,
        spec: ModelSpec,
        vocab_size: int,
        *,
        cuda_graphs: bool | None = None,
        kv_bucket: int = 128,
        check_every: int = 8,
        steps_per_graph: int = 1,
        keep_cache: bool = False,
    ) -> None:
        if kv_bucket < 1 or check_every < 1 or steps_per_graph < 1:
            raise ValueError(
                f"kv_bucket, check_every and steps_per_graph must be >= 1, got {kv_bucket}, {check_every}, "
                f"{steps_per_graph}"
            )
        self.forward = forward
        self.spec = spec
        self.vocab_size = int(vocab_size)
        self.cuda_graphs = spec.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.kv_bucket = int(kv_bucket)
        self.check_every = int(check_every)
        self.steps_per_graph = int(steps_per_graph)
        self.keep_cache = keep_cache
        self.stats = DecodeStats()
        self._state: _State | None = None
        # whether the addresses the graphs read can all be listed (the forward is one of ppo-core's: see
        # graph_inputs): then a generation replays the previous one's graphs where they are unchanged
        self._walks_forward = fully_walked(forward)
        self._pool: Any = None
        self._stream: Any = None
        # graphs of the previous generation that this one does not replay, destroyed during its prefill
        self._retired: list[Any] = []
        # generation keys (shapes and settings) this decoder has run: their kernels are compiled and their library
        # handles made, so their first decode step is captured at once (during the prefill) instead of run eagerly
        self._warm: set[tuple] = set()

    # ----- public --------------------------------------------------------------------------------------------
    def new_cache(self, batch: int, length: int) -> KVCache:
        """A zeroed :class:`KVCache` of ``length`` slots for ``batch`` rows of this model."""
        spec = self.spec
        return KVCache.allocate(
            layers=spec.layers,
            batch=batch,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            length=length,
            dtype=spec.dtype,
            device=spec.device,
        )

    def release(self) -> None:
        """Free the cache and the captured graphs."""
        if self._state is not None:
            self._state.graphs.clear()
        self._state = None
        self._retired.clear()
        self._pool = None

    def _retire(self) -> None:
        """The end of a generation without ``keep_cache``: free the cache now, and keep the rest of the state with
        its graphs (their memory pool: the decode steps' intermediates, tens of MB) for the next generation, which
        replays them where nothing they read has moved and otherwise destroys them while the device runs its
        prefill (:meth:`_keep_or_retire_graphs`), or :meth:`release`. Destroying a generation's graphs and freeing
        their pool at its end kept the caller waiting with the device idle."""
        state = self._state
        if state is not None:
            state.cache.free_slots()
            if state.noise is not None:  # [B, V] fp32: the next generation's first draw allocates it again
                state.noise, state.fused = None, None

    def _addresses(self, state: _State) -> tuple:
        """The address and size of every tensor a decode graph of ``state`` reads outside its own memory pool: the
        cache's buffers, the state's, and every tensor the forward holds (the model's weights, the engines'
        per-generation copies of them, their tables)."""
        cache = state.cache
        buffers = (
            state.prompt_len,
            state.t,
            state.last_tok,
            state.last_valid,
            state.done,
            state.responses,
            state.response_mask,
            state.log_probs,
            state.noise,
            state.seed,
        )
        return held_tensor_addresses(
            cache.keys,
            cache.values,
            cache.key_valid,
            [t for t in buffers if t is not None],
            self.forward,
            skip=(KVCache, StaticCacheDecoder),
        )

    def _keep_or_retire_graphs(self, state: _State) -> None:
        """After the prefill of a generation whose state holds graphs (a previous generation's of the same shapes and
        settings): keep them where every tensor they read is where it was at their capture (or, for a forward whose
        tensors cannot be listed, where the caller kept the cache); else retire them, to be destroyed while the
        device runs this prefill, and capture anew."""
        unchanged = self._addresses(state) == state.addresses if self._walks_forward else self.keep_cache
        if unchanged:
            self.stats.graphs_reused = len(state.graphs)
            return
        self._retired.extend(state.graphs.values())
        state.graphs.clear()

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
        generator: torch.Generator | None = None,
        step_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> TensorDict:
        """Sample ``max_new_tokens`` tokens for each left-padded prompt (see the module docstring for the output):
        the keyword form of :meth:`decode`, whose settings are checked here, once, as a
        :class:`~ppo_core.rollout.sampling.SamplingConfig` (the same errors).

        Args:
            prompts: ``[B, P]`` token ids, left-padded, on the model's device (checked and right-padded ones
                left-padded by :func:`~ppo_core.rollout.prompt_checks.check_prompts`; ``B = 0`` returns empty
                outputs).
            prompt_mask: ``[B, P]`` 1 on prompt tokens, 0 on padding.
            max_new_tokens: ``R``.
            temperature, top_k, top_p: sampling settings (:func:`~ppo_core.rollout.sampling.sample_tokens`).
            eos_token_id: ends a response (kept, mask 1); None: every response has ``R`` tokens. Both ids must be
                in ``[0, vocab_size)``.
            pad_token_id: written after EOS.
            generator: RNG on the model's device; required unless ``temperature == 0``.
            step_hook: testing/benchmark hook ``(t, logits [B, V]) -> logits`` applied before drawing token ``t``
                (inside the graph: it must use device operations only).
        """
        config = SamplingConfig(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            engine="reference",  # no engine is built from it: it carries the settings
        )
        return self.decode(prompts, prompt_mask, config, generator=generator, step_hook=step_hook, names="")

    @torch.no_grad()
    def decode(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: SamplingConfig,
        *,
        generator: torch.Generator | None = None,
        step_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        names: str = "config.",
    ) -> TensorDict:
        """:meth:`generate` with the settings of a :class:`~ppo_core.rollout.sampling.SamplingConfig` (checked when it
        was built: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p`` are read, not checked again). Checked
        here: what depends on this call or this model, the prompts, the generator and the EOS / pad ids against the
        vocabulary (named ``{names}eos_token_id``)."""
        temperature, r = config.temperature, config.max_new_tokens
        if temperature > 0 and generator is None:
            raise ValueError(
                "generator is required when temperature > 0 (ppo-core never uses the global RNG)"
            )
        eos_token_id = check_token_id(
            f"{names}eos_token_id", config.eos_token_id, self.vocab_size, optional=True
        )
        pad_token_id = check_token_id(f"{names}pad_token_id", config.pad_token_id, self.vocab_size)
        top_k, top_p = config.top_k, config.top_p
        # every prompt check (and "is any prompt padded") is read in the one host sync before the prefill
        checked = check_prompts(prompts, prompt_mask, self.vocab_size)
        device = self.spec.device
        if prompts.device != device:
            raise ValueError(f"prompts are on {prompts.device}, the model on {device}")
        prompts, mask, padded = checked.prompts, checked.mask, checked.padded
        b, p = prompts.shape
        if b == 0:
            empty = torch.zeros(0, r, dtype=torch.long, device=device)
            return rollout_batch(prompts, mask.long(), empty, empty.clone(), empty.float())
        settings = (float(temperature), int(top_k), float(top_p), eos_token_id, pad_token_id, step_hook)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.stats = DecodeStats(cuda_graphs=self.cuda_graphs)
        state = self._prepare((b, p, r, *settings))
        self.stats.cache_bytes = state.cache.nbytes
        sample = _Sampler(*settings[:5], hook=step_hook)

        clock = _SpanClock(device)
        host = time.perf_counter()
        self._prefill(state, prompts, mask, padded, sample, generator)
        self.stats.host_prefill_s = time.perf_counter() - host
        if state.graphs:
            self._keep_or_retire_graphs(state)
        warm = state.key in self._warm
        if warm and self.cuda_graphs and r > 1:
            # the host is idle while the GPU runs the prefill: capture the first decode steps' graph meanwhile
            self._graph(state, self._kv_lens(state, 1, self._group_length(state, 1, r)), sample)
        # the previous generation's graphs not replayed, destroyed while the device runs this prefill
        host = time.perf_counter()
        self._retired.clear()
        self.stats.host_release_s = time.perf_counter() - host
        if not state.graphs:
            # a private memory pool lives while a graph captured in it does: with the previous generation's graphs
            # gone and none captured in it by this one (another shape or settings, or not warm), the handle names a
            # freed pool, and capturing into it fails; the next capture starts a new pool
            self._pool = None
        # no synchronisation here: the host queues the first decode steps while the device finishes the prefill
        clock.mark()

        steps, t = 0, 1
        while t < r:
            if eos_token_id is not None and t % self.check_every == 0 and bool(state.done.all()):
                break
            if state.noise is not None:
                state.noise.uniform_(generator=generator)
            eager = t == 1 and not warm
            n = 1 if eager else self._group_length(state, t, r)
            self._decode(state, self._kv_lens(state, t, n), sample, eager=eager)
            steps, t = steps + n, t + n
        # the outputs are assembled (queued after the last step) while the device still decodes: the host's work
        # on them overlaps the decoding instead of following it with the device idle
        response_mask = state.response_mask.long()
        out = rollout_batch(
            prompts, mask.long(), state.responses.clone(), response_mask, state.log_probs.clone()
        )
        new_tokens = response_mask.sum()
        clock.mark()
        _sync(device)
        self.stats.prefill_s, self.stats.decode_s = clock.spans()
        self.stats.decode_steps = steps
        self._warm.add(state.key)
        self.stats.new_tokens = int(new_tokens)
        if device.type == "cuda":
            self.stats.peak_memory_bytes = _peak_allocated(device)
        if not self.keep_cache:
            self._retire()
        return out

    # ----- steps ---------------------------------------------------------------------------------------------
    def _prepare(self, key: tuple) -> _State:
        kept = self._state  # the previous generation's (its cache freed unless keep_cache)
        if kept is not None:
            if kept.key == key:
                kept.cache.allocate_slots()
                return kept
            # another shape or settings: its graphs are destroyed while the device runs this prefill
            self._retired.extend(kept.graphs.values())
            kept.graphs.clear()
            self._state = None
        b, p, r = key[:3]
        device = self.spec.device
        cache = self.new_cache(b, p + r)
        self._state = _State(
            key=key,
            cache=cache,
            prompt_len=torch.zeros(b, dtype=torch.long, device=device),
            t=torch.zeros((), dtype=torch.long, device=device),
            last_tok=torch.zeros(b, dtype=torch.long, device=device),
            last_valid=torch.zeros(b, dtype=torch.bool, device=device),
            done=torch.zeros(b, dtype=torch.bool, device=device),
            responses=torch.zeros(b, r, dtype=torch.long, device=device),
            response_mask=torch.zeros(b, r, dtype=torch.bool, device=device),
            log_probs=torch.zeros(b, r, dtype=torch.float32, device=device),
        )
        return self._state

    def _prefill(
        self,
        state: _State,
        prompts: torch.Tensor,
        mask: torch.Tensor,
        padded: bool,
        sample: _Sampler,
        generator: torch.Generator | None,
    ) -> None:
        cache = state.cache
        cache.begin_prefill(mask, padded=padded)
        state.prompt_len.copy_(mask.sum(-1))
        state.done.zero_()
        state.response_mask.zero_()
        state.log_probs.zero_()
        state.responses.fill_(sample.pad_token_id)
        state.t.fill_(0)
        logits = self.forward(prompts, cache.positions, cache)
        cache.prefill_mask = None
        self._record(state, logits, sample, generator)

    def _kv_len(self, state: _State, t: int) -> int:
        """The cache length decode step ``t`` attends to (a multiple of ``kv_bucket``: one graph per bucket)."""
        return min(-(-(state.prompt_width + t) // self.kv_bucket) * self.kv_bucket, state.cache.length)

    def _group_length(self, state: _State, t: int, r: int) -> int:
        """How many decode steps from ``t`` one launch runs: up to :attr:`steps_per_graph`, never past the next
        check for finished rows nor the last step (one where a noise buffer is filled before each step)."""
        if state.noise is not None:
            return 1
        next_check = (t // self.check_every + 1) * self.check_every
        return max(1, min(self.steps_per_graph, next_check - t, r - t))

    def _kv_lens(self, state: _State, t: int, n: int) -> tuple[int, ...]:
        """The cache lengths decode steps ``t .. t + n - 1`` attend to (the key of their graph)."""
        return tuple(self._kv_len(state, t + i) for i in range(n))

    def _decode(self, state: _State, kv_lens: tuple[int, ...], sample: _Sampler, eager: bool) -> None:
        """Run ``len(kv_lens)`` decode steps: one graph replay, or eagerly."""
        if not self.cuda_graphs:
            self._steps(state, kv_lens, sample)
            return
        if eager:  # a first generation warms up (library handles, compiled kernels) on the capture stream
            stream = self._capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._steps(state, kv_lens, sample)
            torch.cuda.current_stream().wait_stream(stream)
            return
        graph = self._graph(state, kv_lens, sample)
        if graph is None:  # capture failed: eager from now on
            self._steps(state, kv_lens, sample)
            return
        graph.replay()

    def _graph(self, state: _State, kv_lens: tuple[int, ...], sample: _Sampler) -> Any:
        """The graph of decode steps attending to ``kv_lens`` (captured on first use), or None where capture
        failed."""
        graph = state.graphs.get(kv_lens)
        if graph is not None:
            return graph
        if not state.graphs and self._walks_forward:
            state.addresses = self._addresses(state)
        graph = self._capture(state, kv_lens, sample)
        if graph is not None:
            state.graphs[kv_lens] = graph
        return graph

    def _capture_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.spec.device)
        return self._stream

    def _capture(self, state: _State, kv_lens: tuple[int, ...], sample: _Sampler) -> Any:
        """Capture the decode steps attending to ``kv_lens``, one after the other, on the side stream, or None where
        capture failed. Unlike
        ``torch.cuda.graph`` this neither synchronises the device nor empties the allocator's cache first, so it may
        run while earlier work (the prefill) is still executing: capturing records launches, it executes nothing."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        host = time.perf_counter()
        try:
            with torch.cuda.stream(self._capture_stream()):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self._steps(state, kv_lens, sample)
                finally:
                    graph.capture_end()
        except Exception:  # an operation that cannot be captured: stay correct, lose the speed
            logger.warning(
                "capturing the decode step as a CUDA graph failed; decoding eagerly", exc_info=True
            )
            self.cuda_graphs = False
            return None
        self.stats.graphs_captured += 1
        self.stats.host_capture_s += time.perf_counter() - host
        return graph

    def _steps(self, state: _State, kv_lens: tuple[int, ...], sample: _Sampler) -> None:
        """Consecutive decode steps, the ``i``-th attending to ``kv_lens[i]`` slots (what a graph captures)."""
        for kv_len in kv_lens:
            self._step(state, kv_len, sample)

    def _step(self, state: _State, kv_len: int, sample: _Sampler) -> None:
        """One decode step over fixed buffers (what a graph captures)."""
        cache, b = state.cache, state.last_tok.shape[0]
        # the fed token occupies its slot for every later query if its row was still running when it was drawn
        positions = cache.begin_decode_step(
            state.t, state.prompt_len, state.prompt_width, kv_len, fed_valid=state.last_valid
        )
        logits = self.forward(state.last_tok.view(b, 1), positions, cache)
        self._record(state, logits, sample)

    def _record(
        self, state: _State, logits: torch.Tensor, sample: _Sampler, generator: torch.Generator | None = None
    ) -> None:
        """Draw token ``t`` from ``logits [B, V]``, write it and its log-prob, advance ``t``.

        ``generator`` (the prefill's call) first draws this generation's noise: its seed, or the first step's
        ``[B, V]`` noise.
        """
        if sample.hook is not None:
            logits = sample.hook(state.t, logits)
        if state.fused is None:
            self._choose_rule(state, logits, sample)
        if generator is not None and state.seed is not None:
            state.seed.random_(generator=generator)
        elif generator is not None and state.noise is not None:
            state.noise.uniform_(generator=generator)
        if state.fused:
            fused_sample_record(
                logits,
                sample.temperature,
                step=state.t,
                responses=state.responses,
                response_mask=state.response_mask,
                log_probs=state.log_probs,
                done=state.done,
                last_tok=state.last_tok,
                last_valid=state.last_valid,
                eos_token_id=sample.eos_token_id,
                pad_token_id=sample.pad_token_id,
                seed=state.seed,
            )
            return
        b = logits.shape[0]
        tok, logp = sample_tokens(
            logits, state.noise, temperature=sample.temperature, top_k=sample.top_k, top_p=sample.top_p
        )
        running = ~state.done
        index = state.t.view(1)
        state.responses.index_copy_(1, index, torch.where(running, tok, sample.pad_token_id).view(b, 1))
        state.response_mask.index_copy_(1, index, running.view(b, 1))
        state.log_probs.index_copy_(1, index, torch.where(running, logp, 0.0).view(b, 1))
        if sample.eos_token_id is not None:
            state.done |= running & (tok == sample.eos_token_id)
        state.last_tok.copy_(torch.where(running, tok, sample.pad_token_id))
        state.last_valid.copy_(running)
        state.t += 1

    def _choose_rule(self, state: _State, logits: torch.Tensor, sample: _Sampler) -> None:
        """Fix, for the life of ``state``, which rule draws (the logits of a model keep their device and dtype) and
        allocate what its noise needs."""
        state.fused = fused_sampling_available(logits, sample.top_k, sample.top_p)
        if not sample.stochastic:
            return
        device = state.t.device
        if state.fused:
            state.seed = torch.zeros((), dtype=torch.int64, device=device)
        else:
            state.noise = torch.empty(logits.shape[0], self.vocab_size, device=device)


@dataclasses.dataclass(frozen=True)
class _Sampler:
    temperature: float
    top_k: int
    top_p: float
    eos_token_id: int | None
    pad_token_id: int
    hook: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def stochastic(self) -> bool:
        return self.temperature > 0


def _peak_allocated(device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated(device)`` without flattening every allocator statistic into a sorted dict
    first (host time at the end of every generation, with the device idle)."""
    return int(torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _SpanClock:
    """Consecutive spans of a generation (seconds) without synchronising between them: on CUDA, events recorded on
    the current stream (the device's time from one mark to the next, read once the caller has synchronised); on
    other devices, the host's clock (the work is done when the host returns)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """The seconds between consecutive marks (after a synchronisation on CUDA)."""
        pairs = list(itertools.pairwise(self.marks))
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


class CachedRolloutEngine:
    """The rollout-engine protocol over a :class:`StaticCacheDecoder` on a module that trains in place.

    Subclasses build ``self.decoder`` (through :meth:`_init_decoder`) and may override :meth:`_forwarding` to point
    the module's attention at the cache; :meth:`generate` puts the module in eval mode for the generation and
    back afterwards, where that changes anything (:meth:`_eval_mode`).
    """

    module: nn.Module
    decoder: StaticCacheDecoder

    def _init_decoder(
        self,
        module: nn.Module,
        forward: CachedForward,
        spec: ModelSpec,
        vocab_size: int,
        **options: Any,
    ) -> None:
        self.module = module
        self.decoder = StaticCacheDecoder(forward, spec, vocab_size, **options)

    @property
    def stats(self) -> DecodeStats:
        """Timings and memory of the last :meth:`generate`."""
        return self.decoder.stats

    def release(self) -> None:
        """Free the KV cache and graphs kept by ``keep_cache=True``."""
        self.decoder.release()

    def _decoding(self, prompts: torch.Tensor, config: Any) -> contextlib.AbstractContextManager:
        """What the module needs around one generation: :meth:`_forwarding` for its longest sequence."""
        return self._forwarding(prompts.shape[1] + config.max_new_tokens)

    def _forwarding(self, length: int) -> contextlib.AbstractContextManager:
        """What the module needs around cached forwards of sequences of up to ``length`` tokens (nothing by
        default)."""
        return contextlib.nullcontext()

    def _runs_module_forwards(self) -> bool:
        """Whether the forward calls modules whose output depends on train/eval mode (dropout and the like): True
        by default; an engine that only applies its own functions to the module's weights returns False."""
        return True

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """The module in eval mode for one generation and back afterwards, where that changes anything: not when it
        is in eval mode already, nor when the forward runs no module whose output depends on the mode (setting the
        mode visits every submodule, host time on every call)."""
        if not self.module.training or not self._runs_module_forwards():
            yield
            return
        self.module.eval()
        try:
            yield
        finally:
            self.module.train(True)

    @torch.no_grad()
    def recompute_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The next-token logits after each left-padded sequence, from a full forward of the whole sequence through
        this engine's own forward (a prefill of all ``S`` columns; nothing cached is reused): the reference that
        cached decoding is checked against (with ``batch_invariant`` it is equal bit for bit).

        Args:
            input_ids: ``[B, S]`` left-padded token ids (a prompt and the response so far).
            attention_mask: ``[B, S]`` 1 on real tokens.

        Returns:
            ``[B, V]`` logits in the model dtype.
        """
        b, s = input_ids.shape
        cache = self.decoder.new_cache(b, s)
        cache.begin_prefill(attention_mask)
        with self._eval_mode(), self._forwarding(s):
            return self.decoder.forward(input_ids, cache.positions, cache)

    @torch.no_grad()
    def sequence_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int
    ) -> torch.Tensor:
        """The next-token logits at the last ``keep`` positions of each sequence, from one full forward through this
        engine's own layer loop (:meth:`recompute_logits` at every one of those positions at once). With
        ``batch_invariant`` the logits at position ``j`` are, bit for bit, those the cached decoding sampled token
        ``j + 1`` from when it generated the sequence (same ``[B, S]`` layout: left-padded prompts, then the
        responses).

        Args:
            input_ids: ``[B, S]`` token ids (left-padded prompts and their responses, as generated).
            attention_mask: ``[B, S]`` 1 on real tokens.
            keep: how many of the last positions to return (``R + 1`` covers a response of ``R`` tokens and the
                token after it).

        Returns:
            ``[B, keep, V]`` logits in the model dtype.

        Raises:
            ValueError: the engine's forward is not a layer loop of its own (the generic Hugging Face path).
        """
        loop = getattr(self.decoder.forward, "sequence_logits", None)
        if loop is None:
            raise ValueError(
                f"{type(self).__name__} runs the model's own forward here; sequence_logits needs the engine's layer "
                "loop (a Llama-family model on the fused path)"
            )
        b, s = input_ids.shape
        if not 1 <= keep <= s:
            raise ValueError(f"keep must be in [1, {s}] for sequences of {s} tokens, got {keep}")
        cache = self.decoder.new_cache(b, s)
        cache.begin_prefill(attention_mask)
        with self._eval_mode(), self._forwarding(s):
            return loop(input_ids, cache.positions, cache, keep)

    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: Any,
        *,
        generator: torch.Generator | None = None,
        **decode_kwargs: Any,
    ) -> TensorDict:
        """Sample one response per left-padded prompt (the rollout-engine protocol).

        Args:
            prompts: ``[B, P]`` left-padded token ids. prompt_mask: ``[B, P]``.
            config: the :class:`~ppo_core.rollout.sampling.SamplingConfig` (checked when it was built).
            generator: RNG on the model's device (required unless greedy).
            decode_kwargs: passed to :meth:`StaticCacheDecoder.decode` (``step_hook``).

        Returns:
            ``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``response_mask``,
            ``rollout_log_probs`` (see the module docstring).
        """
        if getattr(config, "batch_invariant", False) and not getattr(self, "batch_invariant", False):
            raise ValueError(
                f"batch_invariant=True (SamplingConfig; rollout.batch_invariant in a job or trainer config) but this "
                f"{type(self).__name__} does not compute batch-invariantly "
                "(HFRolloutEngine(model, batch_invariant=True) and MegatronRolloutEngine(..., batch_invariant=True) do)"
            )
        check_ndim("prompts", check_tensor("prompts", prompts), 2)  # its width sizes the forward's context
        with self._eval_mode(), self._decoding(prompts, config):
            # the typed config goes through: its settings were checked once, when it was built
            return self.decoder.decode(prompts, prompt_mask, config, generator=generator, **decode_kwargs)
