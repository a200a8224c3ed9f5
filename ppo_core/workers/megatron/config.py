"""Typed configs of the megatron-core workers: the transformer's shape and the parallel layout.

:class:`MegatronModelConfig` describes a Llama/Qwen2-shaped decoder (RMSNorm or LayerNorm, SwiGLU, rotary
positions, grouped-query attention) without importing megatron; :meth:`MegatronModelConfig.transformer_config`
turns it into a ``megatron.core`` ``TransformerConfig``. :class:`ParallelConfig` holds the tensor / pipeline /
context parallel sizes; the data-parallel size is what is left of the world size.

Example:
    >>> cfg = MegatronModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
    ...                           vocab_size=100)
    >>> ParallelConfig(tensor_model_parallel_size=2).data_parallel_size(world_size=4)
    2
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from ppo_core._checks import FieldValueError, check_int, check_positive
from ppo_core._config_base import ConfigBase
from ppo_core.workers.config import ModelSource, PPOActorConfig, PPOCriticConfig

__all__ = [
    "MEGATRON_SHAPE_KEYS",
    "NORMS",
    "MegatronActorConfig",
    "MegatronCriticConfig",
    "MegatronModelConfig",
    "ParallelConfig",
]

Norm = Literal["RMSNorm", "LayerNorm"]
NORMS: tuple[str, ...] = typing.get_args(Norm)
"""Valid values of ``MegatronModelConfig.norm``."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

MEGATRON_SHAPE_KEYS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "max_position_embeddings",
    "rotary_base",
    "norm",
    "norm_epsilon",
    "qkv_bias",
    "tie_word_embeddings",
)
"""The :class:`MegatronModelConfig` fields :func:`~ppo_core.workers.megatron.hf_config.model_config_from_hf` reads
from the checkpoint."""

_PLACEHOLDER_SHAPE = {  # a valid shape that stands in for the checkpoint's until a run resolves the config
    "num_layers": 1,
    "hidden_size": 8,
    "num_attention_heads": 1,
    "ffn_hidden_size": 8,
    "vocab_size": 8,
}


@dataclass(kw_only=True)
class MegatronModelConfig(ConfigBase):
    """Shape and numerics of a decoder-only transformer (Llama / Qwen2 family)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width ``D``."""
    num_attention_heads: int
    """Query heads; ``hidden_size`` must be divisible by it."""
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); None: as many as query heads."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP (each of its gate and up projections)."""
    vocab_size: int
    """Vocabulary size ``V`` (padded by the model to a multiple of ``make_vocab_size_divisible_by * TP``)."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary table is built for."""
    rotary_base: float = 10000.0
    """Rotary embedding base (``rope_theta``: 10000 for Llama 2, 500000 for Llama 3, 1e6 for Qwen2)."""
    norm: Norm = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"``."""
    norm_epsilon: float = 1e-6
    """Epsilon of every normalisation layer."""
    qkv_bias: bool = False
    """Bias on the query/key/value projection (True for Qwen2)."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times TP (padded logits are masked to ``-inf``)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Parameter and activation dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """``"sdpa"``: fused ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient);
    ``"local"``: megatron-core's unfused attention (materialises ``S x S`` scores; CUDA only)."""
    packed_attention: Literal["auto", "varlen", "flex", "sdpa"] = "auto"
    """Attention kernel of padding-free (packed) micro-batches with ``attention="sdpa"``
    (:mod:`ppo_core.kernels.packed_attention`): ``"varlen"`` PyTorch's variable-length FlashAttention (CUDA,
    bf16/fp16), ``"flex"`` FlexAttention with a document mask, ``"sdpa"`` one SDPA call per row; ``"auto"``:
    ``"varlen"`` where it runs, else ``"sdpa"``."""
    fused_kernels: bool = True
    """On CUDA, megatron's ``torch.compile`` fusions of SwiGLU and the residual adds, and linear layers that
    accumulate weight gradients inside their matrix products into the fp32 gradient buffers; False: megatron's
    unfused code for those. (Norms and rotary embeddings are always fused kernels on CUDA; set
    ``TORCHDYNAMO_DISABLE=1`` to run everything eagerly.)"""
    init_method_std: float = 0.02
    """Standard deviation of the random initialisation."""
    seed: int = 1234
    """Seed of megatron's model-parallel RNG (random initialisation)."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "vocab_size",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
        ):
            check_int(name, getattr(self, name), 1)
        if self.num_query_groups is not None:
            check_int("num_query_groups", self.num_query_groups, 1)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(
                    f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups "
                    f"({self.num_query_groups})"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        check_positive("rotary_base", self.rotary_base)
        check_positive("norm_epsilon", self.norm_epsilon)
        check_positive("init_method_std", self.init_method_std)

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.dtype]

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Parameter count of the unpadded model (for FLOP estimates)."""
        d, kv = self.hidden_size, self.kv_heads * self.head_dim
        attn = d * (d + 2 * kv) + d * d + (d + 2 * kv if self.qkv_bias else 0)
        norms = 2 * d if self.norm == "RMSNorm" else 4 * d
        per_layer = attn + 3 * d * self.ffn_hidden_size + norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        emb = self.vocab_size * d if include_embedding else 0
        return self.num_layers * per_layer + d + head + emb

    def check_parallel(self, parallel: ParallelConfig) -> None:
        """Raise ``ValueError`` if the model cannot be split the way ``parallel`` asks."""
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        for name, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.kv_heads),
            ("ffn_hidden_size", self.ffn_hidden_size),
        ):
            if value % tp:
                raise ValueError(f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp})")
        if self.num_layers % pp:
            raise ValueError(
                f"num_layers ({self.num_layers}) must be divisible by pipeline_model_parallel_size ({pp})"
            )
        if parallel.context_parallel_size > 1:
            raise ValueError(
                "context_parallel_size > 1 needs Transformer Engine attention, which this model does not use; "
                f"got context_parallel_size={parallel.context_parallel_size}"
            )

    def transformer_config(self, parallel: ParallelConfig | None = None, **overrides: Any) -> Any:
        """The ``megatron.core`` ``TransformerConfig`` of this model (fusions that need Apex/TE are off; megatron's
        ``torch.compile`` fusions of SwiGLU and the residual add follow ``fused_kernels`` on CUDA)."""
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel = parallel or ParallelConfig()
        self.check_parallel(parallel)
        dtype = self.torch_dtype
        compiled = self.fused_kernels and torch.cuda.is_available()
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            kv_channels=self.head_dim,
            normalization=self.norm,
            layernorm_epsilon=self.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=self.init_method_std,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            pipeline_dtype=dtype,
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            sequence_parallel=parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1,
            # megatron compiles these two with torch.compile; pointless (and slow to build) on the CPU
            bias_activation_fusion=compiled,
            bias_dropout_fusion=compiled,
            # the fusions below need Apex / Transformer Engine, which the "megatron" extra does not install
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            use_cpu_initialization=_weights_on_cpu(),
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)


def _weights_on_cpu() -> bool:
    """Whether megatron builds the weights on the CPU: this process joined its group with gloo (a CPU rank, even on
    a machine with a GPU), or, before joining one, has no GPU."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "nccl" not in str(dist.get_backend())
    return not torch.cuda.is_available()


@dataclass(kw_only=True)
class ParallelConfig(ConfigBase):
    """Tensor / pipeline / context parallel sizes; data parallelism takes the rest of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: ranks sharing each layer's weights (heads and MLP columns split across them)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages (consecutive groups of layers)."""
    context_parallel_size: int = 1
    """CP: ranks sharing one sequence (only 1 is supported by the SDPA attention)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP regions (only used when TP > 1)."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            check_int(name, getattr(self, name), 1)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one replica of the model: ``TP * PP * CP``."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (TP * PP * CP)``; raises ``ValueError`` naming every size if it does not divide.

        Example:
            >>> ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(8)
            2
        """
        world_size = check_int("world_size", world_size, 1)
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"world_size ({world_size}) must be divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) x context_parallel_size ({self.context_parallel_size}) "
                f"= {mp}"
            )
        return world_size // mp


def _default_model() -> MegatronModelConfig:
    return MegatronModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=64
    )


@dataclass(kw_only=True)
class _MegatronFields(ConfigBase):
    """What the megatron workers add to the PPO settings."""

    device: str | None = None
    """Torch device; None picks ``cuda:<local_rank>`` when CUDA is available (megatron's optimizer needs it)."""
    model: MegatronModelConfig = field(default_factory=_default_model)
    """Shape and dtype of the transformer (the default is a toy model for tests)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / CP sizes; DP is the rest of the world size."""
    hf_checkpoint: str | None = None
    """Local folder of Hugging Face safetensors (Llama / Qwen2 names) to initialise from; None: random."""
    use_distributed_optimizer: bool = False
    """Shard the fp32 master weights and Adam moments over the data-parallel ranks (megatron ZeRO-1)."""


_RUN_KEYS = ("hf_checkpoint", "model.dtype", *(f"model.{key}" for key in MEGATRON_SHAPE_KEYS))


def _resolved_fields(config: _MegatronFields, source: ModelSource) -> dict[str, Any]:
    """The fields a run sets: the model shape of ``source.checkpoint``'s ``config.json`` in ``source.dtype`` (the
    config's other ``model`` keys kept), and ``hf_checkpoint``."""
    from transformers import AutoConfig

    from ppo_core.workers.megatron.hf_config import model_config_from_hf

    hf_config = AutoConfig.from_pretrained(source.checkpoint, local_files_only=True)
    kept = {k: v for k, v in config.model.to_dict().items() if f"model.{k}" not in _RUN_KEYS}
    model = model_config_from_hf(hf_config, dtype=source.dtype, **kept)
    return {"model": model, "hf_checkpoint": source.checkpoint}


def _check_data_parallel(config: _MegatronFields, world_size: int) -> int:
    try:
        return config.parallel.data_parallel_size(world_size)
    except ValueError as err:
        raise FieldValueError("parallel", f": {err}") from None


TP_NOT_INVARIANT = (
    "a row-parallel all-reduce sums the ranks' partial products in an order that depends on the message size"
)
"""Why batch-invariant decoding needs tensor-parallel size 1 (the config's and the engine's errors say it)."""


@dataclass(kw_only=True)
class MegatronActorConfig(PPOActorConfig, _MegatronFields):
    """Actor / rollout / reference on megatron-core: the PPO actor's fields plus model and layout.

    ``ppo_mini_batch_size`` counts rows over all dp ranks; ``micro_batch_size`` rows per forward/backward
    (megatron micro-batches; with PP > 1 the local mini-batch must be a multiple of it).
    """

    RUN_KEYS: ClassVar[tuple[str, ...]] = _RUN_KEYS
    """The model shape and dtype (from the checkpoint and the run's dtype) and ``hf_checkpoint``."""

    @classmethod
    def _run_placeholders(cls) -> dict[str, Any]:
        return {"model": _PLACEHOLDER_SHAPE}

    def __post_init__(self) -> None:
        super().__post_init__()
        tp = self.parallel.tensor_model_parallel_size
        if self.rollout.batch_invariant and tp > 1:
            raise FieldValueError(
                "rollout.batch_invariant",
                f"=True needs parallel.tensor_model_parallel_size=1, got {tp}: {TP_NOT_INVARIANT}",
            )

    def resolved(self, source: ModelSource) -> MegatronActorConfig:
        """This config with the model shape of ``source.checkpoint`` in ``source.dtype`` and ``hf_checkpoint``
        set to it."""
        return dataclasses.replace(self, **_resolved_fields(self, source))

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (TP x PP x CP)``; ``ValueError`` (under ``parallel``) when it does not divide."""
        return _check_data_parallel(self, world_size)


@dataclass(kw_only=True)
class MegatronCriticConfig(PPOCriticConfig, _MegatronFields):
    """Critic on megatron-core: the PPO critic's fields plus model, layout and the value head's initialisation."""

    value_head_init_std: float = 0.0
    """Standard deviation of the new value head's weight (0: zeros, every value starts at 0; its bias is 0)."""
    value_head_seed: int = 0
    """Seed of that initialisation (the torch critic draws the same head from the same seed)."""

    RUN_KEYS: ClassVar[tuple[str, ...]] = (*_RUN_KEYS, "value_head_init_std", "value_head_seed")
    """The actor's, plus the value head's initialisation (the run's ``value_head_init_std`` and seed)."""

    @classmethod
    def _run_placeholders(cls) -> dict[str, Any]:
        return {"model": _PLACEHOLDER_SHAPE}

    def resolved(self, source: ModelSource) -> MegatronCriticConfig:
        """As :meth:`MegatronActorConfig.resolved`, and the value head initialised from ``source``
        (``value_head_init_std``, ``seed``) as the torch critic's."""
        return dataclasses.replace(
            self,
            **_resolved_fields(self, source),
            value_head_init_std=source.value_head_init_std,
            value_head_seed=source.seed,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (TP x PP x CP)``; ``ValueError`` (under ``parallel``) when it does not divide."""
        return _check_data_parallel(self, world_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("value_head_init_std", self.value_head_init_std, allow_zero=True)
        check_int("value_head_seed", self.value_head_seed, 0)
