"""Fixtures shared by the tests of ``ppo_core``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cpu_megatron():
    """Megatron parallel state for one CPU rank (gloo), torn down afterwards."""
    pytest.importorskip("megatron.core")
    from ppo_core.workers.megatron import ParallelConfig, destroy_megatron_parallel, init_megatron_parallel

    init_megatron_parallel(ParallelConfig(), rank=0, world_size=1, device=torch.device("cpu"))
    yield
    destroy_megatron_parallel()


@pytest.fixture
def restore_global_rngs():
    """Restore the global torch / NumPy / Python RNG states after a test that seeds or draws from them on purpose."""
    from ppo_core.trainer.checkpoint import capture_rng_state, restore_rng_state

    state = capture_rng_state()
    yield
    restore_rng_state(state)


@pytest.fixture(scope="session")
def rank_pool():
    """Two spawned CPU ranks shared by the tensor-parallel tests (``_megatron.RankPool``), stopped at the end."""
    pytest.importorskip("megatron.core")
    from _megatron import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()
