"""Runs examples/batch/requests.jsonl as an OpenAI batch against kiln, with
the unmodified `openai` SDK: upload, create, poll (printing kiln's view of
the batch: tier, predicted finish, predicted miss), download, summarise.

    cargo run -- serve --policy policies/enterprise --sim-speed 50
    python3 examples/batch/run.py            # --base-url, --key, --file to change
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path

from openai import OpenAI

FINAL = {"completed", "failed", "expired", "cancelled"}


def when(ts) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--key", default="key-support-prod", help="a tenant's API key (policies/enterprise: support-bot)")
    ap.add_argument("--file", default=str(Path(__file__).with_name("requests.jsonl")))
    ap.add_argument("--timeout", type=float, default=600.0, help="give up polling after this many seconds")
    ap.add_argument("--save", metavar="DIR", help="write the output and error files here")
    a = ap.parse_args()

    client = OpenAI(base_url=a.base_url, api_key=a.key, max_retries=2)
    path = Path(a.file)
    with path.open("rb") as f:
        up = client.files.create(file=(path.name, f, "application/jsonl"), purpose="batch")
    print(f"uploaded {up.filename}: {up.id}, {up.bytes} bytes")
    batch = client.batches.create(
        input_file_id=up.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"example": "examples/batch"},
    )
    k = batch.model_extra.get("kiln") or {}
    print(
        f"created {batch.id}: {batch.status}, {batch.request_counts.total} requests, "
        f"tier {k.get('tier')}, expires {when(batch.expires_at)}, "
        f"predicted finish {when(k.get('predicted_finish_at'))}, predicted miss {k.get('predicted_miss')}"
    )

    start = time.monotonic()
    last = None
    while True:
        batch = client.batches.retrieve(batch.id)
        k = batch.model_extra.get("kiln") or {}
        c = batch.request_counts
        line = (
            f"[{time.monotonic() - start:6.1f}s] {batch.status:<11} {c.completed + c.failed:>4}/{c.total} "
            f"(failed {c.failed})  tier {k.get('tier')}  predicted finish {when(k.get('predicted_finish_at'))}  "
            f"predicted miss {k.get('predicted_miss')}  gpu-s {k.get('gpu_seconds')}"
        )
        if line.split("]", 1)[1] != last:
            print(line, flush=True)
            last = line.split("]", 1)[1]
        if batch.status in FINAL:
            break
        if time.monotonic() - start > a.timeout:
            print(f"still {batch.status} after {a.timeout:.0f}s; giving up (the batch keeps running)")
            return 1
        time.sleep(0.5)

    results = []
    if batch.output_file_id:
        text = client.files.content(batch.output_file_id).text
        results = [json.loads(l) for l in text.splitlines() if l.strip()]
        print(f"output: {len(results)} lines")
        if a.save:
            out = Path(a.save) / f"{batch.id}_output.jsonl"
            out.write_text(text)
            print(f"  saved to {out}")
    errors = []
    if batch.error_file_id:
        text = client.files.content(batch.error_file_id).text
        errors = [json.loads(l) for l in text.splitlines() if l.strip()]
        print(f"errors: {len(errors)} lines")
        if a.save:
            (Path(a.save) / f"{batch.id}_error.jsonl").write_text(text)
        for e in errors[:5]:
            print("  ", e["custom_id"], e.get("error") or e["response"]["status_code"])

    prompt = completion = capped = 0
    for r in results:
        u = r["response"]["body"].get("usage") or {}
        prompt += u.get("prompt_tokens", 0)
        completion += u.get("completion_tokens", 0)
        # custom_id carries the trace's generated-token count: conv-NNN-ctxC-genG
        want = int(r["custom_id"].rsplit("-gen", 1)[1])
        capped += u.get("completion_tokens", 0) < want
    k = batch.model_extra.get("kiln") or {}
    took = (batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at or 0) - batch.created_at
    print(
        f"\n{batch.id} {batch.status} in {took}s: {batch.request_counts.completed} completed, "
        f"{batch.request_counts.failed} failed of {batch.request_counts.total}\n"
        f"tokens: {prompt} prompt, {completion} generated ({capped} answers shorter than the trace's count)\n"
        f"kiln: tier {k.get('tier')}, gpu-seconds {k.get('gpu_seconds')}, cost {k.get('cost')}, "
        f"deadline misses {k.get('deadline_misses')}"
    )
    ids = [r["custom_id"] for r in results] + [e["custom_id"] for e in errors]
    if len(ids) != len(set(ids)) or len(ids) != batch.request_counts.total:
        print(f"MISMATCH: {len(ids)} result lines, {len(set(ids))} distinct, {batch.request_counts.total} requests")
        return 1
    return 0 if batch.status == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
