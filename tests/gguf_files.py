"""Tiny GGUF checkpoints written by the tests themselves (llama.cpp's format, through the ``gguf`` package).

``write_tiny_gguf`` writes a 2-layer decoder with random weights and a byte-level BPE tokenizer as
llama.cpp lays them out: metadata under ``<arch>.*`` and ``tokenizer.ggml.*`` keys, tensors named
``token_embd``, ``blk.N.attn_q``, ... with the matrices quantized (Q8_0, Q4_1) as a real file has them
and the norms in float32. Without an ``output.weight`` the embeddings are tied, as in SmolLM2's file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "e n", "Ġ o")
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (what byte-level vocabularies spell)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the special tokens (control), the 256 bytes, then one token per merge."""
    tokens = [*SPECIAL, *_byte_alphabet(), *(m.replace(" ", "") for m in MERGES)]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))
    return tokens, types, list(MERGES)


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, tied: bool = True, context: int = 2048) -> Path:
    """A tiny ``arch`` (llama or qwen2) checkpoint at ``path`` pretrained (by its metadata) at ``context`` tokens;
    qwen2 adds the q/k/v biases it has."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocabulary()
    vocab = len(tokens)
    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        data = rng.normal(0.0, 0.2, size=(rows, cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def vector(name: str, size: int, mean: float) -> None:
        writer.add_tensor(name, (mean + rng.normal(0.0, 0.05, size=size)).astype(np.float32))

    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    matrix("token_embd.weight", vocab, HIDDEN, q8)
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN, q4)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, q4)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, q4)
        if arch == "qwen2":
            vector(f"blk.{i}.attn_q.bias", HEADS * head_dim, 0.0)
            vector(f"blk.{i}.attn_k.bias", KV_HEADS * head_dim, 0.0)
            vector(f"blk.{i}.attn_v.bias", KV_HEADS * head_dim, 0.0)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim, q4)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, q4)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, q4)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, q4)
    vector("output_norm.weight", HIDDEN, 1.0)
    if not tied:
        matrix("output.weight", vocab, HIDDEN, q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
