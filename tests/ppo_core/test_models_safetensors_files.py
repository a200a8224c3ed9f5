"""Truncated or corrupted safetensors weight files raise naming the file, wherever weights are loaded: the header
check against the file size, the Hugging Face loaders of the torch workers and the megatron reader."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

safetensors_torch = pytest.importorskip("safetensors.torch")

from ppo_core.models.safetensors_files import check_safetensors_file, hf_weight_files  # noqa: E402


def _file(path, shapes: list[tuple[int, ...]]) -> bytes:
    tensors = {
        f"t{i}": torch.arange(max(1, int(torch.tensor(s).prod()))).float().view(s)
        for i, s in enumerate(shapes)
    }
    safetensors_torch.save_file(tensors, os.fspath(path))
    return path.read_bytes()


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3),
    data=st.data(),
)
def test_every_cut_of_a_file_is_named_and_the_whole_file_passes(tmp_path_factory, shapes, data):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    raw = _file(path, shapes)
    check_safetensors_file(path)
    cut = data.draw(st.integers(0, len(raw) - 1))
    path.write_bytes(raw[:cut])
    with pytest.raises(ValueError, match=f"weights file {path} is truncated.*it holds {cut} bytes"):
        check_safetensors_file(path)


def test_a_corrupted_header_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    raw = _file(path, [(2, 3)])
    path.write_bytes(raw[:8] + b"\xff" * 6 + raw[14:])
    with pytest.raises(ValueError, match=f"weights file {path} has a corrupted header"):
        check_safetensors_file(path)
    header = json.dumps({"t0": {"dtype": "F32", "shape": [1]}}).encode()  # no data_offsets
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="has a corrupted header"):
        check_safetensors_file(path)


def test_the_files_from_pretrained_reads(tmp_path):
    assert hf_weight_files(tmp_path) == []
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "adapter.safetensors").write_bytes(b"")
    assert hf_weight_files(tmp_path) == [os.fspath(tmp_path / "model.safetensors")]
    index = {"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert hf_weight_files(tmp_path) == [os.fspath(tmp_path / "model-00001-of-00002.safetensors")]


@pytest.fixture(scope="module")
def truncated_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from _hf import make_checkpoint

    good = make_checkpoint(tmp_path_factory.mktemp("good"), "qwen2")
    bad = os.fspath(tmp_path_factory.mktemp("bad") / "ckpt")
    shutil.copytree(good, bad)
    weights = os.path.join(bad, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return bad, weights


@pytest.mark.parametrize("loader", ["load_causal_lm", "load_value_model"])
def test_the_hf_loaders_name_a_truncated_weights_file(truncated_checkpoint, loader):
    from ppo_core.models import hf

    folder, weights = truncated_checkpoint
    with pytest.raises(ValueError, match=f"weights file {weights} is truncated"):
        getattr(hf, loader)(folder)


def test_the_megatron_reader_names_a_truncated_weights_file(truncated_checkpoint):
    pytest.importorskip("megatron.core")
    from ppo_core.workers.megatron.hf_loading import read_safetensors

    folder, weights = truncated_checkpoint
    with pytest.raises(ValueError, match=f"weights file {weights} is truncated"):
        read_safetensors(folder)
