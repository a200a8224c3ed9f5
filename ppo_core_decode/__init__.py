"""The KV-cached, graph-captured decode engine behind ppo-core's fast rollout engines.

What is here (one module per concept):

- :mod:`~ppo_core_decode.decoding`: :class:`~ppo_core_decode.decoding.StaticCacheDecoder` (prefill, decode steps
  captured as CUDA graphs, sampling, stop checks) and :class:`~ppo_core_decode.decoding.CachedRolloutEngine`, the
  rollout-engine protocol over it;
- :mod:`~ppo_core_decode.kv_cache`: the static KV cache (per-row positions, cache writes, attention through it);
- :mod:`~ppo_core_decode.graph_inputs`: the addresses a captured decode step reads, compared between two generations
  before one replays the other's graphs;
- :mod:`~ppo_core_decode.decoder_loop`: the layer loop both model forwards share (residual adds fused with the next
  norm or with the products);
- :mod:`~ppo_core_decode.hf`: :class:`~ppo_core_decode.hf.HFRolloutEngine`, Hugging Face causal LMs;
- :mod:`~ppo_core_decode.config`: the engines' typed settings (:class:`~ppo_core_decode.config.HFEngineConfig`, the
  decoder's shared :class:`~ppo_core_decode.config.CachedEngineConfig`), checked once, building their engine;
- :mod:`~ppo_core_decode.megatron`: :class:`~ppo_core_decode.megatron.MegatronDecodeForward`, megatron-core
  ``GPTModel`` s evaluated from their weights (the engine that wires it in is
  :class:`ppo_core.workers.megatron.rollout.MegatronRolloutEngine`);
- fused Triton kernels of a decode step: :mod:`~ppo_core_decode.decode_linear`,
  :mod:`~ppo_core_decode.decode_attention`, :mod:`~ppo_core_decode.decode_rotary`,
  :mod:`~ppo_core_decode.decode_rotary_attention`, :mod:`~ppo_core_decode.fused_sampling`,
  :mod:`~ppo_core_decode.step_inputs`, with :mod:`~ppo_core_decode.pdl` and :mod:`~ppo_core_decode.split_launch`;
- numerics: :mod:`~ppo_core_decode.batch_invariant` (row-independent GEMMs, norms and attention),
  :mod:`~ppo_core_decode.eager_rounding` (element-wise steps rounded as the model's own forward rounds them) and
  :mod:`~ppo_core_decode.elementwise_launch` (its norms and SwiGLU as plain Triton launches, the engines' on CUDA);
- :mod:`~ppo_core_decode.sequence_log_probs`: the log-probs a batch-invariant rollout recorded, recomputed for whole
  sequences bit for bit (the torch actor's exact on-policy mode).

Import rule: this package imports torch, triton, the model libraries (``transformers``, ``megatron.core``, inside
the functions that need them), ppo-core's core math (``ppo_core.kernels``, ``ppo_core._checks``,
``ppo_core.keys``) and the leaf modules of :mod:`ppo_core.rollout` (``sampling``, ``layout``, ``prompt_checks``,
``registry``, ``engine_config``); never ``ppo_core.workers``, ``ppo_core.trainer`` or ``ppo_core.backends``.
``ppo_core`` imports it only inside functions (the registry's ``hf`` config class, the CUDA sampling path) and in
the megatron worker.

Choosing an engine is not done here: :mod:`ppo_core.rollout.registry` names the engines (``hf`` is
:class:`~ppo_core_decode.config.HFEngineConfig`, the settings of :class:`~ppo_core_decode.hf.HFRolloutEngine`,
which builds it).
"""
