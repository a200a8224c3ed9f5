"""A tiny Llama written as a GGUF file with the ``gguf`` package's ``GGUFWriter``: what llama.cpp's converter would
write for a Hugging Face Llama (the same tensor names, query/key rows in llama.cpp's rotary order, the tokenizer
as a byte-level BPE vocabulary with its merges and chat template), so the conversion is tested without a download.

Tensors are float32, or Q8_0 blocks (``quantized=True``: what a quantized file holds, dequantized on load).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

__all__ = ["tiny_llama", "write_tiny_gguf"]


def tiny_llama(vocab_size: int, *, seed: int = 0, tied: bool = True) -> Any:
    """A random ``LlamaForCausalLM`` of SmolLM2's proportions (3 query heads per key/value head), scaled down."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=tied,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim > 1 else 0.1) + (p.ndim == 1))
    return model


def _rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Query/key rows from Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs), per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str, model: Any, tokenizer_dir: str, *, quantized: bool = False) -> str:
    """Write ``model`` (a Llama) and the byte-level BPE tokenizer of ``tokenizer_dir`` as a GGUF file at ``path``."""
    import gguf

    cfg = model.config
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_config = json.load(f)
    vocab = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [""] * cfg.vocab_size
    types = [gguf.TokenType.NORMAL] * cfg.vocab_size
    for text, i in {**vocab, **added}.items():
        tokens[i] = text
    for i in added.values():
        types[i] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    # as SmolLM2's file: BOS and EOS both <|im_start|>, no padding token
    w.add_bos_token_id(added["<|im_start|>"])
    w.add_eos_token_id(added["<|im_start|>"])
    w.add_chat_template(tok_config["chat_template"])

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, ours in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    for hf, ours in names.items():
        t = state[hf]
        if hf.endswith("q_proj.weight"):
            t = _rotary_rows(t, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            t = _rotary_rows(t, cfg.num_key_value_heads)
        t = np.ascontiguousarray(t, dtype=np.float32)
        if quantized and t.ndim == 2 and t.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(ours, gguf.quants.quantize(t, q8), raw_dtype=q8)
        else:
            w.add_tensor(ours, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
