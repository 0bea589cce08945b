#!/usr/bin/env python3
"""Writes the seed corpora of the safetensors and hf_config fuzz targets (tests/fuzz/README.md):
   tests/fuzz/make_json_seeds.py tests/fuzz/corpus
Good files of each kind, then hostile ones: nesting far past the readers' limits, many objects in
one list (quadratic in nlohmann's callback parser), a NUL byte with text after it, a repeated key,
a number beyond double's range, sizes that overflow."""
import json
import os
import struct
import sys

out = sys.argv[1]
SEP = b"\n--ssfz-data--\n"


def write(target, name, data):
    os.makedirs(os.path.join(out, target), exist_ok=True)
    with open(os.path.join(out, target, name), "wb") as f:
        f.write(data)


# ---- safetensors: byte 0 = mode (1: header text, SEP, data; the harness adds the size) ----
def tensors(entries, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, width in entries:
        n = width
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += bytes((len(data) + i) % 251 for i in range(n))
    if metadata is not None:
        header["__metadata__"] = metadata
    return json.dumps(header).encode(), data


def fixup(name, header, data=b""):
    write("safetensors", name, b"\x01" + header + SEP + data)


def raw(name, header, data=b"", size=None):
    size = len(header) if size is None else size
    write("safetensors", name, b"\x00" + struct.pack("<Q", size) + header + data)


h, d = tensors([("model.embed_tokens.weight", "BF16", [8, 4], 2),
                ("model.layers.0.self_attn.q_proj.bias", "F32", [4], 4),
                ("model.norm.weight", "F16", [4], 2),
                ("lm_head.weight", "F64", [2, 2], 8)], {"format": "pt"})
fixup("fixup-model", h, d)
raw("raw-model", h, d)
raw("raw-padded", h + b"   ", d, len(h) + 3)
fixup("fixup-empty", b"{}")
fixup("fixup-zero-sized", *tensors([("e", "I64", [0, 3], 8), ("u", "U8", [2], 1)]))
fixup("fixup-every-dtype", *tensors([(t, t, [2], w) for t, w in [
    ("BOOL", 1), ("I8", 1), ("F8_E4M3", 1), ("I16", 2), ("U16", 2), ("I32", 4), ("U32", 4),
    ("U64", 8), ("C64", 8)]]))
fixup("hostile-deep-lists", b'{"w": ' + b"[" * 5000 + b"]" * 5000 + b"}")
fixup("hostile-deep-metadata", b'{"__metadata__": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001)
fixup("hostile-many-objects", b'{"w": [' + b",".join([b"{}"] * 20000) + b"]}")
fixup("hostile-top-level-list", b"[" + b",".join([b"{}"] * 20000) + b"]")
fixup("hostile-nul", h + b"\x00" + b'{"x": 1}', d)
fixup("hostile-repeated-name", b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
      b'"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\x07")
fixup("hostile-repeated-field", b'{"w": {"dtype": "U8", "dtype": "F32", "shape": [1], '
      b'"data_offsets": [0, 1]}}', b"\x07")
fixup("hostile-shape-overflow", b'{"w": {"dtype": "F64", "shape": [4294967296, 4294967296, 16], '
      b'"data_offsets": [0, 0]}}')
fixup("hostile-offsets-overflow", b'{"w": {"dtype": "U8", "shape": [1], '
      b'"data_offsets": [18446744073709551615, 0]}}', b"\x01")
fixup("hostile-number-range", b'{"w": {"dtype": "U8", "shape": [1e999], "data_offsets": [0, 1]}}')
raw("hostile-size-beyond-file", h, d, 1 << 40)

# ---- hf_config: the bytes of a config.json ----
qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
         "vocab_size": 96, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
         "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
         "layer_types": ["full_attention", "full_attention"], "dtype": "bfloat16",
         "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
llama = {"model_type": "llama", "hidden_act": "silu", "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "torch_dtype": "float32",
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
mistral = {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 1, "sliding_window": 4096, "rope_theta": 10000.0,
           "dtype": "float16"}


def hf(name, value):
    write("hf_config", name, value if isinstance(value, bytes) else json.dumps(value, indent=2).encode())


hf("qwen2", qwen2)
hf("llama3-scaling", llama)
hf("mistral", mistral)
hf("qwen2-sliding", dict(qwen2, use_sliding_window=True, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"]))
hf("llama-linear", dict(llama, rope_scaling={"type": "linear", "factor": 2.0}))
hf("hostile-deep", b'{"model_type": "llama", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
hf("hostile-nul", json.dumps(qwen2).encode() + b"\x00" + b'{"vocab_size": 1}')
hf("hostile-layers-1e9", dict(llama, num_hidden_layers=1000000000))
hf("hostile-number-range", json.dumps(llama).encode().replace(b"500000.0", b"1e999"))
hf("hostile-repeated-key", b'{"model_type": "llama", "model_type": "qwen2"}')
hf("hostile-many-layer-types", json.dumps(dict(qwen2, use_sliding_window=True, sliding_window=16,
                                               layer_types=["full_attention"] * 2000)).encode())
hf("hostile-int-overflow", dict(llama, hidden_size=2**63, intermediate_size=-1))
hf("hostile-not-utf8", b'{"model_type": "ll\xffama"}')
