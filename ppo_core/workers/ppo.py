"""The PPO algorithm of the workers, written once for every engine: batch keys, objectives, the update loop,
metrics and checkpoints. Engines (:mod:`ppo_core.workers.engine`) only run the model.

``PPOActorWorker`` (registered methods ``generate_sequences``, ``compute_log_prob``, ``compute_ref_log_prob``,
``update_actor``, ``save_checkpoint``, ``load_checkpoint``) and ``PPOCriticWorker`` (``compute_values``,
``update_critic``, ``save_checkpoint``, ``load_checkpoint``) are built from engines and optimise the objectives
of :mod:`~ppo_core.workers.objectives`:
:class:`~ppo_core.workers.torch.TorchActorWorker` and :class:`~ppo_core.workers.megatron.MegatronActorWorker`
(and their critics) only construct the engines and pass them here.

An update (``update_actor`` / ``update_critic``) is ``ppo_epochs`` passes over the batch; each pass cuts this
rank's rows into mini-batches of ``ppo_mini_batch_size / dp_size`` rows (one optimiser step each), each
mini-batch into micro-batches of ``micro_batch_size`` rows or, with ``ppo_max_token_len_per_gpu``, into the fewest
balanced micro-batches of at most that many valid tokens (one forward/backward each). Losses are aggregated
with the mini-batch's token and row counts summed over all data-parallel ranks (``agg_loss``'s global
denominators), so the micro-batch gradients add up, over micro-batches and ranks, to the gradient of the
mini-batch loss. Metrics are means over optimiser steps of each step's value (losses summed over its
micro-batches, ratios averaged); ``*/skipped_steps`` counts the steps skipped for a non-finite gradient norm
(each one logs a warning) and ``*/zero_grad_steps`` the steps whose gradient norm was exactly 0, in which only
weight decay moves the parameters (one warning per update with the count).

``DP_COMPUTE`` methods return CPU tensors, and ``None`` on ranks that are not their dp group's collect rank.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ppo_core.keys import KEYS
from ppo_core.kl import kl_penalty
from ppo_core.masked import masked_mean
from ppo_core.rollout.engine import RolloutEngine, WeightReceiver
from ppo_core.rollout.layout import check_rollout_output
from ppo_core.workers._common import (
    check_keys,
    global_loss_denominators,
    local_minibatches,
    split_micro_batches,
)
from ppo_core.workers.base import Worker, register
from ppo_core.workers.config import PPOActorConfig, PPOCriticConfig, PPOWorkerConfig
from ppo_core.workers.dispatch import Dispatch
from ppo_core.workers.engine import (
    ENTROPY,
    LOG_PROBS,
    VALUES,
    ForwardEngine,
    OutputSpec,
    StepResult,
    TrainingEngine,
)
from ppo_core.workers.objectives import LossAndMetrics, Objective, actor_loss, critic_loss

__all__ = [
    "ACTOR_UPDATE_KEYS",
    "CRITIC_UPDATE_KEYS",
    "FORWARD_KEYS",
    "GENERATE_KEYS",
    "PPOActorWorker",
    "PPOCriticWorker",
]

logger = logging.getLogger(__name__)

GENERATE_KEYS = (KEYS.input_ids, KEYS.attention_mask)
"""What ``generate_sequences`` reads: the left-padded prompts ``[B, P]`` and their mask."""
FORWARD_KEYS = (KEYS.input_ids, KEYS.attention_mask, KEYS.responses)
"""What ``compute_log_prob`` / ``compute_ref_log_prob`` read."""
ACTOR_UPDATE_KEYS = (*FORWARD_KEYS, KEYS.response_mask, KEYS.old_log_probs, KEYS.advantages)
"""What ``update_actor`` reads (plus ``ref_log_probs`` with the KL loss, and ``rollout_is_weights`` when given)."""
CRITIC_UPDATE_KEYS = (*FORWARD_KEYS, KEYS.response_mask, KEYS.values, KEYS.returns)
"""What ``update_critic`` reads."""


_ZERO_GRAD_HINT = {
    "actor": "are all the advantages 0? (every reward equal and the values 0, e.g. a zero-initialised critic "
    "head with constant rewards, or GRPO groups whose responses all scored the same)",
    "critic": "do the values already equal the returns? (e.g. a zero-initialised value head and all-zero "
    "returns)",
}
"""Why a role's gradient is usually exactly zero, for the zero-gradient warning."""


class PPOWorkerBase(Worker):
    """What the actor and the critic share: generators, mini-batches, the update loop, checkpoints.

    Args:
        config: the worker's settings.
        engine: the trained model.
    """

    role = "worker"
    """Metric prefix (``actor``, ``critic``)."""

    def __init__(self, config: PPOWorkerConfig, engine: TrainingEngine) -> None:
        super().__init__()
        if not isinstance(engine, TrainingEngine):
            raise TypeError(f"engine must implement TrainingEngine, got {type(engine).__name__}")
        self.config = config
        self.engine = engine
        self.set_dp_layout(engine.dp_rank, engine.dp_size, engine.is_collect_rank)
        if config.ppo_mini_batch_size % self.dp_size:
            raise ValueError(
                f"ppo_mini_batch_size ({config.ppo_mini_batch_size}) must be divisible by dp_size ({self.dp_size})"
            )
        # sampling draws on the engine's device; mini-batch shuffling uses a CPU generator. TP/PP peers of one dp
        # rank must draw the same tokens and shuffle the same way: seeded by dp rank.
        self.generator = torch.Generator(device=engine.device).manual_seed(int(config.seed) + self.dp_rank)
        self.shuffle_generator = torch.Generator().manual_seed(int(config.seed) + self.dp_rank)

    # ----- forward passes -----------------------------------------------------------------------------------
    def _forward(
        self, engine: ForwardEngine, batch: TensorDictBase, spec: OutputSpec
    ) -> dict[str, torch.Tensor] | None:
        """Outputs of ``engine`` for the whole batch, concatenated on the device (None off the collect rank)."""
        engine.eval()
        cfg = self.config
        micros, order = split_micro_batches(
            batch, rows=cfg.forward_micro_batch_size, max_tokens=cfg.forward_max_token_len_per_gpu
        )
        outs = engine.forward(micros, spec)
        if not self.is_collect_rank:
            return None
        out = {key: torch.cat([o[key] for o in outs]) for key in outs[0]}
        if order is not None:  # token-budget micro-batches hold the rows out of order: put them back
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            out = {key: value[inverse.to(value.device)] for key, value in out.items()}
        return out

    # ----- updates ------------------------------------------------------------------------------------------
    def _minibatches(self, batch: TensorDictBase) -> Iterator[TensorDictBase]:
        cfg = self.config
        return local_minibatches(
            batch,
            ppo_mini_batch_size=cfg.ppo_mini_batch_size,
            ppo_epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            generator=self.shuffle_generator,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )

    @staticmethod
    def _micro_loss(
        objective: Objective,
        agg: dict[str, Any],
        n_micro: int,
        finite: list[torch.Tensor],
        micro: TensorDictBase,
        outputs: dict[str, torch.Tensor],
    ) -> LossAndMetrics:
        loss, metrics = objective(micro, outputs, agg=agg, n_micro=n_micro)
        finite.append(torch.isfinite(loss.detach()))  # on the device: read only if the step is skipped
        return loss, metrics

    def _update(
        self, batch: TensorDictBase, method: str, objective: Objective, spec: OutputSpec
    ) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batches, one optimiser step each; returns the metrics (see the module)."""
        engine, prefix = self.engine, self.role
        engine.train()
        local_rows = self.config.ppo_mini_batch_size // self.dp_size
        per_epoch = max(1, int(batch.batch_size[0]) // local_rows)  # mini-batches per epoch, for the warnings
        sums: dict[str, list[float]] = defaultdict(list)
        skipped = zero = steps = 0
        for index, mini in enumerate(self._minibatches(batch)):
            agg = global_loss_denominators(
                mini[KEYS.response_mask],
                dp_size=self.dp_size,
                loss_scale_factor=self.config.loss_scale_factor,
                all_reduce_sum=engine.all_reduce_sum,
            )
            micros, _ = split_micro_batches(
                mini, rows=self.config.micro_batch_size, max_tokens=self.config.ppo_max_token_len_per_gpu
            )
            finite: list[torch.Tensor] = []
            loss_fn = functools.partial(self._micro_loss, objective, agg, len(micros), finite)
            outs = engine.forward_backward(micros, loss_fn, spec)
            step = engine.optimizer_step()
            steps += 1
            sums[f"{prefix}/grad_norm"].append(step.grad_norm)
            if step.skipped:
                skipped += 1
                self._warn_skipped(method, *divmod(index, per_epoch), finite, step)
            elif step.grad_norm == 0.0:
                zero += 1
            # the micro-batch metrics are shares of the mini-batch's: they add up
            totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=engine.device))
            for metrics in outs:
                for name, value in metrics.items():
                    totals[name] += value
            for name, value in totals.items():
                sums[name].append(float(value))
        metrics = {name: sum(values) / len(values) for name, values in sums.items()}
        metrics[f"{prefix}/lr"] = engine.lr
        metrics[f"{prefix}/skipped_steps"] = float(skipped)
        metrics[f"{prefix}/zero_grad_steps"] = float(zero)
        if zero:
            # Adam turns any non-zero gradient into a step of about lr, but an exactly zero one into no step at all
            logger.warning(
                "%s: %d of %d optimizer step(s) of the %s had an exactly zero gradient: the loss did not move its "
                "parameters (only weight decay did, if any) (rank %d); %s",
                method,
                zero,
                steps,
                prefix,
                self.rank,
                _ZERO_GRAD_HINT.get(prefix, ""),
            )
        return metrics

    def _warn_skipped(
        self, method: str, epoch: int, mini_batch: int, finite: list[torch.Tensor], step: StepResult
    ) -> None:
        flags = torch.stack(finite).tolist() if finite else []
        bad = [i for i, ok in enumerate(flags) if not ok]
        if not flags:
            where = "no loss on this rank (not the last pipeline stage)"
        elif bad:
            where = f"non-finite loss in micro-batch(es) {bad} of {len(flags)}"
        else:
            where = f"every loss of the {len(flags)} micro-batch(es) is finite"
        logger.warning(
            "%s skipped an optimizer step (rank %d, epoch %d, mini-batch %d): gradient norm %s; %s; first "
            "parameter with a non-finite gradient: %s",
            method,
            self.rank,
            epoch,
            mini_batch,
            step.grad_norm,
            where,
            step.nonfinite_grad,
        )

    # ----- checkpoints --------------------------------------------------------------------------------------
    def _checkpoint_file(self, path: str) -> str:
        return os.path.join(path, f"rank_{self.rank}.pt")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int | None = None) -> None:
        """Write this rank's engine state (model, optimiser) and generators to ``path/rank_<rank>.pt``
        (``step`` is unused). A reference model is not saved: the worker rebuilds it from its construction
        arguments, which must therefore be deterministic (a fixed seed or pretrained weights)."""
        os.makedirs(path, exist_ok=True)
        state = {
            **self.engine.state_dict(),
            "generator": self.generator.get_state(),
            "shuffle_generator": self.shuffle_generator.get_state(),
        }
        torch.save(state, self._checkpoint_file(path))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same layout and world size)."""
        file = self._checkpoint_file(path)
        if not os.path.exists(file):
            raise ValueError(f"no checkpoint for rank {self.rank} at path={path!r} (expected {file})")
        state = torch.load(
            file, map_location=self.engine.device, weights_only=self.engine.checkpoint_weights_only
        )
        self.generator.set_state(state.pop("generator").cpu())
        self.shuffle_generator.set_state(state.pop("shuffle_generator").cpu())
        self.engine.load_state_dict(state)

    def close(self) -> None:
        self.engine.close()


class PPOActorWorker(PPOWorkerBase):
    """The actor, rollout and reference roles over a policy engine, a rollout engine and an optional frozen
    reference engine.

    Args:
        config: a :class:`~ppo_core.workers.config.PPOActorConfig` (or a subclass).
        engine: the policy (``head == "policy"``).
        rollout: samples responses (``generate_sequences``); None: this worker does not generate.
        reference: the frozen reference policy (``compute_ref_log_prob``); None: no reference.
    """

    role = "actor"

    def __init__(
        self,
        config: PPOActorConfig,
        engine: TrainingEngine,
        *,
        rollout: RolloutEngine | None = None,
        reference: ForwardEngine | None = None,
    ) -> None:
        super().__init__(config, engine)
        for name, eng in (("engine", engine), ("reference", reference)):
            if eng is not None and eng.head != "policy":
                raise ValueError(f"the actor's {name} must be a policy engine, got head={eng.head!r}")
        if rollout is not None and not isinstance(rollout, RolloutEngine):
            raise TypeError(f"rollout must implement RolloutEngine, got {type(rollout).__name__}")
        self.config: PPOActorConfig = config
        self.rollout = rollout
        self.reference = reference

    def _temperature(self) -> float:
        """Temperature of every log-prob computation: the sampling one (1 for greedy sampling)."""
        t = self.config.rollout.temperature
        return t if t > 0 else 1.0

    @register(dispatch=Dispatch.DP_COMPUTE, reads=GENERATE_KEYS)
    def generate_sequences(
        self,
        batch: TensorDictBase,
        do_sample: bool = True,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> TensorDict | None:
        """Sample one response per prompt with the rollout engine.

        Args:
            batch: ``input_ids [B, P]`` left-padded prompts and their ``attention_mask [B, P]``.
            do_sample: False decodes greedily (validation), whatever the configured temperature.
            temperature / top_p: override the configured values for this call.

        Returns:
            ``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``response_mask``,
            ``rollout_log_probs`` (batch size ``[B]``).
        """
        check_keys(batch, GENERATE_KEYS, "generate_sequences")
        if self.rollout is None:
            raise ValueError(f"{type(self).__name__} was built without a rollout engine: it cannot generate")
        cfg = self.config.rollout
        if not do_sample:
            temperature = 0.0
        overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        if overrides:
            cfg = type(cfg).from_dict({**cfg.to_dict(), **overrides})
        device = self.engine.device
        prompts = batch[KEYS.input_ids]
        out = self.rollout.generate(
            prompts.to(device),
            batch[KEYS.attention_mask].to(device),
            cfg,
            generator=self.generator,
        )
        out = check_rollout_output(out, prompts.shape[0], cfg.max_new_tokens, type(self.rollout).__name__)
        return out.cpu() if self.is_collect_rank else None

    @register(dispatch=Dispatch.DP_COMPUTE, reads=FORWARD_KEYS)
    def compute_log_prob(self, batch: TensorDictBase) -> TensorDict | None:
        """``old_log_probs [B, R]`` and per-token ``entropies [B, R]`` of the responses under the current policy
        (logits divided by the rollout temperature)."""
        check_keys(batch, FORWARD_KEYS, "compute_log_prob")
        selected = batch.select(*FORWARD_KEYS).to(self.engine.device)
        out = self._forward(self.engine, selected, OutputSpec(temperature=self._temperature(), entropy=True))
        if out is None:
            return None
        return TensorDict(
            {KEYS.old_log_probs: out[LOG_PROBS].cpu(), KEYS.entropies: out[ENTROPY].cpu()},
            batch_size=batch.batch_size,
        )

    @register(dispatch=Dispatch.DP_COMPUTE, reads=FORWARD_KEYS)
    def compute_ref_log_prob(self, batch: TensorDictBase) -> TensorDict | None:
        """``ref_log_probs [B, R]``: log-probs of the responses under the frozen reference policy."""
        if self.reference is None:
            raise ValueError("compute_ref_log_prob needs a reference model; set use_reference=True")
        check_keys(batch, FORWARD_KEYS, "compute_ref_log_prob")
        selected = batch.select(*FORWARD_KEYS).to(self.reference.device)
        out = self._forward(self.reference, selected, OutputSpec(temperature=self._temperature()))
        if out is None:
            return None
        return TensorDict({KEYS.ref_log_probs: out[LOG_PROBS].cpu()}, batch_size=batch.batch_size)

    @register(
        dispatch=Dispatch.DP_COMPUTE_METRIC,
        reads=ACTOR_UPDATE_KEYS,
        may_read=(KEYS.ref_log_probs, KEYS.rollout_is_weights),
    )
    def update_actor(self, batch: TensorDictBase) -> dict[str, float]:
        """PPO policy update (see the module docstring for the loop and the loss denominators).

        Args:
            batch: ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``, ``old_log_probs``,
                ``advantages`` (and ``ref_log_probs`` when ``use_kl_loss``; ``rollout_is_weights``, when present,
                multiply the per-token policy loss). The ``response_mask`` decides every loss term and the global
                token counts: the trainer passes it with the rollout correction's rejected tokens removed.

        Returns:
            Means over optimiser steps: ``actor/pg_loss`` and the policy loss's metrics (``actor/pg_clipfrac``,
            ``actor/ppo_kl``...), ``actor/update_entropy`` (when ``entropy_coeff > 0``), ``actor/kl_loss`` (with
            the KL loss), ``actor/grad_norm``; ``actor/lr``, ``actor/skipped_steps``, ``actor/zero_grad_steps``, and
            ``actor/ref_kl`` (mean
            ``old_log_probs - ref_log_probs`` over valid tokens) when the batch has ``ref_log_probs``.
        """
        cfg = self.config
        check_keys(batch, (*ACTOR_UPDATE_KEYS, KEYS.ref_log_probs) if cfg.use_kl_loss else ACTOR_UPDATE_KEYS,
                   "update_actor")  # fmt: skip
        has_ref = KEYS.ref_log_probs in batch
        optional = [key for key in (KEYS.ref_log_probs, KEYS.rollout_is_weights) if key in batch]
        batch = batch.select(*ACTOR_UPDATE_KEYS, *optional).to(self.engine.device)
        spec = OutputSpec(temperature=self._temperature(), entropy=bool(cfg.entropy_coeff))
        metrics = self._update(batch, "update_actor", functools.partial(actor_loss, config=cfg), spec)
        if has_ref:
            # k1 estimate of KL(pi_old || pi_ref) over this rank's valid tokens: how far training has drifted
            k1 = kl_penalty(batch[KEYS.old_log_probs], batch[KEYS.ref_log_probs], "kl")
            metrics["actor/ref_kl"] = float(masked_mean(k1, batch[KEYS.response_mask]))
        if isinstance(self.rollout, WeightReceiver):
            self.rollout.update_weights(self.engine.named_parameters())
        return metrics


class PPOCriticWorker(PPOWorkerBase):
    """The critic role over a value engine.

    Args:
        config: a :class:`~ppo_core.workers.config.PPOCriticConfig` (or a subclass).
        engine: the value model (``head == "value"``).
    """

    role = "critic"

    def __init__(self, config: PPOCriticConfig, engine: TrainingEngine) -> None:
        super().__init__(config, engine)
        if engine.head != "value":
            raise ValueError(f"the critic's engine must be a value engine, got head={engine.head!r}")
        self.config: PPOCriticConfig = config

    @register(dispatch=Dispatch.DP_COMPUTE, reads=(*FORWARD_KEYS, KEYS.response_mask))
    def compute_values(self, batch: TensorDictBase) -> TensorDict | None:
        """``values [B, R]`` of the response tokens (0 where ``response_mask`` is 0, as in verl)."""
        keys = (*FORWARD_KEYS, KEYS.response_mask)
        check_keys(batch, keys, "compute_values")
        selected = batch.select(*keys).to(self.engine.device)
        out = self._forward(self.engine, selected, OutputSpec())
        if out is None:
            return None
        values = out[VALUES] * selected[KEYS.response_mask]
        return TensorDict({KEYS.values: values.cpu()}, batch_size=batch.batch_size)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, reads=CRITIC_UPDATE_KEYS)
    def update_critic(self, batch: TensorDictBase) -> dict[str, float]:
        """Fit the values to ``returns`` with the clipped value loss (the loop of the module docstring).

        Args:
            batch: ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``, ``values`` (rollout-time),
                ``returns``.

        Returns:
            Means over optimiser steps: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
            ``critic/grad_norm``; ``critic/lr``, ``critic/skipped_steps``, ``critic/zero_grad_steps``.
        """
        check_keys(batch, CRITIC_UPDATE_KEYS, "update_critic")
        batch = batch.select(*CRITIC_UPDATE_KEYS).to(self.engine.device)
        objective = functools.partial(critic_loss, config=self.config)
        return self._update(batch, "update_critic", objective, OutputSpec())
