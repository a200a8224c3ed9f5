"""Fixtures shared by the CLI tests: a tiny ChatML BPE tokenizer and a random-init checkpoint that uses it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with the ChatML template (EOS ``<|im_end|>``, pad ``<|endoftext|>``)."""
    pytest.importorskip("transformers")
    from ppo_core.examples.tokenizer import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(["Mia has 7 shells. #### 8", "user assistant"] * 20, folder, vocab_size=300)
    return str(folder)


@pytest.fixture(scope="module")
def tiny(tokenizer_dir, tmp_path_factory):
    """The ``tiny`` random-init Qwen2 checkpoint with that tokenizer."""
    from ppo_core_cli.shapes import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("m") / "tiny", "tiny", tokenizer_dir, seed=3)
