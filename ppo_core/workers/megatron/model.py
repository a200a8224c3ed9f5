"""Megatron-core ``GPTModel`` for the actor (vocab-parallel logits) and the critic (a value head), with fused
attention and fused element-wise kernels.

megatron-core's local layer spec computes attention as ``softmax(Q K^T) V`` with the ``[B, H, S, S]`` scores in
memory; without Transformer Engine that is its only attention. :class:`SDPACoreAttention` is a drop-in
``core_attention`` calling ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN kernels for causal
attention without padding, the memory-efficient kernel with a padding mask; never ``S x S`` in memory for the
former). It also applies the rotary position embedding, fused into one kernel for ``q`` and ``k``
(:mod:`~ppo_core.workers.megatron.fused`), so the model is built without megatron's unfused rotary embedding.
:func:`gpt_layer_spec` is the local spec with that attention, :class:`~ppo_core.workers.megatron.fused.FusedNorm`
norms (parameters in the model dtype) and, with ``fused_kernels``, linear layers that accumulate their weight
gradients straight into megatron's fp32 buffers (:mod:`~ppo_core.workers.megatron.linear`).

Shapes (megatron's convention inside the model): ``s`` sequence, ``b`` batch, ``h`` heads, ``g`` key/value
groups, ``d`` head width; the model takes ``input_ids [B, S]`` and returns ``[B, S, V/TP]`` logits (actor) or
``[B, S]`` values (critic).

Example:
    >>> # needs megatron parallel state: see ppo_core.workers.megatron.parallel
    >>> # model = build_gpt_model(MegatronModelConfig(...), ParallelConfig(), value_head=False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppo_core.kernels.packed_attention import PackedDocuments, packed_causal_attention
from ppo_core.workers.megatron.config import MegatronModelConfig, ParallelConfig
from ppo_core.workers.megatron.fused import FusedNorm, apply_rotary, rotary_tables

__all__ = [
    "SDPACoreAttention",
    "ValueHead",
    "build_gpt_model",
    "gpt_block_spec",
    "gpt_layer_spec",
    "logits_window",
    "packed_documents",
    "packed_seq_params",
    "padded_vocab_size",
]


class SDPACoreAttention(nn.Module):
    """``core_attention`` for megatron's ``SelfAttention`` using PyTorch's fused SDPA kernels.

    Takes ``query [s, b, h/TP, d]``, ``key``/``value [s, b, g/TP, d]`` and megatron's boolean
    ``attention_mask`` (``True`` = masked out, ``[b, 1, s, s]``) or None for plain causal attention; returns
    ``[s, b, h/TP * d]``. Grouped-query attention is handled by SDPA (``enable_gqa``), without repeating keys.

    With ``rotary_base`` set, ``query`` and ``key`` are first rotated by their positions ``0 .. s - 1`` (what
    megatron's rotary embedding does; with left padding only relative positions matter, and those are the
    same), so the model must be built with ``position_embedding_type="none"``.

    Packed sequences (``packed_seq_params`` with ``qkv_format="thd"``, see :func:`packed_seq_params`): ``query
    [t, h/TP, d]``, ``key``/``value [t, g/TP, d]`` hold documents laid end to end; each document attends causally
    to itself (:func:`~ppo_core.kernels.packed_attention.packed_causal_attention` with ``packed_attention``) and
    is rotated by its own positions from 0; returns ``[t, 1, h/TP * d]``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rotary_base: float | None = None,
        packed_attention: str = "auto",
    ) -> None:
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError(
                "SDPACoreAttention does not support context parallelism (context_parallel_size=1)"
            )
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.rotary_base = rotary_base
        self.packed_attention = packed_attention
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [s_max, 1, 1, d] (fp32)
        self._rotary_rows: tuple[torch.Tensor, torch.Tensor] | None = (
            None  # (cos it was built from, [s_max, 2 d])
        )
        # decoding: the KVCache this layer reads and writes, and its index there (set by the rollout engine)
        self.kv_cache: Any = None
        self.kv_cache_layer = 0

    def _rotary_tables(self, s: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        self._build_rotary(s, d, device)
        cos, sin = self._rotary
        return cos[:s], sin[:s]

    def _build_rotary(self, s: int, d: int, device: torch.device) -> None:
        """(Re)build the tables when they are missing, shorter than ``s`` or on another device."""
        if self._rotary is None or self._rotary[0].shape[0] < s or self._rotary[0].device != device:
            self._rotary = rotary_tables(s, d, self.rotary_base, device)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support an attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        s, b, h, d = query.shape
        if self.kv_cache is not None:
            return self._cached(query, key, value)
        if self.rotary_base is not None:
            query, key = apply_rotary(query, key, *self._rotary_tables(s, d, query.device))
        q_bhsd, k_bhsd, v_bhsd = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask
        out_bhsd = F.scaled_dot_product_attention(
            q_bhsd,
            k_bhsd,
            v_bhsd,
            attn_mask=allowed,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=allowed is None,
            scale=self.softmax_scale,
            enable_gqa=key.shape[2] != h,
        )
        return out_bhsd.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
    ) -> torch.Tensor:
        """Attention of packed documents: ``query [t, h, d]``, ``key``/``value [t, g, d]`` (a ``[t, 1, ...]`` batch
        dimension is dropped) -> ``[t, 1, h * d]``."""
        if self.dropout and self.training:
            raise ValueError("packed sequences do not support attention dropout; set attention_dropout=0")
        if query.dim() == 4:
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        docs = packed_documents(params)
        t, h, d = query.shape
        if self.rotary_base is not None:
            cos, sin = docs.cached(
                ("rotary", self.rotary_base, d, str(query.device)),
                lambda: self._rotary_at(docs.position_ids, docs.max_seqlen, d, query.device),
            )
            query, key = apply_rotary(query, key, cos, sin)
        out = packed_causal_attention(
            query, key, value, docs, scale=self.softmax_scale, backend=self.packed_attention
        )
        return out.reshape(t, 1, h * d)

    def _rotary_at(
        self, positions: torch.Tensor, max_seqlen: int, d: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[t, 1, d]`` (fp32) at ``positions [t]``."""
        cos, sin = self._rotary_tables(max_seqlen, d, device)
        index = positions.to(device)
        return cos[:, 0][index], sin[:, 0][index]

    def prepare_rotary(self, max_position: int, head_dim: int, device: torch.device) -> None:
        """Build the rotary tables for positions ``0 .. max_position - 1`` (before a graph is captured)."""
        if self.rotary_base is not None:  # no views of the tables made: a rollout calls this for every layer
            self._build_rotary(max_position, head_dim, device)

    def _cached(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention through ``self.kv_cache`` (:class:`ppo_core_decode.kv_cache.KVCache`): ``query [s, b, h, d]``,
        ``key``/``value [s, b, g, d]`` of the tokens being decoded, rotated by the cache's per-row positions."""
        s, b, h, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d] views
        out = self.attend_cache(self.kv_cache, q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _cache_rotary(self, cache: Any) -> tuple[tuple, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
        """The key under which ``cache`` shares this forward's rotary rows among the layers, and the function that
        gathers them, ``cos`` and ``sin`` ``[b, 1, s, d]`` at the cache's positions: one gather from the tables
        side by side ``[L, 2 d]`` (built once per table), the two halves returned as views."""
        cos, sin = self._rotary
        if self._rotary_rows is None or self._rotary_rows[0] is not cos:
            self._rotary_rows = (cos, torch.cat([cos[:, 0, 0], sin[:, 0, 0]], dim=-1))
        table, d = self._rotary_rows[1], cos.shape[-1]

        def gathered() -> tuple[torch.Tensor, torch.Tensor]:
            rows = table[cache.positions][:, None]  # [b, 1, s, 2 d]
            return rows[..., :d], rows[..., d:]

        # every layer's tables hold the same values (same base, width and length) at the same positions: gathered
        # once per forward, not once per layer
        return ("rotary", self.rotary_base, tuple(cos.shape)), gathered

    def cache_rotary_rows(self, cache: Any) -> None:
        """Gather the current forward's rotary rows from the tables now (a decode step does it before its first
        product, so that the gather does not sit between that product and the attention); the layers then share
        them."""
        if self.rotary_base is not None:
            cache.per_forward(*self._cache_rotary(cache))

    def attend_cache(self, cache: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [b, h, s, d]``, ``k``/``v [b, g, s, d]`` (any strides) of the tokens being decoded, rotated (with
        ``rotary_base``) at ``cache``'s per-row positions and attended through it as its layer ``kv_cache_layer``
        (one kernel for the rotation and the cache write on CUDA) -> ``[b, h, s, d]``."""
        if self.rotary_base is None:
            return cache.attend(self.kv_cache_layer, q, k, v, self.softmax_scale)
        shared, gathered = self._cache_rotary(cache)

        def tables() -> tuple[torch.Tensor, torch.Tensor]:
            c, s_ = cache.per_forward(shared, gathered)
            return c[:, 0], s_[:, 0]  # [b, s, d]

        return cache.attend_rotated(
            self.kv_cache_layer,
            q,
            k,
            v,
            lambda q, k: apply_rotary(q, k, *cache.per_forward(shared, gathered)),
            tables,
            self.softmax_scale,
            model_rounding=False,
        )


def packed_seq_params(docs: PackedDocuments) -> Any:
    """megatron's ``PackedSeqParams`` (``qkv_format="thd"``) of packed documents, carrying ``docs`` itself so that
    :class:`SDPACoreAttention` reads positions and lengths without a host synchronisation."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=docs.cu_seqlens,
        cu_seqlens_kv=docs.cu_seqlens,
        max_seqlen_q=docs.max_seqlen,
        max_seqlen_kv=docs.max_seqlen,
    )
    params.documents = docs
    return params


def packed_documents(params: Any) -> PackedDocuments:
    """The documents of megatron ``PackedSeqParams``: those :func:`packed_seq_params` attached, or rebuilt from
    ``cu_seqlens_q`` (one host synchronisation) for parameters made elsewhere."""
    docs = getattr(params, "documents", None)
    if docs is not None:
        return docs
    if (
        getattr(params, "qkv_format", "thd") != "thd"
        or getattr(params, "cu_seqlens_q_padded", None) is not None
    ):
        raise ValueError(
            "SDPACoreAttention supports packed sequences in the 'thd' format without padded offsets"
        )
    if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
        raise ValueError(
            "SDPACoreAttention supports packed self-attention only (cu_seqlens_q == cu_seqlens_kv)"
        )
    lengths = torch.diff(params.cu_seqlens_q).tolist()
    docs = PackedDocuments.from_seqlens(lengths, params.cu_seqlens_q.device)
    params.documents = docs
    return docs


def gpt_layer_spec(config: MegatronModelConfig) -> Any:
    """megatron-core's local GPT layer spec with :class:`SDPACoreAttention` (which applies the rotary embedding;
    ``attention="local"`` keeps megatron's attention), :class:`~ppo_core.workers.megatron.fused.FusedNorm`
    norms, and main-grad linear layers when ``config.fused_kernels``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec(normalization=config.norm)
    layer = spec.submodules
    attention, mlp = layer.self_attention.submodules, layer.mlp.submodules
    if config.attention == "sdpa":
        attention.core_attention = ModuleSpec(
            module=SDPACoreAttention,
            params={"rotary_base": config.rotary_base, "packed_attention": config.packed_attention},
        )
    layer.input_layernorm = layer.pre_mlp_layernorm = FusedNorm
    if config.fused_kernels:
        from ppo_core.workers.megatron.linear import MainGradColumnParallelLinear, MainGradRowParallelLinear

        attention.linear_qkv = mlp.linear_fc1 = MainGradColumnParallelLinear
        attention.linear_proj = mlp.linear_fc2 = MainGradRowParallelLinear
    return spec


def gpt_block_spec(config: MegatronModelConfig, transformer_config: Any) -> Any:
    """This pipeline stage's layers (:func:`gpt_layer_spec`) and a :class:`FusedNorm` final norm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = get_num_layers_to_build(transformer_config)
    return TransformerBlockSubmodules(layer_specs=[gpt_layer_spec(config)] * layers, layer_norm=FusedNorm)


class ValueHead(nn.Module):
    """Replaces the output layer of a critic: ``hidden [s, b, D] -> values [s, b, 1]`` (one linear map).

    Its weight is replicated on every TP rank (the hidden states it reads are too), so it needs no
    communication except the sequence-parallel gather. Called like megatron's output layer. The bias starts at 0;
    the weight at 0 (every value starts at 0), or drawn from ``N(0, init_std²)`` by a generator seeded with
    ``seed`` (the same on every rank, so TP replicas agree; the global RNG is not touched).
    """

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
        *,
        init_std: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, bias=True, dtype=dtype)
        nn.init.zeros_(self.linear.bias)
        with torch.no_grad():
            if (
                init_std > 0
            ):  # the draw of the torch critic's head (CausalLMWithValueHead): same seed, same head
                gen = torch.Generator().manual_seed(int(seed))
                self.linear.weight.copy_(torch.randn(self.linear.weight.shape, generator=gen) * init_std)
            else:
                self.linear.weight.zero_()
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        return self.linear(hidden), None


def padded_vocab_size(config: MegatronModelConfig, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp`` (megatron's padding).

    Example:
        >>> padded_vocab_size(MegatronModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
        ...                   ffn_hidden_size=8, vocab_size=1000), tp=2)
        1024
    """
    multiple = config.make_vocab_size_divisible_by * tp
    return -(-config.vocab_size // multiple) * multiple


def build_gpt_model(
    config: MegatronModelConfig,
    parallel: ParallelConfig,
    *,
    value_head: bool = False,
    value_head_init_std: float = 0.0,
    value_head_seed: int = 0,
) -> nn.Module:
    """This rank's stage of a ``GPTModel`` (parallel state must be initialised), on the current CUDA device of a
    rank that joined with nccl, on the CPU otherwise.

    Args:
        config: the model's shape and dtype.
        parallel: TP/PP/CP sizes (they must match megatron's parallel state).
        value_head: build a critic: the output layer is a :class:`ValueHead` and the model returns ``[B, S, 1]``.
        value_head_init_std, value_head_seed: the value head's initialisation (see :class:`ValueHead`).

    Returns:
        A ``GPTModel`` whose ``forward(input_ids [B, S], position_ids [B, S], attention_mask)`` returns logits
        ``[B, S, V_padded/TP]`` (actor), ``[B, S, 1]`` values (critic), or the hidden states ``[S, B, D]`` on a
        stage that is not the last.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tc = config.transformer_config(parallel)
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    cuda = (
        not tc.use_cpu_initialization
    )  # a GPU rank (nccl); a gloo rank stays on the CPU, even on a GPU host
    # megatron initialises replicated weights from the default RNG: seed a forked one (no global side effect)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        torch.manual_seed(config.seed)
        model = _gpt(GPTModel, tc, config, parallel, pre, post, value_head)
    if value_head and post:
        model.output_layer = ValueHead(
            config.hidden_size,
            config.torch_dtype,
            tc.sequence_parallel,
            init_std=value_head_init_std,
            seed=value_head_seed,
        )
    elif post and not tc.sequence_parallel:
        _add_logits_window(model.output_layer)
    if cuda:
        model = model.cuda(torch.cuda.current_device())
    return model


def _gpt(
    cls: Any,
    tc: Any,
    config: MegatronModelConfig,
    parallel: ParallelConfig,
    pre: bool,
    post: bool,
    value_head: bool,
) -> nn.Module:
    return cls(
        config=tc,
        transformer_layer_spec=gpt_block_spec(config, tc),
        vocab_size=padded_vocab_size(config, parallel.tensor_model_parallel_size),
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=config.tie_word_embeddings and not value_head,
        # SDPACoreAttention applies the rotary embedding itself (fused); megatron's own only for "local"
        position_embedding_type="none" if config.attention == "sdpa" else "rope",
        rotary_base=config.rotary_base,
    )


def _add_logits_window(layer: nn.Module) -> None:
    """Let the output layer see only a window of sequence positions (``layer.logits_window``, a slice or None).

    The loss needs logits only where responses are predicted; projecting the other positions onto the
    vocabulary (often the largest matrix product of the model) would be wasted. Overriding ``forward`` on the
    instance keeps the parameter names (checkpoints, Hugging Face loading) unchanged.
    """
    inner = layer.forward

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        window = layer.logits_window
        return inner(hidden if window is None else hidden[window], *args, **kwargs)

    layer.logits_window = None
    layer.forward = forward


class logits_window:
    """Within the ``with`` block, ``model`` computes logits only at sequence positions ``[start, stop)``, or at the
    positions of an index tensor ``start`` (``stop`` None; a packed sequence's output positions).

    A no-op on stages without an output layer, for critics, and with sequence parallelism (the output layer
    then receives sequence shards).

    Example:
        >>> # with logits_window(model, s - r - 1, s - 1): logits = model(ids, pos, mask)  # [B, r, V/TP]
        >>> # with logits_window(model, index):  logits = model(ids, pos, None, packed_seq_params=p)  # [1, n, V/TP]
    """

    def __init__(self, model: nn.Module, start: int | torch.Tensor, stop: int | None = None) -> None:
        layer = getattr(model, "output_layer", None)
        self.layer = layer if layer is not None and hasattr(layer, "logits_window") else None
        if isinstance(start, torch.Tensor):
            if stop is not None:
                raise ValueError("logits_window takes an index tensor alone, or start and stop")
            self.window: slice | torch.Tensor = start
        else:
            if stop is None:
                raise ValueError("logits_window needs stop with an int start")
            self.window = slice(start, stop)

    @property
    def active(self) -> bool:
        """Whether the model honours the window (else it returns logits for every position)."""
        return self.layer is not None

    def __enter__(self) -> logits_window:
        if self.layer is not None:
            self.layer.logits_window = self.window
        return self

    def __exit__(self, *exc: object) -> None:
        if self.layer is not None:
            self.layer.logits_window = None
