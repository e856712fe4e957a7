"""The poison-items scenario of tests/batch_faults.rs against a kiln binary,
as a process, so that two builds can be compared (issue 30):

    python3 scripts/batch_poison.py target/debug/kiln [--items 1000] [--poison-every 50]
        [--interactive 40] [--no-batch] [--bound 60]

A loopback mock upstream answers 500 at once to
items req-N with N % 50 == 7 (2%; --poison-every 0: none), 200 after 40 ms
to the rest; breaker opens after 2 failures in a row for 2 s. 1,000 items
and 40 interactive requests alongside, 100 ms apart (their latencies are
reported: the mock answers whole, so the time to the answer is the time to
the first token); bounded to 60 s. --no-batch sends the interactive
requests alone, the baseline of their latency. Prints one JSON line."""
import argparse, json, os, socket, statistics, subprocess, sys, tempfile, threading, time, collections
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
import requests

ap = argparse.ArgumentParser()
ap.add_argument("binary")
ap.add_argument("--items", type=int, default=1000)
ap.add_argument("--poison-every", type=int, default=50)
ap.add_argument("--interactive", type=int, default=40)
ap.add_argument("--no-batch", action="store_true")
ap.add_argument("--bound", type=float, default=60.0)
# The interactive tier's TTFT SLO. On an upstream kiln preempts a batch
# call for it only when waiting for a slot would take over half of it
# (a cancelled upstream call loses all its work), so a tight one shows
# preemption, a loose one patience.
ap.add_argument("--ttft", default="5s")
a = ap.parse_args()
EVERY = a.poison_every

def poisoned(p):
    return EVERY > 0 and p.startswith("req-") and int(p[4:]) % EVERY == 7

calls = collections.Counter(); lock = threading.Lock()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, obj):
        b = json.dumps(obj).encode()
        self.send_response(code); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self): self._send(200, {"ok": True})
    def do_POST(self):
        n = int(self.headers.get("content-length", 0)); req = json.loads(self.rfile.read(n))
        p = req["messages"][0]["content"]
        with lock: calls[p] += 1
        if poisoned(p):
            return self._send(500, {"error": {"message": "always fails"}})
        time.sleep(0.04)
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "up",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " + p}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
up = ThreadingHTTPServer(("127.0.0.1", 0), H); threading.Thread(target=up.serve_forever, daemon=True).start()
d = tempfile.mkdtemp()
open(f"{d}/p.kiln", "w").write('''
pool gpu { gpus 1 kind "H100-80GB" memory 80GB }
model tiny {
  params 1B
  kv_per_token 32KB
  variant fp16 { memory 4GB pools [gpu] max_batch 16 }
}
tier interactive { priority 100 slo { ttft %TTFT% } preempts [batch] }
tier batch { priority 10 slo { window 24h } preemptible }
tenant alpha { owner "a@x" tiers [interactive, batch] api_keys ["k-alpha"] }
classify {
  when batch => tier batch
  default => tier interactive
}
route [interactive, batch] tiny { default => fp16 }
'''.replace("%TTFT%", a.ttft))
open(f"{d}/k.toml", "w").write(f'''[pools.gpu]
backend = "http"
[[pools.gpu.upstreams]]
model = "tiny"
variant = "fp16"
url = "http://127.0.0.1:{up.server_address[1]}"
concurrency = 16
timeout = "10s"
health_interval = "200ms"
failure_threshold = 2
open_for = "2s"
''')
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
gw = subprocess.Popen([a.binary, "serve", "--policy", f"{d}/p.kiln", "--config", f"{d}/k.toml",
    "--listen", f"127.0.0.1:{port}", "--batch-store", f"{d}/b.db"], stdout=subprocess.DEVNULL, stderr=open(f"{d}/log", "w"))
base = f"http://127.0.0.1:{port}"; H_ = {"authorization": "Bearer k-alpha"}
try:
    for _ in range(100):
        try:
            if requests.get(base + "/healthz", timeout=1).ok: break
        except Exception: time.sleep(0.1)
    N = a.items
    b = None
    if not a.no_batch:
        lines = "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"req-{i}"}], "max_tokens": 8}}) + "\n" for i in range(N))
        f = requests.post(base + "/v1/files", headers=H_, files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"}, timeout=120).json()
        b = requests.post(base + "/v1/batches", headers=H_, json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}, timeout=30).json()
    t0 = time.time(); statuses = collections.Counter(); opened = 0; lat = []; slow = []; queued = []
    def inter():
        for i in range(a.interactive):
            s0 = time.time()
            r = requests.post(base + "/v1/chat/completions", headers=H_, json={"model": "tiny", "messages": [{"role": "user", "content": f"online-{i}"}], "max_tokens": 8}, timeout=30)
            statuses[r.status_code] += 1
            if r.status_code == 200:
                lat.append(time.time() - s0)
                # kiln's own part of the wait: time in its queue before the
                # upstream call began (the rest is the upstream and the wire).
                queued.append(float(r.headers.get("x-kiln-queue-ms") or 0) / 1000)
                slow.append((round(time.time() - s0, 3), round(s0 - t0, 2), r.headers.get("x-kiln-queue-ms"), r.headers.get("x-kiln-waited-for")))
            time.sleep(0.1)
    th = threading.Thread(target=inter); th.start()
    done = None
    while time.time() - t0 < a.bound:
        q = requests.get(base + "/admin/queues", timeout=5).json()
        if not all(r["available"] and r["up"] for r in q["replicas"]): opened += 1
        if b is None:
            if not th.is_alive(): break
        else:
            bb = requests.get(base + f"/v1/batches/{b['id']}", headers=H_, timeout=5).json()
            if bb["status"] in ("completed", "failed", "expired", "cancelled"): done = bb; break
        time.sleep(0.05)
    took = time.time() - t0
    th.join(timeout=a.bound)
    poison = [k for k in calls if poisoned(k)]
    qs = lambda xs, p: round(1000 * statistics.quantiles(xs, n=100)[p - 1], 1) if len(xs) >= 2 else None
    q = lambda p: qs(lat, p)
    pc = collections.Counter(calls[k] for k in poison)
    print(json.dumps({"binary": a.binary, "items": 0 if a.no_batch else N, "poison_every": EVERY, "terminal": done is not None, "status": done and done["status"],
        "counts": done and done["request_counts"], "seconds": round(took, 2),
        "polls_with_breaker_not_closed": opened, "interactive_statuses": dict(statuses),
        "interactive_ms_p50_p99": [q(50), q(99)],
        "interactive_kiln_queue_ms_p50_p99": [qs(queued, 50), qs(queued, 99)],
        "interactive_slowest": sorted(slow, reverse=True)[:3],
        "tries_per_poison_item": dict(pc), "breaker_opened_log_lines": open(f"{d}/log").read().count("circuit breaker opened")}))
finally:
    gw.terminate(); gw.wait(timeout=10); up.shutdown()
