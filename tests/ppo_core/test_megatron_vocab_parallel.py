"""Vocab-parallel log-probs and entropy against a full-vocabulary float64 reference, values and gradients.

One rank: hypothesis properties in this process. Two and four ranks: real ``torch.distributed`` gloo groups in
spawned processes, each holding a slice of the vocabulary; the shards of the gradient are put back together
and compared with the reference gradient.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

from ppo_core.workers.megatron import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)


def _reference(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, a: torch.Tensor, b: torch.Tensor):
    """float64 log_softmax over the first ``vocab_size`` columns; grads of ``sum(a*logp + b*H)``."""
    x = logits.detach().double().requires_grad_()
    # -inf entries as a huge finite negative: probability exactly 0, and autograd gives them a zero gradient
    finite = torch.where(torch.isfinite(x), x, torch.full((), -1e300, dtype=x.dtype))
    logp_all = torch.log_softmax(finite[..., :vocab_size], dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ent = -torch.where(p > 0, p * logp_all, torch.zeros((), dtype=x.dtype)).sum(-1)
    (grad,) = torch.autograd.grad((logp * a.double()).sum() + (ent * b.double()).sum(), x)
    return logp.detach(), ent.detach(), grad


def _case(seed: int, n: int, vocab: int, padded: int, scale: float, neg_inf: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, padded, generator=g, dtype=torch.float64) * scale
    if neg_inf and n:
        # masked vocabulary entries, never on the label
        logits[torch.rand(n, padded, generator=g) < 0.2] = float("-inf")
    labels = torch.randint(0, vocab, (n,), generator=g)
    if n:
        logits[torch.arange(n), labels] = torch.randn(n, generator=g, dtype=torch.float64)
    return {
        "logits": logits,
        "labels": labels,
        "vocab_size": vocab,
        "a": torch.randn(n, generator=g, dtype=torch.float64),
        "b": torch.randn(n, generator=g, dtype=torch.float64),
    }


@given(
    n=st.integers(0, 6),
    vocab=st.integers(1, 40),
    pad=st.integers(0, 7),
    scale=st.sampled_from([0.1, 3.0, 60.0]),
    neg_inf=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_one_rank_matches_full_vocab_reference(n, vocab, pad, scale, neg_inf, seed):
    c = _case(seed, n, vocab, vocab + pad, scale, neg_inf)
    x = c["logits"].clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(x, c["labels"], vocab_size=vocab)
    (c["a"] * lp).sum().add((c["b"] * ent).sum()).backward()
    ref_lp, ref_ent, ref_grad = _reference(c["logits"], c["labels"], vocab, c["a"], c["b"])
    torch.testing.assert_close(lp, ref_lp, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-9, atol=1e-9)
    assert bool((x.grad[:, vocab:] == 0).all())  # padding columns get no gradient


@given(shape=st.sampled_from([(2, 3), (1, 5), (4,)]), seed=st.integers(0, 1000))
def test_wrappers_and_bf16_agree_with_the_combined_function(shape, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, 11, generator=g)
    labels = torch.randint(0, 11, shape, generator=g)
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels)
    torch.testing.assert_close(vocab_parallel_log_probs(logits, labels), lp)
    torch.testing.assert_close(vocab_parallel_entropy(logits), ent)
    lp16, ent16 = vocab_parallel_log_probs_and_entropy(logits.bfloat16(), labels)
    assert lp16.dtype == torch.float32 and lp16.shape == labels.shape
    torch.testing.assert_close(lp16, lp, rtol=0.05, atol=0.05)
    torch.testing.assert_close(ent16, ent, rtol=0.05, atol=0.05)


def test_bad_inputs_raise():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="labels must lie in"):
        vocab_parallel_log_probs(logits, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="labels must lie in"):
        vocab_parallel_log_probs(logits, torch.tensor([0, 4]), vocab_size=4)
    with pytest.raises(ValueError, match="labels has shape"):
        vocab_parallel_log_probs(logits, torch.tensor([0]))
    with pytest.raises(TypeError, match="labels"):
        vocab_parallel_log_probs(logits, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="logits"):
        vocab_parallel_log_probs(torch.zeros(2, 5, dtype=torch.long), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_log_probs(logits, torch.tensor([0, 1]), vocab_size=6)
    with pytest.raises(ValueError, match="maximum is not finite"):
        vocab_parallel_log_probs(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="maximum is not finite"):
        vocab_parallel_entropy(torch.full((1, 3), float("-inf")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    """Every case over the whole group (TP = world) and over pairs of ranks (TP = 2, two groups); the results go to
    ``{out}/{rank}.pt`` (a file, not a manager process that a loaded machine can lose)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
        results = {}
        for tp, group in ((world, dist.group.WORLD), (2, pairs[rank // 2])):
            tp_rank = rank % tp
            for i, c in enumerate(cases):
                shard = c["logits"].chunk(tp, dim=-1)[tp_rank].clone().requires_grad_()
                lp, ent = vocab_parallel_log_probs_and_entropy(
                    shard, c["labels"], group, vocab_size=c["vocab_size"]
                )
                (c["a"] * lp).sum().add((c["b"] * ent).sum()).backward()
                results[(tp, i)] = (lp.detach(), ent.detach(), shard.grad)
        torch.save(results, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_ranks_match_full_vocab_reference(tmp_path):
    world = 4
    cases = [
        _case(1, 5, 37, 40, 2.0, False),  # padded vocabulary: the last rank holds padding columns
        _case(2, 7, 40, 40, 50.0, True),  # large logits and masked (-inf) entries
        _case(3, 3, 9, 12, 1.0, False),  # with 4 ranks the last shard is padding only
        _case(4, 0, 8, 8, 1.0, False),  # no rows
        _case(5, 64, 1000, 1024, 5.0, False),
    ]
    # fork: the children reuse this process's imports (spawn would re-import torch in each, ~10 s here)
    mp.start_processes(
        _rank_main, args=(world, _free_port(), cases, str(tmp_path)), nprocs=world, start_method="fork"
    )
    results = {rank: torch.load(tmp_path / f"{rank}.pt") for rank in range(world)}
    for tp in (world, 2):
        for i, c in enumerate(cases):
            ref_lp, ref_ent, ref_grad = _reference(c["logits"], c["labels"], c["vocab_size"], c["a"], c["b"])
            for rank in range(world):
                lp, ent, _ = results[rank][(tp, i)]
                torch.testing.assert_close(lp, ref_lp, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(ent, ref_ent, rtol=1e-9, atol=1e-9)
            for first in range(0, world, tp):  # each TP group's shards make the full gradient
                grad = torch.cat([results[first + t][(tp, i)][2] for t in range(tp)], dim=-1)
                torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
