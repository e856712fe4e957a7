#!/usr/bin/env python3
"""Engine-aware upstream against a hand-set `concurrency` near saturation
(issue #28, item 2's target).

One llama.cpp `llama-server` (parallel slots, `--metrics`) behind `kiln
serve`; two tenants share it: `chat` on an interactive tier (priority 100)
and `bulk` on a batch tier (priority 10). The same arrivals (the Azure
slice's shape at `--rate` req/s, a seeded `--interactive` share of them
chat) are driven through the gateway once per setting:

- `concurrency = N` for each N of `--sweep` (engine = "openai": kiln sends
  up to N; past the engine's slots the rest wait in llama.cpp's own FIFO
  queue, where priority no longer orders them);
- engine-aware: `engine = "llama.cpp"`, `concurrency` = the sweep's largest
  N as the ceiling, `max_engine_waiting = 0` (send only while nothing waits
  in the engine), scraped every `--scrape` .

Reported per setting: the chat tier's TTFT p50/p95, the batch tier's TTFT
p95, output throughput, from the gateway's decision log; and how often
`/admin/queues` (polled every 0.5 s) showed the engine gate ok, saturated
or in fallback.

    python3 scripts/engine_sweep.py [--slots 4 --sweep 2,4,8 --rate 1.0 --duration 60]

Reuses scripts/fidelity.py (the trace, the client, llama-server lookup).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity as F  # noqa: E402

POLICY = """\
pool cpu {{
  gpus 1
  kind "llama.cpp CPU"
  memory 2GB
}}

model smollm2 {{
  params 135M
  kv_per_token 23KB
  variant q4 {{
    precision int4
    memory 100MB
    pools [cpu]
    max_batch {max_batch}
    max_batch_tokens 2048
  }}
}}

tier interactive {{
  priority 100
  slo {{ p95 10s }}
}}

tier batch {{
  priority 10
  slo {{ p95 5m }}
}}

tenant chat {{
  owner "chat@example.com"
  tiers [interactive]
  quota {{ requests 100000/min concurrent 10000 }}
  api_keys ["key-chat"]
}}

tenant bulk {{
  owner "bulk@example.com"
  tiers [batch]
  quota {{ requests 100000/min concurrent 10000 }}
  api_keys ["key-bulk"]
}}

classify {{
  when tenant == chat => tier interactive
  default => tier batch
}}

route [interactive, batch] smollm2 {{
  default => q4 on cpu
}}

admit [interactive, batch] {{
  default => accept
}}
"""


def send(base: str, r: dict, results: list, i: int):
    key = "key-chat" if r["chat"] else "key-bulk"
    host, port = base.split("//")[1].split(":")
    import http.client

    body = json.dumps(
        {"model": "smollm2", "prompt": r["text"], "max_tokens": r["output"], "stream": True,
         "ignore_eos": True, "cache_prompt": False, "temperature": 1.0}
    )  # fmt: skip
    t0 = time.monotonic()
    first = None
    status = 0
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=600)
        c.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        resp = c.getresponse()
        status = resp.status
        while True:
            line = resp.readline()
            if not line:
                break
            if first is None and line.startswith(b"data:") and b'"text"' in line:
                first = time.monotonic()
        c.close()
    except OSError as e:
        status = -1
        print(f"request {i}: {e}", file=sys.stderr)
    results[i] = {"status": status, "ttft": (first - t0) if first else None, "e2e": time.monotonic() - t0}


def drive(base: str, reqs: list[dict]) -> list:
    results: list = [None] * len(reqs)
    threads = []
    start = time.monotonic()
    for i, r in enumerate(reqs):
        delay = start + r["t"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=send, args=(base, r, results, i), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout=900)
    return results


def engine_states(node, out: dict):
    """Counts the `state` of every engine gate found in an /admin/queues
    answer (ok, saturated, fallback)."""
    if isinstance(node, dict):
        if "engine" in node and isinstance(node.get("state"), str) and "ceiling" in node:
            out[node["state"]] = out.get(node["state"], 0) + 1
        for v in node.values():
            engine_states(v, out)
    elif isinstance(node, list):
        for v in node:
            engine_states(v, out)


def sample_queues(base: str, stop: threading.Event, out: dict, every: float = 0.5):
    """Polls GET /admin/queues until `stop`; tallies the engine gate states."""
    import urllib.request

    while not stop.is_set():
        try:
            with urllib.request.urlopen(base + "/admin/queues", timeout=2) as r:
                engine_states(json.loads(r.read()), out)
        except (OSError, ValueError):
            out["unreadable"] = out.get("unreadable", 0) + 1
        stop.wait(every)


def summarize(log: Path) -> dict:
    lines = []
    for raw in log.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            pass
    served = [x for x in lines if x.get("ttft_ms") is not None and x.get("e2e_ms") is not None]
    tier = lambda x: (x.get("decision") or {}).get("tier")  # noqa: E731
    chat = [x["ttft_ms"] for x in served if tier(x) == "interactive"]
    bulk = [x["ttft_ms"] for x in served if tier(x) == "batch"]
    t0 = min(x["at_ms"] for x in lines)
    t1 = max(x["at_ms"] + x["e2e_ms"] for x in served)
    return {
        "requests": len(lines),
        "served": len(served),
        "chat_ttft_p50": F.pct(chat, 0.5),
        "chat_ttft_p95": F.pct(chat, 0.95),
        "batch_ttft_p95": F.pct(bulk, 0.95),
        "throughput": sum(x.get("output_tokens", 0) for x in served) / max(1e-9, (t1 - t0) / 1e3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default=str(F.REPO / "target" / "debug" / "kiln"))
    ap.add_argument("--llama-server")
    ap.add_argument("--model")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sweep", default="2,4,8", help="hand-set concurrency values")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--interactive", type=float, default=0.3, help="share of requests on the chat tenant")
    ap.add_argument("--scrape", default="250ms")
    ap.add_argument("--token-scale", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--engine-only", action="store_true", help="run only the engine-aware setting")
    ap.add_argument("--out", default=str(F.REPO / "target" / "engine-sweep"))
    a = ap.parse_args()

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sweep = [int(x) for x in a.sweep.split(",")]
    ceiling = max(sweep)
    server = F.find_llama_server(a.llama_server)
    model = F.find_model(a.model)
    trace = F.trace_slice(F.TRACE, 4000, a.token_scale, a.seed)
    reqs = F.at_rate(trace, a.rate, a.duration)
    rng = random.Random(a.seed)
    for r in reqs:
        r["chat"] = rng.random() < a.interactive

    settings = [] if a.engine_only else [(f"concurrency = {n}", n, None) for n in sweep]
    settings.append((f"engine-aware (ceiling {ceiling})", ceiling, "llama.cpp"))
    rows = []
    for label, conc, engine in settings:
        port = F.free_port()
        n = len(rows) + (len(sweep) if a.engine_only else 0)
        llog = out / f"llama-{n}.log"
        cmd = [
            server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(a.threads), "--threads-batch", str(a.threads),
            "--parallel", str(a.slots), "--cont-batching", "--metrics",
            "--ctx-size", str(a.slots * 1024), "--batch-size", "2048", "--no-webui", "--log-disable",
        ]  # fmt: skip
        with open(llog, "wb") as f:
            lp = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=F.renice(a.nice))
        try:
            url = f"http://127.0.0.1:{port}"
            F.wait_http(url, lp, llog)
            pdir = out / f"policy-{n}"
            pdir.mkdir(exist_ok=True)
            (pdir / "sweep.kiln").write_text(POLICY.format(max_batch=max(conc, a.slots)))
            eng = (
                f'engine = "{engine}"\nscrape_interval = "{a.scrape}"\nscrape_timeout = "{a.scrape}"\nmax_engine_waiting = 0\n'
                if engine
                else ""
            )
            config = out / f"kiln-{n}.toml"
            config.write_text(
                f'[pools.cpu]\nbackend = "http"\n\n[[pools.cpu.upstreams]]\nmodel = "smollm2"\nvariant = "q4"\n'
                f'url = "{url}"\nserved_model = "smollm2"\nconcurrency = {conc}\ntimeout = "600s"\n'
                f'health_path = "/health"\nhealth_interval = "2s"\n{eng}\n'
                f'[sim]\ncalibration = "{F.REPO / "examples" / "llama" / "calibration.toml"}"\n'
            )
            dlog = out / f"decisions-{n}.jsonl"
            klog = out / f"kiln-{n}.log"
            with open(klog, "wb") as f:
                k = subprocess.Popen(
                    [a.kiln, "serve", "--policy", str(pdir), "--config", str(config), "--listen", "127.0.0.1:0", "--log", str(dlog)],
                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=F.renice(a.nice), cwd=out,
                )  # fmt: skip
            addr = None
            deadline = time.monotonic() + 60
            while addr is None and time.monotonic() < deadline:
                m = F.LISTENING.search(klog.read_text(errors="replace"))
                if m:
                    addr = m.group(1)
                elif k.poll() is not None:
                    F.die(f"kiln serve exited:\n{klog.read_text(errors='replace')[-3000:]}")
                else:
                    time.sleep(0.2)
            if addr is None:
                F.stop(k)
                F.die("kiln serve did not start")
            time.sleep(1.0)  # a first scrape
            print(f"{label}: {len(reqs)} requests at {a.rate} req/s …", file=sys.stderr, flush=True)
            states: dict = {}
            halt = threading.Event()
            sampler = threading.Thread(target=sample_queues, args=(f"http://{addr}", halt, states), daemon=True)
            sampler.start()
            client = drive(f"http://{addr}", reqs)
            halt.set()
            sampler.join(timeout=5)
            F.stop(k)
            bad = sum(1 for r in client if r is None or r["status"] != 200)
            s = summarize(dlog)
            s.update(label=label, failed=bad, engine_states=states)
            rows.append(s)
            print(f"  {s}", file=sys.stderr, flush=True)
        finally:
            F.stop(lp)

    ms = lambda v: "–" if v is None else f"{v:.0f} ms"  # noqa: E731
    md = ["| setting | chat TTFT p50 | chat TTFT p95 | batch TTFT p95 | throughput | failed |", "|---|---|---|---|---|---|"]
    for s in rows:
        md.append(
            f"| {s['label']} | {ms(s['chat_ttft_p50'])} | {ms(s['chat_ttft_p95'])} | {ms(s['batch_ttft_p95'])} | "
            f"{s['throughput']:.1f} tok/s | {s['failed']} |"
        )
    print("\n".join(md))
    (out / "table.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
