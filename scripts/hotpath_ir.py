#!/usr/bin/env python3
"""Instructions a request costs in `kiln serve` and in the bare passthrough.

`benches/gateway.rs` times kiln against a bare axum + reqwest passthrough,
but on a small shared machine its timings move by more than the changes
being measured. This counts instead: each server runs under valgrind's
callgrind (instructions executed, the same on every run), the same small
chat completion `benches/gateway.rs` sends goes through it N times over
keep-alive connections to `mock_upstream`, and the instructions of two runs
(WARM + LOW and WARM + HIGH requests) are subtracted, so start-up (policy,
tokenizer tables) cancels out:

    Ir per request = (Ir(HIGH) - Ir(LOW)) / (HIGH - LOW)

Usage (after `cargo build --release --bin kiln --example mock_upstream` and
`cargo bench --bench gateway --no-run`):

    scripts/hotpath_ir.py [--kiln target/release/kiln] [--top 40]

It prints instructions per request for kiln and the passthrough, their
ratio, and with `--top N` the N functions with the most instructions per
request in kiln (inclusive), from the same two runs. Needs `valgrind`
(Debian package). Everything is on 127.0.0.1; every child is stopped.
"""

import argparse
import glob
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY = json.dumps(
    {
        "model": "mock-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write one short sentence about kilns."},
        ],
        "max_tokens": 16,
    },
    separators=(",", ":"),
).encode()


def wait_url(path, what, timeout=120.0):
    """The address after `what` in a child's log."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if what in line:
                        m = re.search(r"http://127\.0\.0\.1:\d+", line.split(what, 1)[1])
                        if m:
                            return m.group(0)
        except FileNotFoundError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no '{what}' in {path} after {timeout:.0f} s")


def send(url, n, conns=4):
    """n requests over `conns` keep-alive connections; every answer must be a 200."""
    host, port = url.removeprefix("http://").split(":")
    left = [n]
    lock = threading.Lock()
    failed = []

    def worker():
        c = http.client.HTTPConnection(host, int(port), timeout=120)
        while True:
            with lock:
                if left[0] == 0:
                    break
                left[0] -= 1
            c.request(
                "POST",
                "/v1/chat/completions",
                body=BODY,
                headers={
                    "authorization": "Bearer key-bench",
                    "content-type": "application/json",
                },
            )
            r = c.getresponse()
            r.read()
            if r.status != 200:
                failed.append(r.status)
        c.close()

    ts = [threading.Thread(target=worker) for _ in range(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if failed:
        raise SystemExit(f"{len(failed)} requests failed (first status {failed[0]})")


def one_run(kind, kiln, mock, passthrough, n, warm, tmp):
    """Ir of a server's process for warm + n requests (start-up included): the dump file."""
    d = tempfile.mkdtemp(dir=tmp)
    mlog = os.path.join(d, "mock.log")
    procs = []
    try:
        with open(mlog, "w") as f:
            procs.append(
                subprocess.Popen(
                    [mock, "--listen", "127.0.0.1:0", "--tokens", "16", "--workers", "1"],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
        murl = wait_url(mlog, "listening on")
        out = os.path.join(d, "callgrind.out")
        vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        slog = os.path.join(d, "server.log")
        env = dict(os.environ, RUST_LOG="warn")
        if kind == "kiln":
            with open(os.path.join(REPO, "benches/gateway/kiln.toml")) as f:
                cfg = f.read().replace("@UPSTREAM@", murl)
            cfg += f'\n[batch]\nstore = "{os.path.join(d, "b.db")}"\n'
            cpath = os.path.join(d, "kiln.toml")
            with open(cpath, "w") as f:
                f.write(cfg)
            cmd = vg + [
                kiln,
                "serve",
                "--policy",
                os.path.join(REPO, "benches/gateway/gateway.kiln"),
                "--config",
                cpath,
                "--listen",
                "127.0.0.1:0",
            ]
            what = "kiln gateway listening on"
        else:
            cmd = vg + [passthrough, "--passthrough-serve", murl]
            what = "passthrough listening on"
        with open(slog, "w") as f:
            server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        procs.append(server)
        url = wait_url(slog, what, timeout=300)
        send(url, warm)
        send(url, n)
        subprocess.run(
            ["callgrind_control", "-d", str(server.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The dump is written by the server's own threads: wait for it.
        dump = out + ".1"
        for _ in range(100):
            if os.path.exists(dump) and os.path.getsize(dump) > 0:
                break
            time.sleep(0.2)
        time.sleep(1.0)
        return dump
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def functions(dump, inclusive):
    """{function: Ir} from callgrind_annotate."""
    out = subprocess.run(
        ["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}", "--threshold=100", dump],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    d = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$", line)
        if m:
            name = re.sub(r" \[[^\]]*\]$", "", m.group(2))
            d[name] = d.get(name, 0) + int(m.group(1).replace(",", ""))
    return d


def per_request(kind, args, tmp):
    low = one_run(kind, args.kiln, args.mock, args.passthrough, args.low, args.warm, tmp)
    high = one_run(kind, args.kiln, args.mock, args.passthrough, args.high, args.warm, tmp)
    n = args.high - args.low
    a, b = functions(low, False), functions(high, False)
    total = (b["PROGRAM TOTALS"] - a["PROGRAM TOTALS"]) / n
    top = []
    if args.top and kind == "kiln":
        a, b = functions(low, True), functions(high, True)
        top = sorted(((b[k] - a.get(k, 0)) / n, k) for k in b if k != "PROGRAM TOTALS")
        top = [t for t in reversed(top) if "kiln::" in t[1]][: args.top]
    return total, top


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default=os.path.join(REPO, "target/release/kiln"))
    ap.add_argument("--mock", default=os.path.join(REPO, "target/release/examples/mock_upstream"))
    ap.add_argument("--passthrough", default=None, help="the gateway bench binary (newest by default)")
    ap.add_argument("--warm", type=int, default=200)
    ap.add_argument("--low", type=int, default=500)
    ap.add_argument("--high", type=int, default=2500)
    ap.add_argument("--top", type=int, default=0, help="list kiln's N costliest functions per request")
    ap.add_argument("--skip-passthrough", action="store_true")
    args = ap.parse_args()
    if args.passthrough is None:
        benches = [
            p
            for p in glob.glob(os.path.join(REPO, "target/release/deps/gateway-*"))
            if not p.endswith(".d") and os.access(p, os.X_OK)
        ]
        if not benches and not args.skip_passthrough:
            raise SystemExit("no gateway bench binary: cargo bench --bench gateway --no-run")
        args.passthrough = max(benches, key=os.path.getmtime) if benches else None
    with tempfile.TemporaryDirectory() as tmp:
        kiln, top = per_request("kiln", args, tmp)
        print(f"kiln: {kiln:,.0f} instructions per request")
        if not args.skip_passthrough:
            bare, _ = per_request("passthrough", args, tmp)
            print(f"passthrough: {bare:,.0f} instructions per request")
            print(f"kiln / passthrough: {kiln / bare:.2f}x")
        for ir, name in top:
            print(f"{ir:10,.0f}  {name[:150]}")


if __name__ == "__main__":
    sys.exit(main())
