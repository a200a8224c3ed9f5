"""Shared-memory transport and compaction (pure: no Monarch processes)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ppo_core_monarch.transport import ShmPool, compact, decode, decode_borrowed, encode, release

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16, torch.uint8]


@pytest.fixture
def shm_dir(tmp_path):
    return str(tmp_path)


@settings(max_examples=40)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=4),
    dtype_ix=st.lists(st.integers(0, len(DTYPES) - 1), min_size=4, max_size=4),
    threshold=st.sampled_from([0, 8, 1 << 30]),
)
def test_roundtrip_equals_pickle(tmp_path_factory, shapes, dtype_ix, threshold):
    directory = str(tmp_path_factory.mktemp("shm"))
    gen = torch.Generator().manual_seed(0)
    tensors = [
        (torch.rand(tuple(shape), generator=gen) * 10).to(DTYPES[dtype_ix[i % 4]])
        for i, shape in enumerate(shapes)
    ]
    obj = {
        "tensors": tensors,
        "meta": ("x", 3, None),
        "td": TensorDict({"a": torch.arange(6.0)}, batch_size=[6]),
    }
    enc = encode(obj, directory, threshold)
    out = decode(enc, unlink=True)
    ref = pickle.loads(pickle.dumps(obj))
    assert out["meta"] == ref["meta"]
    for a, b in zip(out["tensors"], ref["tensors"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(out["td"]["a"], ref["td"]["a"])
    assert os.listdir(directory) == []  # the receiver removed the file


def test_views_are_written_compactly_and_receivers_are_isolated(shm_dir):
    base = torch.arange(1000, dtype=torch.float32)
    view = base.view(100, 10)[::2, 3:7]  # non-contiguous
    enc = encode({"v": view}, shm_dir, threshold_bytes=0)
    assert enc.nbytes < base.nbytes
    a, b = decode(enc)["v"], decode(enc)["v"]
    torch.testing.assert_close(a, view)
    a.add_(1)  # copy-on-write: another receiver of the same file is unaffected
    torch.testing.assert_close(b, view)
    release(enc)
    release(enc)  # idempotent
    assert os.listdir(shm_dir) == []


def test_small_tensors_and_grad_tensors_stay_in_the_pickle(shm_dir):
    enc = encode(
        {"s": torch.zeros(3), "g": torch.zeros(100, requires_grad=True)}, shm_dir, threshold_bytes=64
    )
    assert enc.path is None
    out = decode(enc)
    assert out["g"].requires_grad and out["s"].shape == (3,)


def test_empty_tensor_and_empty_batch(shm_dir):
    obj = (torch.zeros(0, 5), TensorDict({"x": torch.zeros(0, 4)}, batch_size=[0]))
    t, td = decode(encode(obj, shm_dir, threshold_bytes=0), unlink=True)
    assert t.shape == (0, 5) and td.batch_size == torch.Size([0])


def test_compact_clones_only_views():
    owner = torch.arange(100)
    assert compact(owner) is owner
    part = compact(owner[10:20])
    assert part.untyped_storage().nbytes() == part.nbytes and torch.equal(part, owner[10:20])
    td = TensorDict({"x": owner.view(10, 10)}, batch_size=[10])[2:4]
    out = compact({"td": td, "l": [owner[:2]], "n": 3})
    assert out["td"]["x"].untyped_storage().nbytes() == out["td"]["x"].nbytes
    assert out["l"][0].untyped_storage().nbytes() == 16 and out["n"] == 3


def test_compact_with_a_threshold_clones_only_the_views_encode_would_pickle(shm_dir):
    """``MonarchWorkerGroup`` receives DP shards as views: large ones go to shared memory (written compactly,
    not cloned first); small ones would be pickled with their parent's whole storage, so they are cloned."""
    big, small = torch.arange(1 << 14), torch.arange(64)
    td = TensorDict({"big": big.view(64, -1), "small": small}, batch_size=[64])[16:32]
    out = compact((td,), threshold_bytes=1024)[0]
    assert out["big"].untyped_storage().data_ptr() == big.untyped_storage().data_ptr()  # not copied
    assert out["small"].untyped_storage().nbytes() == out["small"].nbytes == 16 * 8
    assert out["big"].untyped_storage().nbytes() > out["big"].nbytes
    tiny = small[:4]
    assert (
        compact(tiny, threshold_bytes=0) is tiny
    )  # at threshold 0 encode writes every tensor to shared memory
    enc = encode(out, shm_dir, threshold_bytes=1024)
    assert enc.nbytes == out["big"].nbytes and len(enc.skeleton) < 4096  # neither parent storage travels
    back = decode(enc, unlink=True)
    assert torch.equal(back["big"], td["big"]) and torch.equal(back["small"], td["small"])


def test_borrowed_decode_releases_only_when_nothing_kept(shm_dir):
    pool = ShmPool(shm_dir, max_bytes=1 << 24)
    obj = {"x": torch.arange(4096, dtype=torch.float32)}
    enc = encode(obj, shm_dir, 0, pool.allocate)
    out, lease = decode_borrowed(enc)
    torch.testing.assert_close(out["x"], obj["x"])
    kept = out["x"]
    del out
    assert lease.release() is False  # `kept` still maps the file
    del kept
    assert lease.release() is True
    pool.give_back(enc.path)
    # the warm file is reused for a payload that fits, and its new contents are read back exactly
    enc2 = encode({"y": torch.ones(1000)}, shm_dir, 0, pool.allocate)
    assert enc2.path == enc.path
    out2, lease2 = decode_borrowed(enc2)
    torch.testing.assert_close(out2["y"], torch.ones(1000))
    del out2
    assert lease2.release()
    pool.discard(enc2.path)
    assert not os.path.exists(enc2.path)
    pool.close()


def test_pool_respects_its_byte_budget(shm_dir):
    pool = ShmPool(shm_dir, max_bytes=0)
    path, _ = pool.allocate(10)
    pool.give_back(path)  # over budget: removed instead of kept
    assert not os.path.exists(path)
    pool.close()
