"""PPO (GAE + critic) or GRPO on a tiny GPT that learns to write digits summing to a target. CPU, a few minutes.

The task (verifiable, rule-based reward in [0, 1]):

    prompt:    <bos> 1 7 =               the target t (0..27) in decimal, left-padded to 4 tokens
    response:  9 2 6 <eos>               exactly three digits, then <eos>
    reward:    max(0, 1 - |9+2+6 - t| / 10)   if the format is right, else 0

The model is a randomly initialised 2-layer ``TinyGPT``. Before RL it gets a short *supervised warm-up on the
format only*: it imitates random digit triples followed by ``<eos>`` (digits independent of the target), so it
leaves the warm-up writing well-formed answers with a mean reward of about 0.35. Everything after that is RL:
the policy must discover from the reward alone that the digits should depend on the target.

RL runs through ``ppo_core.trainer.BasePPOTrainer`` on the local backend; this file only supplies the task, the
models and ``init_workers()``:

    for step in 1..S:
        sample n responses per prompt                   actor_wg.generate_sequences
        score them                                      reward_fn (this file)
        log-probs of the samples, under pi and pi_ref   actor_wg.compute_log_prob / compute_ref_log_prob
        ppo:  V(s) from the critic, KL(pi||pi_ref) in the reward, GAE advantages, clipped value update
        grpo: group-normalised outcome advantages, KL(pi||pi_ref) as a loss term
        clipped policy-gradient update, a few epochs of mini-batches        actor_wg.update_actor

Run:
    python examples/ppo_digits.py                 # PPO, the default (make demo)
    python examples/ppo_digits.py --algo grpo

Outputs (printed at the end): ``<out-dir>/metrics.jsonl`` (one JSON object per step) and
``<out-dir>/reward_kl.png`` (mean reward and KL to the reference against the step).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase

from ppo_core.backends.local import LocalWorkerGroup
from ppo_core.models import TinyGPT, TinyGPTConfig
from ppo_core.trainer import BasePPOTrainer, plot_run, read_metrics_jsonl
from ppo_core.workers import WorkerSpec
from ppo_core.workers.torch import TorchActorWorker, TorchCriticWorker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    p.add_argument("--steps", type=int, default=150, help="RL steps (one batch of prompts each)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="default: 128 (ppo) or 16 (grpo)")
    p.add_argument("--n", type=int, default=8, help="responses per prompt for grpo (ppo samples 1)")
    p.add_argument("--warmup-steps", type=int, default=200, help="supervised format warm-up steps")
    p.add_argument("--lr", type=float, default=1e-3, help="actor learning rate")
    p.add_argument("--critic-lr", type=float, default=1e-3)
    p.add_argument("--entropy-coeff", type=float, default=0.0, help="entropy bonus of the actor loss")
    p.add_argument(
        "--kl-coef",
        type=float,
        default=None,
        help="KL(pi || pi_ref) weight; default 0.02 (ppo, in the reward), 0.05 (grpo, loss)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/ppo_digits")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is fastest for this tiny model)"
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- 1. the task
PAD, BOS, EOS, EQ = 0, 1, 2, 3
DIGIT0 = 4  # token id of the digit d is DIGIT0 + d
VOCAB = DIGIT0 + 10
N_DIGITS = 3
MAX_TARGET = 9 * N_DIGITS
PROMPT_LEN = 4  # <bos> t t =
RESPONSE_LEN = N_DIGITS + 2  # one spare token, so a missing <eos> is possible (and punished)
REWARD_SCALE = 10.0


def encode_prompt(target: int) -> list[int]:
    return [BOS, *(DIGIT0 + int(c) for c in str(target)), EQ]


def make_dataset(size: int, generator: torch.Generator) -> list[dict]:
    targets = torch.randint(0, MAX_TARGET + 1, (size,), generator=generator).tolist()
    return [{"input_ids": encode_prompt(t), "ground_truth": t, "data_source": "digit_sum"} for t in targets]


def digit_sum_reward(batch: TensorDictBase) -> torch.Tensor:
    """[B] scores: 1 - |sum(digits) - target| / 10 (at least 0) for well-formed answers, else 0."""
    responses, response_mask = batch["responses"], batch["response_mask"]
    targets = torch.tensor([int(t) for t in batch.get("ground_truth").tolist()])
    digits = responses[:, :N_DIGITS] - DIGIT0
    well_formed = (
        ((digits >= 0) & (digits <= 9)).all(dim=1)
        & (responses[:, N_DIGITS] == EOS)
        & (response_mask.sum(dim=1) == N_DIGITS + 1)
    )
    closeness = (1 - (digits.clamp(0, 9).sum(dim=1) - targets).abs() / REWARD_SCALE).clamp(min=0)
    return torch.where(well_formed, closeness, torch.zeros(()))


# ------------------------------------------------------------------ 2. the model and the format warm-up
MODEL = TinyGPTConfig(
    vocab_size=VOCAB, max_seq_len=PROMPT_LEN + RESPONSE_LEN, d_model=64, n_layers=2, n_heads=4
)


def format_warmup(steps: int, generator: torch.Generator, batch_size: int = 128) -> dict[str, torch.Tensor]:
    """Supervised warm-up on the FORMAT: imitate random digits (independent of the target) then <eos>."""
    model = TinyGPT(MODEL, generator=generator)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        targets = torch.randint(0, MAX_TARGET + 1, (batch_size,), generator=generator).tolist()
        prompts = [encode_prompt(t) for t in targets]
        digits = torch.randint(0, 10, (batch_size, N_DIGITS), generator=generator) + DIGIT0
        answer = torch.cat([digits, torch.full((batch_size, 1), EOS)], dim=1)
        ids = torch.full((batch_size, PROMPT_LEN + N_DIGITS + 1), PAD)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, PROMPT_LEN - len(p) : PROMPT_LEN] = torch.tensor(p)
            mask[i, PROMPT_LEN - len(p) :] = 1
        ids[:, PROMPT_LEN:] = answer
        logits = model(ids, attention_mask=mask)[:, PROMPT_LEN - 1 : -1]  # position P+t-1 predicts token t
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), answer.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    logging.info(
        "format warm-up: %d steps, final cross-entropy %.3f (uniform digits: %.3f)",
        steps,
        float(loss.detach()),
        1.842,
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def policy_from(weights: dict[str, torch.Tensor]) -> TinyGPT:
    model = TinyGPT(MODEL)
    model.load_state_dict(weights)
    return model


def critic_from(weights: dict[str, torch.Tensor]) -> TinyGPT:
    """The critic starts from the warmed-up trunk with a fresh (zero) value head, as in RLHF."""
    model = TinyGPT(TinyGPTConfig(**{**MODEL.to_dict(), "value_head": True}))
    trunk = {k: v for k, v in weights.items() if not k.startswith("head.")}
    model.load_state_dict(trunk, strict=False)
    return model


# ------------------------------------------------------------------------------- 3. the PPO/GRPO config
def make_config(args: argparse.Namespace) -> dict:
    ppo = args.algo == "ppo"
    prompts = args.prompts_per_step or (128 if ppo else 16)
    n = 1 if ppo else args.n
    rows = prompts * n
    # the KL to the warmed-up policy keeps every digit in play: without it the policy collapses onto a few
    # favourite digits (e.g. only 1s and 8s) and plateaus near 0.78
    kl_coef = args.kl_coef if args.kl_coef is not None else (0.02 if ppo else 0.05)
    common = {"seed": args.seed, "ppo_epochs": 2, "ppo_mini_batch_size": rows // 2, "shuffle": True}
    return {
        "data": {"train_batch_size": prompts, "seed": args.seed},
        # one rollout section: responses per prompt and the sampling (handed to the actor worker)
        "rollout": {"n": n, "max_new_tokens": RESPONSE_LEN, "eos_token_id": EOS, "pad_token_id": PAD},
        "algorithm": {
            "adv_estimator": "gae" if ppo else "grpo",
            "gamma": 1.0,
            "lam": 1.0,
            # PPO: KL(pi || pi_ref) as a per-token reward penalty (InstructGPT); GRPO: as a loss term
            "use_kl_in_reward": ppo,
            "kl_ctrl": {"type": "fixed", "kl_coef": kl_coef},
        },
        "actor": {
            "use_kl_loss": not ppo,
            "worker": {
                **common,
                "optim": {"lr": args.lr, "weight_decay": 0.0, "grad_clip": 1.0},
                "policy_loss": {"loss_mode": "vanilla", "clip_ratio": 0.2, "loss_agg_mode": "token-mean"},
                "entropy_coeff": args.entropy_coeff,
                "use_kl_loss": not ppo,
                "kl_loss_coef": kl_coef,
                "kl_loss_type": "low_var_kl",
            },
        },
        "critic": {
            "worker": {**common, "optim": {"lr": args.critic_lr, "weight_decay": 0.0}, "cliprange_value": 0.5}
        },
        "trainer": {
            "total_training_steps": args.steps,
            "total_epochs": 10_000,
            "test_freq": 25,
            "save_freq": 0,
            "resume_mode": "disable",
            "seed": args.seed,
            "log_dir": args.out_dir,
            "default_local_dir": os.path.join(args.out_dir, "checkpoints"),
            "loggers": ("jsonl",),
        },
    }


# --------------------------------------------------------------------------- 4. the trainer: workers only
class DigitsTrainer(BasePPOTrainer):
    """Actor (+ reference) and critic workers in this process (``LocalWorkerGroup``)."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], **kwargs: object) -> None:
        super().__init__(config, **kwargs)
        self.weights = weights

    def init_workers(self) -> None:
        cfg = self.config
        actor = WorkerSpec(TorchActorWorker, (functools.partial(policy_from, self.weights), cfg.actor.worker))
        self.actor_wg = LocalWorkerGroup(actor)
        if cfg.use_critic:
            critic = WorkerSpec(
                TorchCriticWorker, (functools.partial(critic_from, self.weights), cfg.critic.worker)
            )
            self.critic_wg = LocalWorkerGroup(critic)


# ------------------------------------------------------------------------------------------- 5. outputs
def plot(records: list[dict], path: str, title: str) -> None:
    """Train and validation reward and the KL to the reference against the step (``ppo_core.trainer.plot_run``)."""
    plot_run(records, path, title)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.time()
    g = torch.Generator().manual_seed(args.seed)

    weights = format_warmup(args.warmup_steps, g)
    trainer = DigitsTrainer(
        make_config(args),
        weights,
        train_dataset=make_dataset(100_000, g),
        val_dataset=make_dataset(128, g),
        reward_fn=digit_sum_reward,
        pad_token_id=PAD,
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    wall = time.time() - start

    records = read_metrics_jsonl(args.out_dir)
    rewards = [r["critic/score/mean"] for r in records if r.get("critic/score/mean") is not None]
    png = os.path.join(args.out_dir, "reward_kl.png")
    plot(records, png, f"{args.algo.upper()} on digit sums (TinyGPT, CPU, {wall:.0f} s)")
    tail = rewards[-10:]
    summary = {
        "algo": args.algo,
        "initial_reward": rewards[0],
        "final_reward": sum(tail) / len(tail),
        "wall_seconds": wall,
    }
    print(
        f"{args.algo}: mean reward {summary['initial_reward']:.3f} -> {summary['final_reward']:.3f} "
        f"(mean of the last {len(tail)} steps) in {wall:.0f} s"
    )
    print(f"metrics: {os.path.join(args.out_dir, 'metrics.jsonl')}")
    print(f"plot:    {png}")
    return summary


if __name__ == "__main__":
    main()
