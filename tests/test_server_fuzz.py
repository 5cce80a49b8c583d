"""No single request may kill, freeze or crash the server.

- The requests that did (each found by hand against the embedded model): every one gets a 4xx in under a second
  that names what is wrong, and a normal request succeeds right after.
- The engine core failing on one request (its test hook, TINYVLLM_TEST_FAIL_TOKEN): that request alone fails (a
  500, or an error event in its stream), the requests beside it finish as they would have, /health stays 200.
- A request's own chat template: refused unless the server trusts them; trusted, one that never ends is stopped
  after its time limit and refused, and /health answers meanwhile.
- A fuzz test: Hypothesis draws request bodies from the server's own request schemas (the pydantic models of
  protocol.py) and mutates valid ones (a field set to any JSON value, raw bytes broken in the ways above), a fixed
  seed and count; no answer may be a 5xx or hold a traceback, and /health, polled all the while, must answer in
  under 100 ms. It prints its request and status counts and /health's worst latency."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.test_server import API_KEY, _wait_healthy, httpx, serve
from tinyvllm.worker.model_runner import FAIL_TOKEN_VARIABLE

pytestmark = pytest.mark.slow

FAIL_TOKEN = 31999  # the test hook's token: the engine core refuses any sequence holding it
MODEL = "tiny"
GOOD = {"model": MODEL, "prompt": "Hi there", "max_tokens": 2, "temperature": 0}


def _serve_tiny(log_dir, checkpoint: str, *args: str):
    """A random-weight model with SmolLM2's tokenizer (fast steps), with the test hook armed."""
    return serve(log_dir, checkpoint, "--device", "cpu", "--api-key", API_KEY, "--num-kv-blocks", "512",
                 "--max-num-seqs", "32", "--max-model-len", "512", "--served-model-name", MODEL, "--log-level",
                 "warning", "--no-access-log", *args, env={FAIL_TOKEN_VARIABLE: str(FAIL_TOKEN)})


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_text_checkpoint):
    with _serve_tiny(tmp_path_factory.mktemp("fuzz"), tiny_text_checkpoint) as srv:
        _wait_healthy(srv)
        yield srv


def _assert_clean(response: httpx.Response) -> None:
    """No 5xx, and nothing of the server's insides in the body."""
    assert response.status_code < 500, response.text[:500]
    _no_traceback(response.text)


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text and "Error:" not in text, text[:500]


def _good_request_works(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


_POLLER = """
import json, sys, threading, time
import httpx
url, interval_s = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies, failures = [], []
with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
    client.get("/health")  # (the connection's set-up is not the server's latency)
    print("ready", flush=True)
    while not stop.is_set():
        start = time.perf_counter()
        status = client.get("/health").status_code
        latencies.append(time.perf_counter() - start)
        if status != 200:
            failures.append(f"/health answered {status}")
        stop.wait(interval_s)
print(json.dumps({"latencies": latencies, "failures": failures}), flush=True)
"""


@contextmanager
def _health_monitor(url: str, interval_s: float = 0.05) -> Iterator[list[float]]:
    """Polls /health from a process of its own while the block runs (in this one, a pause of the test's own garbage
    collector, some 300 ms late in the suite, would count as the server's), and fills the list it yields with the
    latencies (s) when the block ends; each answer must be a 200."""
    latencies: list[float] = []
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, url, str(interval_s)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout.readline().strip() == "ready"
        yield latencies
    finally:
        poller.stdin.close()
        report = json.loads(poller.stdout.readline() or "{}")
        poller.wait(30)
    assert report, "the /health poller did not report"
    latencies.extend(report["latencies"])
    assert not report["failures"], report["failures"]


# ---- the requests that killed, froze or crashed it --------------------------------------------------------
HOSTILE = [
    # (what, path, raw body, the param the 400 names or None)
    ("top_k beyond int64", "/v1/completions", json.dumps({**GOOD, "top_k": 2**63}), "top_k"),
    ("JSON nested 10,000 deep", "/v1/completions", "[" * 10_000 + "]" * 10_000, None),
    ("an integer of 5,000 digits", "/v1/completions", '{"prompt": "Hi", "max_tokens": ' + "1" * 5000 + "}", None),
    ("a lone surrogate prompt", "/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', None),
    ("a lone surrogate model name", "/v1/completions", '{"model": "\\udfff", "prompt": "Hi"}', None),
    ("a lone surrogate to /tokenize", "/tokenize", '{"prompt": "a\\ud800b"}', None),
    ("min_tokens beyond the context", "/v1/completions",
     json.dumps({"prompt": "Hi", "max_tokens": None, "min_tokens": 100_000}), "min_tokens"),
    ("n of a million", "/v1/completions", json.dumps({**GOOD, "n": 1_000_000}), "n"),
    ("a request's own looping chat template, untrusted", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi"}],
                 "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
     "chat_template"),
    ("temperature NaN", "/v1/completions", '{"prompt": "Hi", "temperature": NaN}', None),
    ("temperature 1e999", "/v1/completions", '{"prompt": "Hi", "temperature": 1e999}', "temperature"),
    ("seed beyond int64", "/v1/completions", json.dumps({**GOOD, "seed": 2**64}), "seed"),
    ("stop_token_ids outside the vocabulary", "/v1/completions", json.dumps({**GOOD, "stop_token_ids": [-1]}),
     "stop_token_ids"),
    ("10,000 stop strings", "/v1/completions", json.dumps({**GOOD, "stop": ["x"] * 10_000}), "stop"),
    ("a stop string of 100,000 characters", "/v1/completions", json.dumps({**GOOD, "stop": "x" * 100_000}), "stop"),
    ("logprobs 1,000", "/v1/completions", json.dumps({**GOOD, "logprobs": 1000}), "logprobs"),
    ("top_logprobs 1,000", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1000}),
     "top_logprobs"),
    ("repetition_penalty 1e308", "/v1/completions", json.dumps({**GOOD, "repetition_penalty": 1e308}),
     "repetition_penalty"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', None),
]


@pytest.mark.parametrize("what,path,body,param", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_request_gets_a_quick_4xx(tiny_server, what, path, body, param):
    with tiny_server.http() as http:
        start = time.perf_counter()
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        elapsed = time.perf_counter() - start
        assert response.status_code == 400, response.text[:300]
        _assert_clean(response)
        assert elapsed < 1.0, f"{what}: {elapsed:.2f} s"
        if param is not None:
            assert response.json()["error"]["param"] == param, response.text[:300]
        _good_request_works(http)


# ---- the engine core failing on one request ---------------------------------------------------------------
def test_engine_core_error_fails_only_its_request(tiny_server):
    """Streams and plain requests run while a request the engine core refuses comes in (plain and streamed): the
    refused ones end with a 500 (an error event in the stream), the others finish whole and as they would alone."""
    import asyncio

    prompts = [f"Story number {i}:" for i in range(6)]
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with tiny_server.http() as http:
        alone = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                 for p in prompts]

    async def run() -> tuple[list[str], httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=headers, timeout=120,
                                     trust_env=False) as client:
            async def good(prompt: str) -> str:
                text = []
                async with client.stream("POST", "/v1/completions",
                                         json={**body, "prompt": prompt, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(text)

            async def bad_plain() -> httpx.Response:
                await asyncio.sleep(0.2)
                return await client.post("/v1/completions", json={**body, "prompt": [1, FAIL_TOKEN, 5], "n": 2})

            async def bad_stream() -> list[str]:
                await asyncio.sleep(0.3)
                async with client.stream("POST", "/v1/completions",
                                         json={**body, "prompt": [FAIL_TOKEN], "stream": True}) as response:
                    assert response.status_code == 200
                    return [line async for line in response.aiter_lines() if line]

            *texts, plain, streamed = await asyncio.gather(*map(good, prompts), bad_plain(), bad_stream())
            return texts, plain, streamed

    texts, plain, streamed = asyncio.run(run())
    assert texts == alone
    assert plain.status_code == 500
    _no_traceback(plain.text)
    assert "internal error ended this request" in plain.json()["error"]["message"]
    assert len(streamed) == 2 and streamed[-1] == "data: [DONE]"
    error = json.loads(streamed[0][6:])["error"]
    assert error["code"] == 500
    _no_traceback(error["message"])
    with tiny_server.http() as http:
        assert http.get("/health").status_code == 200
        _good_request_works(http)
    assert tiny_server.finished().get("error") == 3.0  # the two completions of one, the streamed one
    metrics = tiny_server.metrics()
    assert metrics["tinyvllm:num_requests_running"] == 0 and metrics["tinyvllm:kv_cache_usage_perc"] == 0


# ---- a request's own chat template, trusted ---------------------------------------------------------------
def test_trusted_request_template_is_time_limited(tmp_path, tiny_text_checkpoint):
    from tinyvllm.entrypoints.openai.chat_template import RENDER_TIMEOUT_S

    messages = [{"role": "user", "content": "hi"}]
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    huge = "{{ 'x' * 10**10 }}"
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def chat(http: httpx.Client, template: str) -> httpx.Response:
        return http.post("/v1/chat/completions", json={"messages": messages, "chat_template": template,
                                                        "max_tokens": 2})

    with (_serve_tiny(tmp_path, tiny_text_checkpoint, "--trust-request-chat-template") as server,
          server.http() as http):
        _wait_healthy(server)
        # (the renderer's process imports transformers as the server starts: wait until it has)
        assert chat(http, "{{ 'x' }}").status_code == 200
        with _health_monitor(server.url) as latencies:
            for template, what in ((looping, "did not render within"), (huge, "MiB")):
                start = time.perf_counter()
                response = chat(http, template)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "chat_template"
                assert what in response.json()["error"]["message"], response.text
                assert time.perf_counter() - start < RENDER_TIMEOUT_S + 1.5
                _good_request_works(http)
                assert chat(http, "{{ 'x' }}").status_code == 200  # (a killed renderer's successor has started)
            response = chat(http, plain)
            assert response.status_code == 200, response.text
            expected = http.post("/tokenize", json={"prompt": "<user>hi<assistant>", "add_special_tokens": False})
            assert response.json()["usage"]["prompt_tokens"] == len(expected.json()["tokens"])
    assert max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"


# ---- the fuzz test ----------------------------------------------------------------------------------------
FUZZ_EXAMPLES = 300  # requests, over both endpoints, with the seed fixed
RAW_MUTATIONS = [
    lambda raw: raw[: len(raw) // 2],  # cut short
    lambda raw: b"[" * 5000 + raw,  # too deep
    lambda raw: raw.replace(b'"', b"'", 1),
    lambda raw: raw.replace(b"}", b', "x": NaN}', 1),
    lambda raw: raw.replace(b"}", b', "temperature": 1' + b"0" * 400 + b"}", 1),
    lambda raw: raw.replace(b"}", b', "stop": "\\udc00"}', 1),
    lambda raw: raw + b"\xff",
    lambda raw: b"\xef\xbb\xbf" + raw,  # a byte-order mark
    lambda raw: b"null",
    lambda raw: b"",
]


def _from_schema(schema: dict, defs: dict) -> Any:
    """A Hypothesis strategy for the JSON values a (pydantic-made) JSON schema describes: objects with their required
    and any of their optional properties, anyOf, $ref, const and enum, and the plain types; numbers mostly small,
    sometimes anywhere in their range."""
    from hypothesis import strategies as st

    if "$ref" in schema:
        return st.deferred(lambda: _from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([_from_schema(option, defs) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = {name: _from_schema(sub, defs) for name, sub in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        fixed = st.fixed_dictionaries({k: v for k, v in properties.items() if k in required},
                                      optional={k: v for k, v in properties.items() if k not in required})
        extra = schema.get("additionalProperties", not properties)
        if extra is False:
            return fixed
        values = _from_schema(extra, defs) if isinstance(extra, dict) else st.text(max_size=10)
        return st.tuples(fixed, st.dictionaries(st.text(max_size=8), values, max_size=3)).map(
            lambda parts: {**parts[1], **parts[0]})
    if kind == "array":
        return st.lists(_from_schema(schema.get("items", {"type": "string"}), defs), max_size=4)
    if kind == "integer":
        low = schema.get("minimum", -2**70)
        high = schema.get("exclusiveMaximum", 2**70 + 1) - 1
        return st.integers(max(low, -3), min(high, 40)) | st.integers(low, high)
    if kind == "number":
        return st.floats(-3, 3) | st.floats(allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=30)
    if kind == "boolean":
        return st.booleans()
    return st.none()


def _bounded(body: object) -> object:
    """A drawn body, with what only costs time (long generations, many completions) kept small: the fuzz test is
    about what the server accepts, not about generating."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = MODEL  # (a 404 checks nothing else)
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = max(-3, min(body[key], 3))
        if "max_tokens" not in body or body.get("max_tokens") is None:
            body["max_tokens"] = 3
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 4:
            body["n"] = body["n"] if body["n"] > 10**6 else 4  # (a huge n must still be refused)
        if isinstance(body.get("min_tokens"), int) and 3 < body["min_tokens"] < 10**6:
            body["min_tokens"] = 3
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 8:
            body["prompt"] = body["prompt"][:8]
    return body


def test_fuzz_no_5xx_no_traceback_health_fast(tiny_server, capsys):
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    statuses: Counter[int] = Counter()
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=12)
    base = {"/v1/completions": dict(GOOD), "/v1/chat/completions": {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}

    def bodies(path: str, model: type) -> st.SearchStrategy[tuple[str, bytes]]:
        """(path, raw body): drawn from the request's schema, one field of a valid body set to any JSON value, or
        a valid body's bytes broken."""
        schema = model.model_json_schema()
        fields = [*schema["properties"], "unknown_field"]
        drawn = _from_schema(schema, schema.get("$defs", {})).map(_bounded)
        one_field = st.builds(lambda key, value: _bounded({**base[path], key: value}), st.sampled_from(fields),
                              json_values)
        broken = st.sampled_from(RAW_MUTATIONS).map(lambda mutate: mutate(json.dumps(base[path]).encode()))
        as_bytes = st.one_of(drawn, one_field).map(lambda body: json.dumps(body).encode())
        return st.tuples(st.just(path), st.one_of(as_bytes, broken))

    requests = bodies("/v1/completions", CompletionRequest) | bodies("/v1/chat/completions", ChatCompletionRequest)
    with tiny_server.http() as http, _health_monitor(tiny_server.url) as latencies:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @seed(20261207)
        @given(requests)
        def fuzz(request: tuple[str, bytes]) -> None:
            path, raw = request
            response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses[response.status_code] += 1
            _assert_clean(response)

        fuzz()
        _good_request_works(http)
    worst = max(latencies)
    with capsys.disabled():  # (the figures show in CI's output, passed or not)
        print(f"\nfuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}; /health "
              f"polled {len(latencies)} times, median {statistics.median(latencies) * 1000:.1f} ms, worst "
              f"{worst * 1000:.1f} ms")
    assert sum(statuses.values()) >= FUZZ_EXAMPLES
    assert not [status for status in statuses if status >= 500]
    assert statuses[200] > 0 and statuses[400] > 0  # (it reached the engine, and it found what is refused)
    assert worst < 0.1, f"/health took up to {worst * 1000:.0f} ms"
