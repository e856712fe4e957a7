"""The Files and Batches API through the unmodified OpenAI Python SDK:
`kiln serve` on the shipped enterprise policy, simulated GPUs at 50x, a batch
store of its own under the test's temporary directory."""

from __future__ import annotations

import hashlib
import json
import time

import openai
import pytest
from openai import OpenAI

from conftest import run_kiln

KEY = "key-support-prod"  # policies/enterprise: tenant support-bot (its only key)
OTHER_KEY = "key-enrichment-test"  # given to tenant enrichment by the config below
MODEL = "llama-70b"
TIMEOUT = 30.0
FINAL = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture(scope="module")
def kiln(tmp_path_factory):
    d = tmp_path_factory.mktemp("kiln-batches")
    # A second tenant with a key: the policy declares keys for support-bot
    # only; a config's [[keys]] (hashed) add one for enrichment, and the
    # policy's keys still apply (`policy_keys` defaults to true).
    cfg = d / "kiln.toml"
    digest = hashlib.sha256(OTHER_KEY.encode()).hexdigest()
    cfg.write_text(f'[[keys]]\nsha256 = "{digest}"\ntenant = "enrichment"\n')
    with run_kiln(
        [
            "--policy",
            "policies/enterprise",
            "--config",
            str(cfg),
            "--sim-speed",
            "50",
            "--batch-store",
            str(d / "batches.db"),
        ],
        d / "kiln-batches.log",
    ) as k:
        yield k


def sdk(kiln, key):
    # max_retries=0: the SDK would otherwise retry 429/5xx and hide them.
    return OpenAI(base_url=f"{kiln.base}/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def client(kiln):
    c = sdk(kiln, KEY)
    yield c
    c.close()


@pytest.fixture(scope="module")
def other(kiln):
    c = sdk(kiln, OTHER_KEY)
    yield c
    c.close()


def line(custom_id: str, content: str, max_tokens: int, model: str = MODEL) -> str:
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
            },
        }
    )


def jsonl(n: int, max_tokens: int = 8, prefix: str = "req") -> bytes:
    return "".join(
        line(f"{prefix}-{i}", f"summarise ticket {i}", max_tokens) + "\n" for i in range(n)
    ).encode()


def upload(client, data: bytes, name: str = "in.jsonl"):
    return client.files.create(file=(name, data, "application/jsonl"), purpose="batch")


def wait(client, batch_id: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in FINAL:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status} after {timeout}s: {b}"
        time.sleep(0.2)


def ids(text: str) -> dict[str, int]:
    seen: dict[str, int] = {}
    for l in text.splitlines():
        if l.strip():
            cid = json.loads(l)["custom_id"]
            seen[cid] = seen.get(cid, 0) + 1
    return seen


@pytest.fixture(scope="module")
def finished(client):
    """One small batch, run to completion (shared by the tests that read it)."""
    f = upload(client, jsonl(30), "tickets.jsonl")
    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "sdk-test"},
    )
    return f, b, wait(client, b.id)


@pytest.mark.timeout(120)
def test_upload_create_poll_download(client, finished):
    f, created, done = finished
    assert f.object == "file" and f.purpose == "batch" and f.filename == "tickets.jsonl"
    assert f.bytes == len(jsonl(30))
    assert created.object == "batch"
    assert created.status in ("validating", "in_progress")
    assert created.input_file_id == f.id
    assert created.endpoint == "/v1/chat/completions"
    assert created.completion_window == "24h"
    assert created.metadata == {"job": "sdk-test"}
    assert created.request_counts.total == 30
    # kiln's own view rides along as an extra field the SDK keeps.
    k = created.model_extra["kiln"]
    assert k["tier"] == "interactive", k  # support-bot's requests classify there
    assert "predicted_finish_at" in k and "predicted_miss" in k, k

    assert done.status == "completed", done
    assert done.request_counts.total == 30
    assert done.request_counts.completed == 30, done
    assert done.request_counts.failed == 0, done
    assert done.completed_at >= done.created_at
    assert done.in_progress_at is not None and done.finalizing_at is not None
    assert done.error_file_id is None
    assert done.model_extra["kiln"]["gpu_seconds"] > 0, done

    out = client.files.content(done.output_file_id).text
    seen = ids(out)
    assert seen == {f"req-{i}": 1 for i in range(30)}
    for l in out.splitlines():
        r = json.loads(l)
        assert r["error"] is None, r
        assert r["id"].startswith("batch_req_"), r
        assert r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        assert body["object"] == "chat.completion", body
        assert body["model"] == MODEL
        assert body["choices"][0]["message"]["content"], body
        assert body["usage"]["completion_tokens"] <= 8, body
    # The input file reads back as uploaded.
    assert client.files.content(f.id).content == jsonl(30)


@pytest.mark.timeout(60)
def test_files_list_retrieve_delete(client, finished):
    f, _, done = finished
    got = client.files.retrieve(f.id)
    assert got.id == f.id and got.bytes == f.bytes and got.purpose == "batch"
    listed = [x.id for x in client.files.list()]
    assert f.id in listed and done.output_file_id in listed, listed
    assert [x.id for x in client.files.list(purpose="batch")].count(f.id) == 1
    outf = client.files.retrieve(done.output_file_id)
    assert outf.purpose == "batch_output"
    assert outf.bytes == len(client.files.content(done.output_file_id).content)

    # An input file of a finished batch can go; then it is gone.
    extra = upload(client, jsonl(2, prefix="gone"))
    r = client.files.delete(extra.id)
    assert r.id == extra.id and r.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(extra.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(extra.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(extra.id)
    assert extra.id not in [x.id for x in client.files.list()]


@pytest.mark.timeout(60)
def test_a_bad_line_is_named_and_nothing_is_stored(client):
    before = [x.id for x in client.files.list()]
    data = jsonl(2) + (line("bad", "hi", 8, model="gpt-nope") + "\n").encode() + jsonl(2, prefix="after")
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, data, "bad.jsonl")
    assert "line 3" in e.value.message and "body.model" in e.value.message, e.value.message
    assert e.value.param == "body.model", e.value.body
    assert e.value.code == "invalid_batch_line", e.value.body
    # A line that is not JSON, and a repeated custom_id, are named too.
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, jsonl(1) + b'{"custom_id": "x",\n')
    assert "line 2" in e.value.message and "`line`" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, jsonl(3) + jsonl(1))
    assert "line 4" in e.value.message and "custom_id" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        upload(
            client,
            json.dumps(
                {
                    "custom_id": "s",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
                }
            ).encode(),
        )
    assert "line 1" in e.value.message and "body.stream" in e.value.message, e.value.message
    assert [x.id for x in client.files.list()] == before


@pytest.mark.timeout(60)
def test_another_tenant_sees_nothing(client, other, finished):
    f, _, done = finished
    for call in (
        lambda: other.batches.retrieve(done.id),
        lambda: other.batches.cancel(done.id),
        lambda: other.files.retrieve(f.id),
        lambda: other.files.content(f.id),
        lambda: other.files.content(done.output_file_id),
        lambda: other.files.delete(f.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [b.id for b in other.batches.list()] == []
    assert [x.id for x in other.files.list()] == []
    # Nor can it batch the first tenant's file.
    with pytest.raises(openai.BadRequestError):
        other.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    # The first tenant still has it all.
    assert client.files.retrieve(f.id).id == f.id
    assert client.batches.retrieve(done.id).status == "completed"


@pytest.mark.timeout(60)
def test_list_and_paginate(client):
    f = upload(client, jsonl(2, prefix="page"))
    made = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    everything = client.batches.list(limit=100)
    all_ids = [b.id for b in everything.data]
    assert everything.has_more is False
    # Newest first.
    assert all_ids[:3] == made[::-1], all_ids
    p1 = client.batches.list(limit=2)
    assert [b.id for b in p1.data] == all_ids[:2]
    assert p1.has_more is True
    p2 = client.batches.list(limit=2, after=p1.data[-1].id)
    assert [b.id for b in p2.data] == all_ids[2:4]
    # The SDK's auto-pagination (`after` = the last id) visits each once.
    assert [b.id for b in client.batches.list(limit=2)] == all_ids
    for b in made:
        assert wait(client, b).status == "completed"


@pytest.mark.timeout(150)
def test_cancel_accounts_for_every_item(client):
    n = 400
    f = upload(client, jsonl(n, max_tokens=4000, prefix="long"))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    # A running batch's input file cannot be deleted.
    with pytest.raises(openai.ConflictError):
        client.files.delete(f.id)
    time.sleep(0.5)
    c = client.batches.cancel(b.id)
    assert c.id == b.id
    assert c.status in ("cancelling", "cancelled"), c
    done = wait(client, b.id)
    assert done.status == "cancelled", done
    assert done.cancelled_at is not None and done.cancelling_at is not None
    seen: dict[str, int] = {}
    for fid in (done.output_file_id, done.error_file_id):
        if fid:
            for k, v in ids(client.files.content(fid).text).items():
                seen[k] = seen.get(k, 0) + v
    assert seen == {f"long-{i}": 1 for i in range(n)}
    assert done.error_file_id, done  # some items never ran
    errs = [json.loads(l) for l in client.files.content(done.error_file_id).text.splitlines()]
    assert any(e["error"] and e["error"]["code"] == "batch_cancelled" for e in errs), errs[:3]
    # Over: cancelling again is refused.
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)
    # Now the file can go.
    assert client.files.delete(f.id).deleted is True
