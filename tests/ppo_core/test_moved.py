"""The decode engine's old import paths (``ppo_core.rollout.<module>``, ``ppo_core.workers.megatron.decode``) are
aliases of ``ppo_core_decode`` for one release: the same objects, and a ``DeprecationWarning`` naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MOVED = [
    "batch_invariant",
    "decode_attention",
    "decode_linear",
    "decode_rotary",
    "decode_rotary_attention",
    "decoder_loop",
    "decoding",
    "eager_rounding",
    "fused_sampling",
    "hf",
    "kv_cache",
    "pdl",
    "split_launch",
    "step_inputs",
]


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize("module", MOVED)
def test_old_rollout_path_is_a_warning_alias(module: str) -> None:
    new = importlib.import_module(f"ppo_core_decode.{module}")
    with pytest.warns(
        DeprecationWarning, match=rf"ppo_core\.rollout\.{module} moved to ppo_core_decode\.{module}"
    ):
        old = _fresh_import(f"ppo_core.rollout.{module}")
    public = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert public and list(getattr(old, "__all__", public)) == list(public)
    for name in public:
        assert getattr(old, name) is getattr(new, name), name
    # private helpers too (code that reached into the old module keeps working)
    private = [n for n in vars(new) if n.startswith("_") and not n.startswith("__")]
    assert all(getattr(old, n) is getattr(new, n) for n in private)


def test_old_megatron_decode_path_is_a_warning_alias() -> None:
    pytest.importorskip("megatron.core")
    from ppo_core.workers.megatron.rollout import own_forward_unsupported
    from ppo_core_decode import megatron

    with pytest.warns(
        DeprecationWarning, match=r"ppo_core\.workers\.megatron\.decode moved to ppo_core_decode\.megatron"
    ):
        old = _fresh_import("ppo_core.workers.megatron.decode")
    assert old.MegatronDecodeForward is megatron.MegatronDecodeForward
    assert old.gather_vocabulary is megatron.gather_vocabulary
    assert old.own_forward_unsupported is own_forward_unsupported
    assert set(old.__all__) == {"MegatronDecodeForward", "gather_vocabulary", "own_forward_unsupported"}


def test_the_new_paths_do_not_warn() -> None:
    # in a fresh interpreter: re-importing the new modules here would give the other tests second copies of them
    code = "; ".join(f"import ppo_core_decode.{module}" for module in MOVED)
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
