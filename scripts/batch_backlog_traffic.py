#!/usr/bin/env python3
"""Recorded traffic for the batch-backfill comparison in BENCHMARKS.md:
interactive requests alone, and the same requests with a 50,000-item batch
backlog queued at the start, sized from the Azure 2023 conversation trace
(../shared/traces, CC-BY-4.0).

    python3 scripts/batch_backlog_traffic.py OUT_DIR [ITEMS]
    kiln simulate --policy benches/batch.kiln --traffic OUT_DIR/alone.jsonl
    kiln simulate --policy benches/batch.kiln --traffic OUT_DIR/with.jsonl

Interactive: tenant `chat`, Poisson at 4/s for 400 s (seed 7), prompts
capped at 2,048 tokens, outputs at 1,024. Batch: tenant `bulk`, one item
every 10 us from t = 0, prompts capped at 256 tokens, outputs at 512, each
with the `x-kiln-batch` header, as the gateway logs batch items.
"""
import csv
import json
import os
import random
import sys

here = os.path.dirname(os.path.abspath(__file__))
trace = os.path.join(here, "..", "..", "shared", "traces", "azure2023", "AzureLLMInferenceTrace_conv.csv")
out_dir = sys.argv[1]
items = int(sys.argv[2]) if len(sys.argv) > 2 else 50_000
rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(open(trace))]
random.seed(7)
online, t = [], 0.0
while t < 400_000:
    t += random.expovariate(4 / 1000)
    c, g = random.choice(rows)
    online.append({"at_ms": round(t, 3), "tenant": "chat", "model": "llama-8b",
                   "prompt_tokens": min(c, 2048), "max_tokens": min(g, 1024), "output_tokens": min(g, 1024)})
batch = []
for i in range(items):
    c, g = rows[(i * 7919) % len(rows)]
    batch.append({"at_ms": round(i * 0.01, 3), "tenant": "bulk", "model": "llama-8b",
                  "prompt_tokens": min(c, 256), "max_tokens": min(g, 512), "output_tokens": max(1, min(g, 512)),
                  "headers": {"x-kiln-batch": "b1"}})
os.makedirs(out_dir, exist_ok=True)
for name, recs in [("alone", online), ("with", sorted(online + batch, key=lambda r: r["at_ms"]))]:
    with open(os.path.join(out_dir, name + ".jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
