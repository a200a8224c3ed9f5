"""The PPO worker algorithm (``ppo_core.workers.ppo``) against a fake engine: a float64 bigram table.

Checked once here for every engine: micro-batch and data-parallel invariance of the gradient (every
``loss_agg_mode``, 1 and 2 simulated dp ranks), the exact metric names, checkpoint round trips that resume
bit-identically, the skipped-step warning and metric, the rollout engine's weight hook, argument errors.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ppo_core.keys import KEYS
from ppo_core.kl import kl_penalty
from ppo_core.losses import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
)
from ppo_core.rollout import RolloutEngine, SamplingConfig, rollout_batch
from ppo_core.workers import (
    ForwardEngine,
    PPOActorConfig,
    PPOActorWorker,
    PPOCriticConfig,
    PPOCriticWorker,
    StepResult,
    TrainingEngine,
    worker_context,
)
from ppo_core.workers.config import OptimConfig
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES, EngineBase, LossFn, OutputSpec

V, P, R = 5, 2, 3
CPU = torch.device("cpu")


class Bigram(nn.Module):
    """``out[b, s] = table[input_ids[b, s]]``: logits ``[.., V]`` (policy) or one value ``[.., 1]``."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(V, width, generator=g, dtype=torch.float64))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]


class ThreadGroup:
    """An all-reduce over ranks that are threads of this process (sums in rank order: identical on every rank)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size

    def all_reduce_sum(self, rank: int, value: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = value.clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total = total + other
        self.barrier.wait()
        return total


def _outputs(
    out: torch.Tensor, micro: TensorDictBase, head: str, spec: OutputSpec
) -> dict[str, torch.Tensor]:
    """Per-token outputs at the response positions: position ``t`` is read at ``P + t - 1``."""
    out = out[:, -micro[KEYS.responses].shape[1] - 1 : -1]
    if head == "value":
        return {VALUES: out[..., 0]}
    log_p = (out / spec.temperature).log_softmax(-1)
    outputs = {LOG_PROBS: log_p.gather(-1, micro[KEYS.responses][..., None])[..., 0]}
    if spec.entropy:
        outputs[ENTROPY] = -(log_p.exp() * log_p).sum(-1)
    return outputs


class BigramEngine(EngineBase):
    """A training engine for the protocol tests: Adam on a :class:`Bigram`, data parallelism over a
    :class:`ThreadGroup` (gradients averaged at the step, like DDP), every applied gradient recorded."""

    def __init__(
        self,
        head: str = "policy",
        *,
        seed: int = 0,
        trainable: bool = True,
        group: ThreadGroup | None = None,
        rank: int = 0,
        collect: bool = True,
        lr: float = 0.05,
    ) -> None:
        module = Bigram(V if head == "policy" else 1, seed)
        optim = OptimConfig(lr=lr, grad_clip=None) if trainable else None
        optimizer = torch.optim.Adam(module.parameters(), lr=lr) if trainable else None
        super().__init__(module, module, head=head, device=CPU, optim=optim, optimizer=optimizer)
        self.group, self.dp_rank = group, rank
        self.dp_size = 1 if group is None else group.size
        self.is_collect_rank = collect
        self.applied: list[list[torch.Tensor]] = []
        self.forward_calls = 0

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value if self.group is None else self.group.all_reduce_sum(self.dp_rank, value)

    @torch.no_grad()
    def forward(self, micros: Sequence[TensorDictBase], spec: OutputSpec) -> list[dict[str, torch.Tensor]]:
        self.forward_calls += 1
        return [_outputs(self.module(m[KEYS.input_ids]), m, self.head, spec) for m in micros]

    def forward_backward(
        self, micros: Sequence[TensorDictBase], loss_fn: LossFn, spec: OutputSpec
    ) -> list[dict[str, torch.Tensor]]:
        results = []
        for micro in micros:
            loss, metrics = loss_fn(
                micro, _outputs(self.module(micro[KEYS.input_ids]), micro, self.head, spec)
            )
            loss.backward()
            results.append(metrics)
        return results

    def optimizer_step(self) -> StepResult:
        grads = []
        for p in self.module.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = self.all_reduce_sum(g) / self.dp_size
            grads.append(p.grad)
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        self.applied.append([g.clone() for g in grads])
        bad = None
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            bad = next(n for n, p in self.module.named_parameters() if not torch.isfinite(p.grad).all())
        self.zero_grad()
        return StepResult(grad_norm=norm, nonfinite_grad=bad)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class Sampler:
    """A rollout engine that draws uniform tokens from the worker's generator and records weight updates."""

    def __init__(self) -> None:
        self.received: list[dict[str, torch.Tensor]] = []

    def generate(
        self, prompts: torch.Tensor, prompt_mask: torch.Tensor, config: SamplingConfig, *, generator: Any
    ) -> TensorDict:
        b, r = prompts.shape[0], config.max_new_tokens
        if config.temperature == 0:
            responses = torch.zeros(b, r, dtype=torch.long)
        else:
            responses = torch.randint(0, V, (b, r), generator=generator)
        log_probs = torch.full((b, r), -math.log(V), dtype=torch.float64)
        return rollout_batch(prompts, prompt_mask, responses, torch.ones(b, r, dtype=torch.long), log_probs)

    def update_weights(self, named_tensors: Any) -> None:
        self.received.append({name: t.detach().clone() for name, t in named_tensors})


def _batch(rows: int, seed: int = 0) -> TensorDict:
    """A scored batch: random tokens, a masked tail per row, an all-masked row, old/ref log-probs near the
    engine's, advantages, values, returns (all float64)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, P + R), generator=g)
    lengths = torch.randint(1, R + 1, (rows,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    if rows > 1:
        mask[1] = 0
    noise = lambda: 0.3 * torch.randn(rows, R, generator=g, dtype=torch.float64)  # noqa: E731
    log_p = _outputs(
        Bigram(V, 0)(ids), TensorDict({KEYS.responses: ids[:, P:]}, [rows]), "policy", OutputSpec()
    )
    return TensorDict(
        {
            KEYS.prompts: ids[:, :P],
            KEYS.responses: ids[:, P:],
            KEYS.input_ids: ids,
            KEYS.attention_mask: torch.ones(rows, P + R, dtype=torch.long),
            KEYS.response_mask: mask,
            KEYS.old_log_probs: log_p[LOG_PROBS].detach() + noise(),
            KEYS.ref_log_probs: log_p[LOG_PROBS].detach() + noise(),
            KEYS.advantages: torch.randn(rows, R, generator=g, dtype=torch.float64),
            KEYS.values: noise(),
            KEYS.returns: torch.randn(rows, R, generator=g, dtype=torch.float64),
        },
        batch_size=[rows],
    )


def _actor(config: dict, engine: BigramEngine | None = None, **kwargs: Any) -> PPOActorWorker:
    cfg = PPOActorConfig.from_dict({"ppo_mini_batch_size": 4, "optim": {"grad_clip": None}, **config})
    return PPOActorWorker(cfg, engine or BigramEngine(), **kwargs)


def _critic(config: dict, engine: BigramEngine | None = None) -> PPOCriticWorker:
    cfg = PPOCriticConfig.from_dict({"ppo_mini_batch_size": 4, **config})
    return PPOCriticWorker(cfg, engine or BigramEngine("value"))


# -------------------------------------------------------------------------------- micro-batch / dp invariance
def _mini_batch_actor_grad(batch: TensorDict, cfg: PPOActorConfig) -> torch.Tensor:
    """Gradient of the whole mini-batch's actor loss, written from the loss primitives: one forward, the
    mini-batch's own token and row counts as denominators."""
    model = Bigram(V, 0)
    out = _outputs(model(batch[KEYS.input_ids]), batch, "policy", OutputSpec(entropy=True))
    mask, mode = batch[KEYS.response_mask], cfg.policy_loss.loss_agg_mode
    agg = {
        "batch_num_tokens": mask.sum(),
        "global_batch_size": float(mask.shape[0]),
        "loss_scale_factor": cfg.loss_scale_factor,
    }
    loss, _ = compute_policy_loss(
        batch[KEYS.old_log_probs], out[LOG_PROBS], batch[KEYS.advantages], mask, config=cfg.policy_loss, **agg
    )
    loss = loss - cfg.entropy_coeff * agg_loss(out[ENTROPY], mask, mode, **agg)
    kl = kl_penalty(out[LOG_PROBS], batch[KEYS.ref_log_probs], cfg.kl_loss_type)
    loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, mode, **agg)
    loss.backward()
    return model.table.grad


def _run_ranks(workers: list, method: str, shards: list[TensorDict]) -> list[dict[str, float]]:
    """Call ``method`` on every worker at once, one thread per simulated dp rank."""
    results: list[Any] = [None] * len(workers)
    errors: list[BaseException] = []

    def call(rank: int) -> None:
        try:
            results[rank] = getattr(workers[rank], method)(shards[rank])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(r,)) for r in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@settings(max_examples=6)
@given(micro=st.sampled_from([None, 1, 3]), seed=st.integers(0, 1000))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp", [1, 2])
def test_micro_batch_and_dp_gradients_add_up_to_the_mini_batch_gradient(
    mode: str, dp: int, micro: int | None, seed: int
) -> None:
    config = {
        "ppo_mini_batch_size": 8,
        "micro_batch_size": micro,
        "entropy_coeff": 0.03,
        "use_kl_loss": True,
        "kl_loss_coef": 0.2,
        "loss_scale_factor": float(R) if mode == "seq-mean-token-sum-norm" else None,
        "policy_loss": {"loss_agg_mode": mode},
        "optim": {"grad_clip": None},
    }
    batch = _batch(8, seed)
    expected = _mini_batch_actor_grad(batch, PPOActorConfig.from_dict(config))
    group = ThreadGroup(dp) if dp > 1 else None
    workers = []
    for rank in range(dp):
        with worker_context(rank=rank, world_size=dp):
            workers.append(_actor(config, BigramEngine(group=group, rank=rank)))
    shards = [batch[rank * 8 // dp : (rank + 1) * 8 // dp] for rank in range(dp)]
    _run_ranks(workers, "update_actor", shards)
    for worker in workers:
        (applied,) = worker.engine.applied  # one mini-batch: one optimiser step
        torch.testing.assert_close(applied[0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("micro", [None, 1, 3])
def test_critic_micro_batch_gradients_add_up(micro: int | None) -> None:
    batch = _batch(6, seed=3)
    critic = _critic({"ppo_mini_batch_size": 6, "micro_batch_size": micro, "optim": {"grad_clip": None}})
    critic.update_critic(batch)
    model = Bigram(1, 0)
    vpreds = model(batch[KEYS.input_ids])[:, P - 1 : -1, 0]
    mask = batch[KEYS.response_mask]
    loss, _ = compute_value_loss(
        vpreds, batch[KEYS.returns], batch[KEYS.values], mask, 0.5, "token-mean", global_batch_size=6.0
    )
    loss.backward()
    torch.testing.assert_close(critic.engine.applied[0][0], model.table.grad, rtol=1e-10, atol=1e-12)


# -------------------------------------------------------------------------------- metric names
def _policy_metric_names(loss_mode: str = "vanilla") -> set[str]:
    b = _batch(2)
    cfg = PolicyLossConfig(loss_mode=loss_mode)
    _, metrics = compute_policy_loss(
        b[KEYS.old_log_probs], b[KEYS.old_log_probs], b[KEYS.advantages], b[KEYS.response_mask], config=cfg
    )
    return {f"actor/{name}" for name in metrics}


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
@pytest.mark.parametrize(("use_kl_loss", "with_ref"), [(False, False), (False, True), (True, True)])
def test_actor_metric_names(entropy_coeff: float, use_kl_loss: bool, with_ref: bool) -> None:
    batch = _batch(4)
    if not with_ref:
        batch = batch.exclude(KEYS.ref_log_probs)
    actor = _actor({"entropy_coeff": entropy_coeff, "use_kl_loss": use_kl_loss})
    expected = {
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/skipped_steps",
        "actor/zero_grad_steps",
    } | _policy_metric_names()
    expected |= {"actor/update_entropy"} if entropy_coeff else set()
    expected |= {"actor/kl_loss"} if use_kl_loss else set()
    expected |= {"actor/ref_kl"} if with_ref else set()
    metrics = actor.update_actor(batch)
    assert set(metrics) == expected
    assert metrics["actor/skipped_steps"] == 0.0 and metrics["actor/lr"] == 0.05
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_critic_metric_names_and_outputs() -> None:
    critic = _critic({})
    batch = _batch(4)
    assert set(critic.update_critic(batch)) == {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/skipped_steps",
        "critic/zero_grad_steps",
    }
    out = critic.compute_values(batch)
    assert set(out.keys()) == {KEYS.values}
    assert torch.equal(
        out[KEYS.values][batch[KEYS.response_mask] == 0],
        torch.zeros(int((batch[KEYS.response_mask] == 0).sum()), dtype=torch.float64),
    )


def test_scoring_outputs_and_temperature() -> None:
    actor = _actor({"rollout": {"temperature": 0.5}}, reference=BigramEngine(trainable=False, seed=1))
    batch = _batch(5)
    out = actor.compute_log_prob(batch)
    assert set(out.keys()) == {KEYS.old_log_probs, KEYS.entropies}
    logits = Bigram(V, 0)(batch[KEYS.input_ids])[:, P - 1 : -1] / 0.5
    want = logits.log_softmax(-1).gather(-1, batch[KEYS.responses][..., None])[..., 0]
    torch.testing.assert_close(out[KEYS.old_log_probs], want, rtol=0, atol=1e-12)
    assert (out[KEYS.entropies] >= 0).all()
    ref = actor.compute_ref_log_prob(batch)
    assert set(ref.keys()) == {KEYS.ref_log_probs}
    assert not torch.allclose(ref[KEYS.ref_log_probs], out[KEYS.old_log_probs])  # another model (seed 1)


def test_non_collect_ranks_return_none() -> None:
    actor = _actor({}, BigramEngine(collect=False), rollout=Sampler())
    critic = _critic({}, BigramEngine("value", collect=False))
    batch = _batch(4)
    assert actor.compute_log_prob(batch) is None
    assert critic.compute_values(batch) is None
    assert actor.generate_sequences(batch.select(KEYS.input_ids, KEYS.attention_mask)) is None


# -------------------------------------------------------------------------------- checkpoints
def _resume_pair(tmp_path: Any, make: Any, method: str) -> None:
    """``make()`` twice: one worker updates, saves, updates again; a fresh one loads and updates: same result."""
    batch = _batch(8, seed=5)
    first = make()
    getattr(first, method)(batch)
    first.save_checkpoint(str(tmp_path), step=1)
    want = getattr(first, method)(batch)
    resumed = make()
    resumed.load_checkpoint(str(tmp_path))
    assert getattr(resumed, method)(batch) == want
    for a, b in zip(first.engine.module.parameters(), resumed.engine.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(first.shuffle_generator.get_state(), resumed.shuffle_generator.get_state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0.pt"]


def test_actor_checkpoint_resumes_bit_identically(tmp_path: Any) -> None:
    def make() -> PPOActorWorker:
        config = {
            "ppo_epochs": 2,
            "shuffle": True,
            "seed": 3,
            "entropy_coeff": 0.01,
            "rollout": {"max_new_tokens": R},
        }
        return _actor(config, rollout=Sampler())

    _resume_pair(tmp_path, make, "update_actor")
    prompts = _batch(4).select(KEYS.input_ids, KEYS.attention_mask)
    a, b = make(), make()
    a.generate_sequences(prompts)
    a.save_checkpoint(str(tmp_path / "gen"))
    b.load_checkpoint(str(tmp_path / "gen"))
    assert torch.equal(
        a.generate_sequences(prompts)[KEYS.responses], b.generate_sequences(prompts)[KEYS.responses]
    )
    with pytest.raises(ValueError, match="path"):
        b.load_checkpoint(str(tmp_path / "missing"))


def test_critic_checkpoint_resumes_bit_identically(tmp_path: Any) -> None:
    _resume_pair(tmp_path, lambda: _critic({"ppo_epochs": 2, "shuffle": True, "seed": 1}), "update_critic")


# -------------------------------------------------------------------------------- skipped steps
def _infinite_gradient_on_calls(module: nn.Module, calls: set[int]) -> None:
    """Make the gradient of the module's output infinite on the given forward calls (1-based), while every loss
    stays finite: an overflow in the backward pass, the case the optimizer step must survive (a non-finite
    *input* of a loss raises instead: see ``tests/ppo_core/test_losses_finiteness.py``)."""
    forward, count = module.forward, [0]

    def poisoned(input_ids: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        out = forward(input_ids)
        if count[0] in calls and out.requires_grad:
            out.register_hook(lambda g: g * float("inf"))
        return out

    module.forward = poisoned


def test_non_finite_gradient_skips_the_step_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    actor = _actor({"ppo_mini_batch_size": 4, "micro_batch_size": 2})
    batch = _batch(8)
    _infinite_gradient_on_calls(actor.engine.module, {3})  # mini-batch 1, its micro-batch 0
    before = actor.engine.module.table.detach().clone()
    with caplog.at_level(logging.WARNING, logger="ppo_core.workers.ppo"):
        metrics = actor.update_actor(batch)
    assert metrics["actor/skipped_steps"] == 1.0
    assert not math.isfinite(metrics["actor/grad_norm"])  # the mean over steps reports the non-finite norm
    (record,) = caplog.records
    message = record.getMessage()
    for part in ("update_actor", "epoch 0, mini-batch 1", "every loss of the 2 micro-batch(es) is finite",
                 "gradient: table"):  # fmt: skip
        assert part in message, message
    # the first step was taken, the second skipped: the parameters moved once, and stay finite
    first_step = actor.engine.applied[0][0]
    assert torch.isfinite(actor.engine.module.table).all()
    assert not torch.equal(actor.engine.module.table, before) and torch.isfinite(first_step).all()
    assert not torch.isfinite(actor.engine.applied[1][0]).all()


def test_skipped_steps_count_every_skipped_step() -> None:
    critic = _critic({"ppo_epochs": 3})
    _infinite_gradient_on_calls(critic.engine.module, {1, 2, 3})
    metrics = critic.update_critic(_batch(4))
    assert metrics["critic/skipped_steps"] == 3.0
    assert torch.equal(critic.engine.module.table, Bigram(1, 0).table)  # never stepped


def test_zero_gradient_steps_are_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    """All advantages 0 (and no KL or entropy term): every step has a zero gradient, the parameters do not move,
    and one warning per update names the role and the count."""
    actor = _actor({"ppo_mini_batch_size": 2, "policy_loss": {"loss_mode": "gpg"}})  # no clipping
    batch = _batch(6)
    batch[KEYS.advantages] = torch.zeros_like(batch[KEYS.advantages])
    before = actor.engine.module.table.detach().clone()
    with caplog.at_level(logging.WARNING, logger="ppo_core.workers.ppo"):
        metrics = actor.update_actor(batch)
    assert (metrics["actor/zero_grad_steps"], metrics["actor/skipped_steps"]) == (3.0, 0.0)
    assert torch.equal(actor.engine.module.table, before)
    (record,) = caplog.records
    assert (
        "3 of 3 optimizer step(s) of the actor" in record.getMessage() and "advantages" in record.getMessage()
    )
    caplog.clear()
    batch[KEYS.advantages][0, 0] = 1.0  # one non-zero advantage (a valid token): the first step moves
    with caplog.at_level(logging.WARNING, logger="ppo_core.workers.ppo"):
        metrics = actor.update_actor(batch)
    assert metrics["actor/zero_grad_steps"] == 2.0 and "2 of 3" in caplog.records[0].getMessage()


# -------------------------------------------------------------------------------- rollout and wiring
def test_generate_uses_the_rollout_engine_and_weights_reach_it() -> None:
    sampler = Sampler()
    actor = _actor({"rollout": {"max_new_tokens": 2}}, rollout=sampler)
    assert isinstance(actor.rollout, RolloutEngine)
    out = actor.generate_sequences(_batch(3).select(KEYS.input_ids, KEYS.attention_mask))
    assert out[KEYS.responses].shape == (3, 2) and KEYS.rollout_log_probs in out
    greedy = actor.generate_sequences(_batch(3).select(KEYS.input_ids, KEYS.attention_mask), do_sample=False)
    assert (greedy[KEYS.responses] == 0).all()  # do_sample=False reached the engine as temperature 0
    assert sampler.received == []
    actor.update_actor(_batch(4))
    (weights,) = sampler.received
    assert torch.equal(weights["table"], actor.engine.module.table)


class Miswired(Sampler):
    """A rollout engine that breaks its contract one way: what the actor says."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def generate(self, prompts, prompt_mask, config, *, generator):  # type: ignore[no-untyped-def]
        out = super().generate(prompts, prompt_mask, config, generator=generator)
        if self.fault == "wide":  # one column too many in the responses, their mask and log-probs
            r = config.max_new_tokens + 1
            return rollout_batch(
                prompts, prompt_mask, torch.zeros(len(prompts), r, dtype=torch.long),
                torch.ones(len(prompts), r, dtype=torch.long), torch.zeros(len(prompts), r),
            )  # fmt: skip
        if self.fault == "no_mask":
            return out.exclude(KEYS.response_mask)
        if self.fault == "float_mask":  # not 0/1: refused (a 0/1 float mask is read as an integer one)
            out[KEYS.response_mask] = out[KEYS.response_mask].float() * 0.5
            return out
        if self.fault == "float_ids":
            out[KEYS.responses] = out[KEYS.responses].float()
            return out
        if self.fault == "dict":
            return dict(out.items())
        if self.fault == "short":
            return out[:-1]
        raise ValueError(self.fault)


@pytest.mark.parametrize(
    ("fault", "error", "message"),
    [
        ("wide", ValueError, r"responses of 3 columns \(at most max_new_tokens=2\)"),
        ("no_mask", ValueError, "returned no response_mask"),
        ("float_mask", TypeError, "response_mask of torch.float32 with values other than 0 and 1"),
        ("float_ids", TypeError, "responses of torch.float32: token ids and masks are integer"),
        ("dict", TypeError, "returned dict; a RolloutEngine returns a TensorDict"),
        ("short", ValueError, "for 3 prompts"),
    ],
)
def test_a_rollout_engines_output_is_checked_against_its_contract(fault, error, message) -> None:
    actor = _actor({"rollout": {"max_new_tokens": 2}}, rollout=Miswired(fault))
    with pytest.raises(error, match=rf"rollout engine Miswired .*{message}"):
        actor.generate_sequences(_batch(3).select(KEYS.input_ids, KEYS.attention_mask))


def test_engines_satisfy_the_protocols() -> None:
    assert isinstance(BigramEngine(), TrainingEngine)
    assert isinstance(BigramEngine(trainable=False), ForwardEngine)
    with pytest.raises(ValueError, match="forward-only"):
        _ = BigramEngine(trainable=False).lr


def test_argument_errors_name_what_is_wrong() -> None:
    with pytest.raises(TypeError, match="TrainingEngine"):
        PPOActorWorker(PPOActorConfig(), object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy engine"):
        _actor({}, BigramEngine("value"))
    with pytest.raises(ValueError, match="value engine"):
        _critic({}, BigramEngine("policy"))
    with pytest.raises(TypeError, match="RolloutEngine"):
        _actor({}, rollout=object())
    with pytest.raises(ValueError, match="rollout engine"):
        _actor({}).generate_sequences(_batch(2).select(KEYS.input_ids, KEYS.attention_mask))
    with pytest.raises(ValueError, match="reference"):
        _actor({}).compute_ref_log_prob(_batch(2))
    with pytest.raises(ValueError, match="divisible by dp_size"):
        group = ThreadGroup(2)
        with worker_context(rank=0, world_size=2):
            _actor({"ppo_mini_batch_size": 3}, BigramEngine(group=group))


def test_update_checks_its_keys() -> None:
    batch = _batch(4)
    with pytest.raises(ValueError, match=r"update_actor needs .*missing \['ref_log_probs'\]"):
        _actor({"use_kl_loss": True}).update_actor(batch.exclude(KEYS.ref_log_probs))
    with pytest.raises(ValueError, match=r"update_critic needs .*missing \['returns'\]"):
        _critic({}).update_critic(batch.exclude(KEYS.returns))
    with pytest.raises(ValueError, match="mini-batch"):
        _actor({"ppo_mini_batch_size": 3}).update_actor(batch)


def test_empty_batch_takes_no_step() -> None:
    actor, critic = _actor({"ppo_mini_batch_size": 1}), _critic({"ppo_mini_batch_size": 1})
    batch = _batch(0)
    assert actor.compute_log_prob(batch)[KEYS.old_log_probs].shape == (0, R)
    metrics = actor.update_actor(batch)
    assert "actor/grad_norm" not in metrics and metrics["actor/skipped_steps"] == 0.0
    assert "critic/grad_norm" not in critic.update_critic(batch)
    assert actor.engine.applied == [] and critic.engine.applied == []


def test_metrics_are_step_means_of_micro_batch_shares() -> None:
    """Loss metrics do not depend on the micro-batch size; ratio metrics average the micro-batches' values;
    every metric is the mean over optimiser steps."""
    batch = _batch(8, seed=9)
    config = {
        "ppo_mini_batch_size": 4,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "optim": {"grad_clip": None},
    }
    whole = _actor(config).update_actor(batch)
    split = _actor({**config, "micro_batch_size": 2}).update_actor(batch)
    for name in ("actor/pg_loss", "actor/update_entropy", "actor/kl_loss", "actor/grad_norm"):
        # a step's metric is accumulated over its micro-batches in float32
        assert split[name] == pytest.approx(whole[name], rel=1e-6), name
    # the first step of each run starts from the same weights: its clip fraction is a mean over micro-batches
    # of each micro-batch's own fraction; the second step starts from moved weights, so compare step 1 only
    one_step = _actor({**config, "ppo_mini_batch_size": 8, "micro_batch_size": 2}).update_actor(batch)
    model = Bigram(V, 0)
    fractions = []
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)):
        micro = batch[rows]
        out = _outputs(model(micro[KEYS.input_ids]), micro, "policy", OutputSpec())
        _, m = compute_policy_loss(
            micro[KEYS.old_log_probs],
            out[LOG_PROBS],
            micro[KEYS.advantages],
            micro[KEYS.response_mask],
            config=PolicyLossConfig(),
        )
        fractions.append(float(m["pg_clipfrac"]))
    assert one_step["actor/pg_clipfrac"] == pytest.approx(sum(fractions) / 4, rel=1e-6)


def test_a_zero_one_float_mask_from_an_engine_is_read_as_integers(caplog) -> None:
    """Engines written before the output check returned float masks of 0 and 1: they keep working (a warning)."""

    class FloatMask(Sampler):
        def generate(self, prompts, prompt_mask, config, *, generator):  # type: ignore[no-untyped-def]
            out = super().generate(prompts, prompt_mask, config, generator=generator)
            out[KEYS.response_mask] = out[KEYS.response_mask].float()
            return out

    actor = _actor({"rollout": {"max_new_tokens": 2}}, rollout=FloatMask())
    with caplog.at_level("WARNING"):
        out = actor.generate_sequences(_batch(3).select(KEYS.input_ids, KEYS.attention_mask))
    assert out[KEYS.response_mask].dtype == torch.int64 and (out[KEYS.response_mask] == 1).all()
    assert "read as int64" in caplog.text
