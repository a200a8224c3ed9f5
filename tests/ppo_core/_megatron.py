"""A tiny megatron model shape, random Hugging Face weights and a pool of spawned ranks shared by the CPU megatron
tests (imported as ``from _megatron import ...``)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from ppo_core.workers.megatron import MegatronModelConfig


def tiny_config(**kw: Any) -> MegatronModelConfig:
    """Two layers, width 32, grouped-query attention, a padded vocabulary of 70 (to 72), fp32."""
    base: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        vocab_size=70,
        max_position_embeddings=32,
        dtype="float32",
        make_vocab_size_divisible_by=8,
    )
    return MegatronModelConfig(**{**base, **kw})


def random_hf_state(cfg: MegatronModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random state dict with Hugging Face Llama/Qwen2 names (``qkv_bias`` adds Qwen2's q/k/v biases)."""
    g = torch.Generator().manual_seed(seed)
    d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    out = {"model.embed_tokens.weight": r(v, d), "model.norm.weight": 1 + 0.1 * r(d)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = r(v, d)
    if cfg.norm == "LayerNorm":
        out["model.norm.bias"] = 0.1 * r(d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + 0.1 * r(d),
            p + "post_attention_layernorm.weight": 1 + 0.1 * r(d),
            p + "self_attn.q_proj.weight": r(qd, d),
            p + "self_attn.k_proj.weight": r(kvd, d),
            p + "self_attn.v_proj.weight": r(kvd, d),
            p + "self_attn.o_proj.weight": r(d, qd),
            p + "mlp.gate_proj.weight": r(f, d),
            p + "mlp.up_proj.weight": r(f, d),
            p + "mlp.down_proj.weight": r(d, f),
        }
        if cfg.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": r(qd),
                p + "self_attn.k_proj.bias": r(kvd),
                p + "self_attn.v_proj.bias": r(kvd),
            }
        if cfg.norm == "LayerNorm":
            out |= {p + "input_layernorm.bias": 0.1 * r(d), p + "post_attention_layernorm.bias": 0.1 * r(d)}
    return out


@contextlib.contextmanager
def cpu_tensor_parallel(rank: int, world: int, port: int) -> Iterator[Any]:
    """Join ``world`` CPU ranks as one tensor-parallel group over gloo on 127.0.0.1:``port`` (one thread per rank);
    yields the ``ParallelConfig`` and tears megatron's parallel state down afterwards."""
    from ppo_core.workers.megatron import ParallelConfig, destroy_megatron_parallel, init_megatron_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    parallel = ParallelConfig(tensor_model_parallel_size=world)
    init_megatron_parallel(parallel, rank=rank, world_size=world, device=torch.device("cpu"))
    try:
        yield parallel
    finally:
        destroy_megatron_parallel()


class RankPool:
    """``size`` spawned processes that keep their imports (torch, megatron) from one job to the next.

    :meth:`run` calls ``main(rank, world, port, *args, out)`` on the first ``world`` of them, like a fresh spawn
    per job but without importing megatron again each time (~5 s a process on the 2-core CI machine). The processes
    are spawned, not forked: a child forked after this process ran megatron and gloo can deadlock. Every job starts
    from the torch RNG state of a fresh process. A job that fails, hangs past ``timeout_s`` or loses a process
    stops them all (the next job starts new ones), so no rank is left blocked in a collective.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def run(self, main: Any, world: int, *args: Any, timeout_s: float = 240.0) -> dict:
        """``out``, the dict the ranks filled (``out[rank] = ...``); a rank's exception is raised here with its
        traceback."""
        import multiprocessing.connection
        import pickle
        import socket
        import time

        if not 1 <= world <= self.size:
            raise ValueError(f"world must be in [1, {self.size}], got {world}")
        if not self._procs:
            self._start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        out: dict = {}
        try:
            for rank in range(world):
                self._conns[rank].send_bytes(pickle.dumps((main, rank, world, port, args)))
            waiting = set(range(world))
            deadline = time.monotonic() + timeout_s
            while waiting:
                ready = multiprocessing.connection.wait(
                    [self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting],
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if not ready:
                    raise TimeoutError(f"ranks {sorted(waiting)} did not finish within {timeout_s} s")
                for rank in sorted(waiting):
                    if self._conns[rank] in ready:
                        ok, value = pickle.loads(self._conns[rank].recv_bytes())
                        if not ok:
                            raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
                        out.update(value)
                        waiting.discard(rank)
                    elif self._procs[rank].sentinel in ready:
                        raise RuntimeError(f"rank {rank} of {world} exited during the job")
        except BaseException:
            self.close()
            raise
        return out

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        for _ in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_jobs, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def close(self) -> None:
        """Stop every process (killed: a rank may be blocked in a collective) and wait for it."""
        for proc in self._procs:
            proc.kill()
        for proc, conn in zip(self._procs, self._conns, strict=True):
            proc.join(timeout=30.0)
            conn.close()
        self._procs, self._conns = [], []


def _serve_jobs(conn: Any) -> None:
    """A :class:`RankPool` process: run jobs until the pool closes its end of the pipe."""
    import ctypes
    import pickle
    import signal
    import traceback

    with contextlib.suppress(OSError, AttributeError):  # end with the test process, even if it is killed
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    fresh_rng = torch.random.get_rng_state()
    while True:
        try:
            main, rank, world, port, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        torch.random.set_rng_state(fresh_rng)
        out: dict = {}
        try:
            main(rank, world, port, *args, out)
            reply = pickle.dumps((True, dict(out)))
        except BaseException:
            reply = pickle.dumps((False, traceback.format_exc()))
        conn.send_bytes(reply)
