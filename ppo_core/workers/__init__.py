"""Workers: the backend protocol (``Worker``, ``@register`` dispatch modes, the ``WorkerGroup`` a trainer drives) and
the PPO workers, written once over pluggable engines.

Layout: :mod:`~ppo_core.workers.base`, :mod:`~ppo_core.workers.dispatch`, :mod:`~ppo_core.workers.group` (the
protocol); :mod:`~ppo_core.workers.ppo` (the PPO algorithm: ``PPOActorWorker``, ``PPOCriticWorker``) and
:mod:`~ppo_core.workers.objectives` (``actor_loss``, ``critic_loss``),
:mod:`~ppo_core.workers.engine` (the training-engine protocol it calls), :mod:`~ppo_core.workers.config` (their
configs); engines in :mod:`ppo_core.workers.torch` and :mod:`ppo_core.workers.megatron`; sampling behind the
rollout-engine protocol of :mod:`ppo_core.rollout`.

Worker methods ``BasePPOTrainer`` calls (full contract in ``docs/backends.md``). Batches are ``TensorDict`` with
``batch_size=[B]`` and the keys of :data:`ppo_core.keys.KEYS`; ``P`` = prompt width (left-padded), ``R`` = response
width (right-padded).

Actor group (``actor_wg``; rollout and actor in one worker):

- ``generate_sequences(batch, do_sample=True) -> TensorDict`` (``DP_COMPUTE``). In: ``input_ids`` [B, P],
  ``attention_mask`` [B, P] (the prompt, already repeated ``n`` times). Out: ``prompts`` [B, P],
  ``responses`` [B, R], ``input_ids`` [B, P+R], ``attention_mask`` [B, P+R], ``response_mask`` [B, R], and
  optionally ``rollout_log_probs`` [B, R]. ``do_sample=False`` is greedy decoding (validation). Sampling draws
  from a generator the worker owns and checkpoints, so that a resumed run samples the same tokens.
- ``compute_log_prob(batch) -> TensorDict`` (``DP_COMPUTE``): ``old_log_probs`` [B, R] and optionally
  ``entropies`` [B, R].
- ``update_actor(batch) -> dict[str, float]`` (``DP_COMPUTE_METRIC``): one PPO update (epochs of mini-batches)
  from ``responses``, ``input_ids``, ``attention_mask``, ``response_mask``, ``old_log_probs``,
  ``advantages`` (and ``ref_log_probs`` when the KL loss is on); returns ``actor/*`` metrics.

Reference group (``ref_wg``): ``compute_ref_log_prob(batch) -> TensorDict`` (``DP_COMPUTE``): ``ref_log_probs``
[B, R].

Critic group (``critic_wg``): ``compute_values(batch) -> TensorDict`` (``DP_COMPUTE``): ``values`` [B, R];
``update_critic(batch) -> dict[str, float]`` (``DP_COMPUTE_METRIC``) from ``values``, ``returns``,
``response_mask``; returns ``critic/*`` metrics.

Every group: ``save_checkpoint(path: str, step: int) -> None`` and ``load_checkpoint(path: str) -> None``
(``ONE_TO_ALL``): each rank saves/loads what it owns (model, optimizer, scheduler, sampling generator) under
``path``, which is distinct per role.
"""

from __future__ import annotations

from ppo_core.workers.base import (
    ColocatedWorker,
    Registration,
    Worker,
    WorkerContext,
    WorkerSpec,
    current_worker_context,
    get_registration,
    register,
    registered_methods,
    resolve_method,
    worker_context,
)
from ppo_core.workers.config import OptimConfig, PPOActorConfig, PPOCriticConfig
from ppo_core.workers.dispatch import (
    Dispatch,
    DispatchMode,
    DispatchPlan,
    DPLayout,
    Execute,
    RankCall,
    WorkerLayout,
    resolve_dispatch,
)
from ppo_core.workers.engine import ForwardEngine, StepResult, TrainingEngine
from ppo_core.workers.errors import (
    BlockingWaitInEventLoopError,
    CallTimeoutError,
    GroupBrokenError,
    RankLocation,
    WorkerGroupError,
    WorkerLostError,
)
from ppo_core.workers.group import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_FAILURE_GRACE_S,
    CompletedCall,
    FuturesCall,
    GroupResult,
    PendingCall,
    WorkerCallError,
    WorkerGroup,
)
from ppo_core.workers.ppo import PPOActorWorker, PPOCriticWorker
from ppo_core.workers.resident import (
    BatchRef,
    KeySpec,
    Placement,
    ResidentBatchMissingError,
    ResidentStore,
    dp_row_ranges,
)
from ppo_core.workers.traffic import TrafficCounter, payload_nbytes

#: Method names ``BasePPOTrainer`` calls on its groups, by role.
TRAINER_METHODS: dict[str, tuple[str, ...]] = {
    "actor": ("generate_sequences", "compute_log_prob", "update_actor", "save_checkpoint", "load_checkpoint"),
    "ref": ("compute_ref_log_prob",),
    "critic": ("compute_values", "update_critic", "save_checkpoint", "load_checkpoint"),
}

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_FAILURE_GRACE_S",
    "TRAINER_METHODS",
    "BatchRef",
    "BlockingWaitInEventLoopError",
    "CallTimeoutError",
    "ColocatedWorker",
    "CompletedCall",
    "DPLayout",
    "Dispatch",
    "DispatchMode",
    "DispatchPlan",
    "Execute",
    "ForwardEngine",
    "FuturesCall",
    "GroupBrokenError",
    "GroupResult",
    "KeySpec",
    "OptimConfig",
    "PPOActorConfig",
    "PPOActorWorker",
    "PPOCriticConfig",
    "PPOCriticWorker",
    "PendingCall",
    "Placement",
    "RankCall",
    "RankLocation",
    "Registration",
    "ResidentBatchMissingError",
    "ResidentStore",
    "StepResult",
    "TrafficCounter",
    "TrainingEngine",
    "Worker",
    "WorkerCallError",
    "WorkerContext",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerLayout",
    "WorkerLostError",
    "WorkerSpec",
    "current_worker_context",
    "dp_row_ranges",
    "get_registration",
    "payload_nbytes",
    "register",
    "registered_methods",
    "resolve_dispatch",
    "resolve_method",
    "worker_context",
]
