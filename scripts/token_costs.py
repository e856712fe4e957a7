#!/usr/bin/env python3
"""What a token of work costs an engine, read from kiln's decision logs.

For every served line of a replica, the time of its decode (first token to
end) and of its prefill (start to first token) is regressed on the tokens
its replica processed in that span: decode tokens of every sequence
running there, and the prompt tokens of every prefill, each prompt spread
evenly over its own prefill. Prints, per log and span, the milliseconds a
decode token and a prompt token cost (weighted least squares on relative
error) and the median relative error of that two-number model.

    python3 scripts/token_costs.py target/fidelity/decisions-*.jsonl

A flat cost across loads says the engine's speed is a property of the
engine (so a replay can be calibrated from one load); a decode token
costing more than a prompt token is what `seq_overhead_ms` models.
Standard library only.
"""

from __future__ import annotations

import json
import statistics
import sys


def lines_of(path: str) -> list[tuple]:
    out = []
    t0 = None
    rows = []
    for raw in open(path, encoding="utf-8", errors="replace"):
        try:
            x = json.loads(raw)
        except ValueError:
            continue
        if x.get("ttft_ms") is None or not x.get("e2e_ms"):
            continue
        rows.append(x)
    if not rows:
        return out
    t0 = min(x["at_ms"] for x in rows)
    for x in rows:
        q = x.get("queue_ms") or 0.0
        rep = (x.get("decision") or {}).get("replica")
        at = x["at_ms"] - t0
        out.append((rep, at + q, at + x["ttft_ms"], at + x["e2e_ms"], x["prompt_tokens"], x["output_tokens"]))
    return out


def windows(rows: list[tuple], kind: str):
    xs, ys = [], []
    for (r, s, f, e, p, o) in rows:
        a, b = (f, e) if kind == "decode" else (s, f)
        if b - a < 1 or (kind == "decode" and o < 2):
            continue
        dec = pro = 0.0
        for (r2, s2, f2, e2, p2, o2) in rows:
            if r2 != r:
                continue
            if f2 > s2:
                pro += p2 * max(0.0, min(b, f2) - max(a, s2)) / (f2 - s2)
            if e2 > f2:
                dec += (o2 - 1) * max(0.0, min(b, e2) - max(a, f2)) / (e2 - f2)
        xs.append((dec, pro))
        ys.append(b - a)
    return xs, ys


def fit(xs, ys):
    """y ≈ c1·x1 + c2·x2, least squares on y-relative error."""
    s11 = s12 = s22 = t1 = t2 = 0.0
    for (x1, x2), y in zip(xs, ys):
        w = 1.0 / (y * y)
        s11 += w * x1 * x1
        s12 += w * x1 * x2
        s22 += w * x2 * x2
        t1 += w * x1 * y
        t2 += w * x2 * y
    det = s11 * s22 - s12 * s12
    if abs(det) <= 1e-12 * max(s11 * s22, 1e-300):
        # One kind of token only (no decodes beside a light load's
        # prefills): that one alone.
        if s11 >= s22:
            return (t1 / s11 if s11 else 0.0), 0.0
        return 0.0, (t2 / s22 if s22 else 0.0)
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("| log | span | lines | ms per decode token | ms per prompt token | median error |")
    print("|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        rows = lines_of(path)
        for kind in ("decode", "prefill"):
            xs, ys = windows(rows, kind)
            if len(ys) < 3:
                continue
            c1, c2 = fit(xs, ys)
            err = statistics.median(abs((c1 * a + c2 * b) / y - 1.0) for (a, b), y in zip(xs, ys))
            print(f"| {path} | {kind} | {len(ys)} | {c1:.1f} | {c2:.2f} | {err * 100:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
