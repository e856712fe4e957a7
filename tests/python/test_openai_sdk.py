"""`kiln serve` on the shipped enterprise policy, simulated GPUs, driven by the
unmodified OpenAI Python SDK: what a team pointing its existing client at the
gateway sees."""

from __future__ import annotations

import json
import signal

import openai
import pytest
from openai import OpenAI

from conftest import run_kiln

KEY = "key-support-prod"  # policies/enterprise: tenant support-bot, tier interactive
MODEL = "llama-70b"
MSGS = [{"role": "user", "content": "Where is my order #1234?"}]
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def kiln(kiln_log_dir):
    with run_kiln(
        ["--policy", "policies/enterprise", "--sim-speed", "50"], kiln_log_dir / "kiln-sdk.log"
    ) as k:
        yield k


@pytest.fixture(scope="module")
def client(kiln):
    # max_retries=0: the SDK would otherwise retry 429/5xx and hide them.
    c = OpenAI(base_url=f"{kiln.base}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
    yield c
    c.close()


def assert_openai_error(body: bytes):
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def test_health_and_readiness(kiln):
    for path in ("/healthz", "/readyz"):
        status, _, body = kiln.get(path)
        assert status == 200, (path, status, body)


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16)
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content, r
    assert c.finish_reason in ("length", "stop"), r
    assert r.usage is not None
    assert 0 < r.usage.completion_tokens <= 16, r.usage
    assert r.usage.prompt_tokens > 0, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert r.object == "text_completion"
    assert r.model == MODEL
    assert r.choices[0].text, r
    assert r.choices[0].finish_reason in ("length", "stop"), r
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 8, r.usage


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len(chunks) >= 3, chunks
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 2, f"expected several content chunks, got {chunks}"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert all(ch.model == MODEL for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1, "one id for every chunk of a completion"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"]), finishes
    # The usage chunk comes last, with no choices (OpenAI's shape).
    last = chunks[-1]
    assert last.usage is not None, f"no usage in the final chunk: {last}"
    assert last.choices == [], last
    assert 0 < last.usage.completion_tokens <= 24, last.usage
    assert last.usage.completion_tokens >= len(content)
    assert last.usage.prompt_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_streaming_completion_without_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, stream=True))
    assert chunks, "no chunks"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks
    assert all(ch.usage is None for ch in chunks), "usage only when include_usage is asked for"


def test_models_list(client):
    ids = sorted(m.id for m in client.models.list())
    assert ids == ["llama-70b", "llama-8b"], ids


def test_models_retrieve_and_refusals(client, kiln):
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object) == (MODEL, "model"), m
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    err = assert_openai_error(e.value.response.content)
    assert err["code"] == "model_not_found", err
    # The policy has keys: listing models takes one.
    bad = OpenAI(base_url=f"{kiln.base}/v1", api_key="not-a-key", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert assert_openai_error(e.value.response.content)["code"] == "invalid_api_key"
    assert e.value.response.headers.get("x-kiln-explain"), dict(e.value.response.headers)
    bad.close()


def test_refusals_name_their_request_and_explain_it(client, kiln):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MSGS, max_tokens=4)
    h = e.value.response.headers
    rid = h.get("x-kiln-request-id")
    assert rid and h.get("x-kiln-explain") == f"/admin/explain/{rid}", dict(h)
    assert h.get("x-kiln-policy-version") == kiln.version, dict(h)
    msg = assert_openai_error(e.value.response.content)["message"]
    assert "gpt-17" in msg and "llama-70b" in msg, msg
    ex = kiln.get_json(h["x-kiln-explain"])
    assert ex["id"] == rid
    assert any(ev["event"].startswith("refused with 404") for ev in ex["scheduler"]["events"]), ex


def test_fields_the_simulator_cannot_honour_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, n=2)
    err = assert_openai_error(e.value.response.content)
    assert (err["code"], err["param"]) == ("unsupported_parameter", "n"), err
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=4, logit_bias={"1": 5}
        )
    assert assert_openai_error(e.value.response.content)["param"] == "logit_bias"
    # Sampling settings are fine.
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, temperature=0.2, top_p=0.9, seed=3, user="u"
    )
    assert r.choices[0].message.content


def test_the_simulator_answers_tools_formats_and_stops(client):
    """Simulation: placeholders of the shape asked for, so agent and
    structured-output clients run end to end on the demo."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup_order",
                "parameters": {
                    "type": "object",
                    "properties": {"order_id": {"type": "string"}},
                    "required": ["order_id"],
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, tools=tools, tool_choice="required"
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", r
    call = c.message.tool_calls[0]
    assert call.function.name == "lookup_order"
    assert isinstance(json.loads(call.function.arguments)["order_id"], str)
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=12, stop=[" kiln's"]
    )
    assert r.choices[0].message.content == " simulated output from", r
    assert r.choices[0].finish_reason == "stop", r


def test_unserved_endpoints_say_so(client, kiln):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=MODEL, input="hello")
    err = assert_openai_error(e.value.response.content)
    assert err["code"] == "unsupported_endpoint", err
    assert e.value.response.headers.get("x-kiln-request-id")
    status, _, body = kiln.get("/v1/foo")
    assert status == 404
    assert assert_openai_error(body)["code"] == "unknown_url"


def test_raw_response_headers_and_explain(client, kiln):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSGS, max_tokens=8)
    assert raw.headers.get("x-kiln-tier") == "interactive"
    assert raw.headers.get("x-kiln-tenant") == "support-bot"
    assert raw.headers.get("x-kiln-route", "").startswith("llama-70b."), dict(raw.headers)
    assert raw.headers.get("x-kiln-policy-version") == kiln.version
    assert float(raw.headers.get("x-kiln-queue-ms", "nan")) >= 0.0
    rid = raw.headers.get("x-kiln-request-id")
    assert rid, dict(raw.headers)
    parsed = raw.parse()
    assert parsed.choices[0].message.content

    ex = kiln.get_json(f"/admin/explain/{rid}")
    assert ex["id"] == rid
    assert ex["policy_version"] == kiln.version
    assert ex["decision"]["tier"] == "interactive", ex["decision"]
    status, _, text = kiln.get(f"/admin/explain/{rid}?format=text")
    assert status == 200
    assert rid in text.decode()

    status, _, body = kiln.get("/admin/explain/no-such-request")
    assert status == 404
    assert_openai_error(body)


def test_admin_queues_and_metrics(client, kiln):
    client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    kiln.get_json("/admin/queues")
    status, headers, body = kiln.get("/metrics")
    assert status == 200
    assert headers.get("content-type", "").startswith("text/plain"), headers
    text = body.decode()
    assert "kiln_" in text, text[:500]
    assert 'tier="interactive"' in text, "per-tier series after serving interactive requests"


def test_wrong_key_is_401(kiln):
    bad = OpenAI(base_url=f"{kiln.base}/v1", api_key="not-a-key", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    assert e.value.status_code == 401
    assert_openai_error(e.value.response.content)
    bad.close()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MSGS, max_tokens=4)
    assert e.value.status_code == 404
    err = assert_openai_error(e.value.response.content)
    assert err["code"] == "model_not_found", err


def test_malformed_body_is_400_through_the_sdk(client):
    # A chat completion without messages, sent with the SDK's raw `post`.
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body={"model": MODEL, "max_tokens": 4}, cast_to=object)
    assert e.value.status_code == 400
    assert_openai_error(e.value.response.content)


def test_malformed_json_is_400(kiln):
    status, _, body = kiln.post_raw(
        "/v1/chat/completions",
        b'{"model": "llama-70b", "messages": [',
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert status == 400, body
    err = assert_openai_error(body)
    assert err["type"] == "invalid_request_error", err


def test_body_too_large_is_413(kiln):
    big = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    ).encode()
    status, _, body = kiln.post_raw(
        "/v1/chat/completions",
        big,
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert status == 413, body[:500]
    assert_openai_error(body)


def test_sigterm_exits_cleanly(kiln_log_dir):
    with run_kiln(["--policy", "policies/enterprise", "--sim-speed", "50"], kiln_log_dir / "kiln-term.log") as k:
        c = OpenAI(base_url=f"{k.base}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4).choices
        c.close()
        k.proc.send_signal(signal.SIGTERM)
        assert k.proc.wait(timeout=15) == 0, k.log.read_text(errors="replace")[-2000:]
