"""Rollout: sampling responses from the policy, behind a small engine protocol.

- :class:`SamplingConfig`, :func:`sample_tokens` (the Gumbel-max draw every decoding path shares),
  :func:`top_k_filter`, :func:`top_p_filter`, :func:`sample_from_logits`, :func:`sampling_log_probs`: the
  per-step sampling rule (:mod:`~ppo_core.rollout.sampling`);
- :func:`generate`: batched sampling from any causal LM ``nn.Module`` (:mod:`~ppo_core.rollout.generate`);
- :func:`rollout_batch`: the output layout of every rollout engine (:mod:`~ppo_core.rollout.layout`);
- :func:`~ppo_core.rollout.prompt_checks.check_prompts`: the prompt checks every decoding path runs first (names
  the bad argument; left-pads right-padded prompts) (:mod:`~ppo_core.rollout.prompt_checks`);
- :class:`RolloutEngine`: what an actor worker calls to sample, and :class:`ModelRolloutEngine`, its in-process
  implementation over :func:`generate` (:mod:`~ppo_core.rollout.engine`);
- :class:`RolloutEngineConfig`: an engine's typed settings, checked once, whose ``build(model, sampling)`` returns
  the engine (:mod:`~ppo_core.rollout.engine_config`);
- :func:`register_rollout_engine`, :func:`rollout_engine_config`, :func:`rollout_engine_names`,
  :func:`resolve_engine`, :func:`auto_engine_name`: engine config classes by name (:mod:`~ppo_core.rollout.registry`).
  The KV-cached, graph-captured engine itself is the package :mod:`ppo_core_decode`.

Which engine runs for my model: the one ``rollout.engine`` names (``SamplingConfig(engine=...)`` for
:func:`generate`), with the settings of ``rollout.engine_config``. The default ``auto`` is
:func:`auto_engine_name`: ``hf`` (:class:`~ppo_core_decode.hf.HFRolloutEngine`: static KV cache, CUDA graphs on a
GPU, fused kernels for the Llama family, batch-invariant numerics on request) for a Hugging Face causal LM;
``megatron`` (:class:`~ppo_core.workers.megatron.rollout.MegatronRolloutEngine`) in the megatron actor where its
model allows (SDPA attention, no pipeline or sequence parallelism); ``reference`` (:class:`ModelRolloutEngine`,
the simple loop of :func:`generate`: full recomputation, or the model's own ``new_cache()``) otherwise, and with
``use_cache=False``. A worker builds its engine once and reuses it every step; :func:`generate` keeps the engine it
built for a model (on the model) and reuses it on the next call.

Plugging in your own engine (vLLM, SGLang, ...): write a class with

- ``generate(prompts [B, P], prompt_mask [B, P], config, *, generator) -> TensorDict`` returning ``prompts``,
  ``responses``, ``input_ids``, ``attention_mask``, ``response_mask`` and ``rollout_log_probs`` (the exact
  contract is the docstring of :class:`RolloutEngine`): translate the left-padded prompts into the engine's
  requests (strip the padding with ``prompt_mask``), map ``config`` to its sampling parameters (``temperature``,
  ``top_p``, ``max_new_tokens``, stop at ``eos_token_id``), seed it from ``generator`` so that a resumed run
  samples the same tokens, ask it for the log-prob of every sampled token, pad the answers back to ``[B, R]``
  with ``config.pad_token_id`` and assemble the output with :func:`rollout_batch`;
- ``update_weights(named_tensors)`` (:class:`WeightReceiver`) if the engine holds its own copy of the weights:
  the actor calls it after each ``update_actor`` with the training engine's ``named_parameters()`` (this rank's
  shard, under the training engine's names; megatron names convert with
  :func:`ppo_core.workers.megatron.megatron_to_hf`).

then register its config class (its settings, checked once, and ``build``) under a name, in a module your entry
point imports, and name it in the config::

    @register_rollout_engine("vllm")
    @dataclass(kw_only=True)
    class VLLMEngineConfig(RolloutEngineConfig):
        gpu_memory_utilization: float = 0.5
        \"\"\"Fraction of the GPU's memory the engine may take.\"\"\"

        def build(self, model, sampling):  # model: the actor's policy module; sampling: its SamplingConfig
            return MyVLLMEngine(model, self, sampling)

    # rollout.engine: vllm
    # rollout.engine_config: {gpu_memory_utilization: 0.8}   (checked when the config is built)

(or pass ``rollout_engine=factory``, ``factory(policy) -> RolloutEngine``, to ``TorchActorWorker`` /
``MegatronActorWorker``). No adapter for an external engine ships with ppo-core.

Example:
    >>> import torch
    >>> from ppo_core.models import TinyGPT, TinyGPTConfig
    >>> lm = TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2))
    >>> out = generate(lm, torch.tensor([[1, 2]]), torch.ones(1, 2), SamplingConfig(max_new_tokens=2, temperature=0))
    >>> sorted(out.keys())
    ['attention_mask', 'input_ids', 'prompts', 'response_mask', 'responses', 'rollout_log_probs']
"""

from __future__ import annotations

from ppo_core.rollout.engine import ModelRolloutEngine, RolloutEngine, WeightReceiver
from ppo_core.rollout.engine_config import ReferenceEngineConfig, RolloutEngineConfig
from ppo_core.rollout.generate import generate
from ppo_core.rollout.layout import rollout_batch
from ppo_core.rollout.registry import (
    auto_engine_name,
    get_rollout_engine,
    register_rollout_engine,
    resolve_engine,
    rollout_engine_config,
    rollout_engine_names,
)
from ppo_core.rollout.sampling import (
    SamplingConfig,
    logits_of,
    sample_from_logits,
    sample_tokens,
    sampling_log_probs,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "ModelRolloutEngine",
    "ReferenceEngineConfig",
    "RolloutEngine",
    "RolloutEngineConfig",
    "SamplingConfig",
    "WeightReceiver",
    "auto_engine_name",
    "generate",
    "get_rollout_engine",
    "logits_of",
    "register_rollout_engine",
    "resolve_engine",
    "rollout_batch",
    "rollout_engine_config",
    "rollout_engine_names",
    "sample_from_logits",
    "sample_tokens",
    "sampling_log_probs",
    "top_k_filter",
    "top_p_filter",
]
