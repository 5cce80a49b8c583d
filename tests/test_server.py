"""The OpenAI-compatible server, end to end: a real `tinyvllm serve` process on loopback with the
embedded model, driven by the official `openai` client and by raw HTTP.

One server serves the whole module (it takes ~10-25 s to load), with an API key; the test process
meanwhile computes the offline reference outputs with LLM(). Both run torch single-threaded, so that the
two processes share the 2 CI cores without oversubscribing them. The graceful-shutdown test is last: it
stops the server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils import USER_SCHEMA

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.slow

API_KEY = "test-key-0123"
MAX_TOKENS = 16  # for the requests compared with the offline engine
SHORT = 6  # for requests that only check the API's shape
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
                      "The three primary colors are"]
CHAT_MESSAGES = [[{"role": "user", "content": "What is 2 + 2?"}],
                 [{"role": "user", "content": "Name a fruit that is yellow."}],
                 [{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "What color is the sky?"}],
                 [{"role": "user", "content": "Say hello in French."}]]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log_path: str) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.model = "SmolLM2-135M-Instruct"

    def log(self, tail: int | None = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        return text[-tail:] if tail else text

    def client(self, **kwargs: Any) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                             http_client=httpx.Client(trust_env=False), **kwargs)

    def http(self, key: str | None = API_KEY) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=300, trust_env=False)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, by name (labels dropped: one model, one value)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30, trust_env=False).text
        samples = {}
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.labels.get("le") and "finished_reason" not in sample.labels:
                    samples[sample.name] = sample.value
        return samples

    def finished(self) -> dict[str, float]:
        """request_success_total by finished_reason."""
        return finished_counts(httpx.get(f"{self.url}/metrics", timeout=30, trust_env=False).text)


def finished_counts(metrics_text: str) -> dict[str, float]:
    """request_success_total by finished_reason, from a /metrics page."""
    return {sample.labels["finished_reason"]: sample.value
            for family in prometheus_parser.text_string_to_metric_families(metrics_text)
            for sample in family.samples if sample.name == "tinyvllm:request_success_total"}


def _single_threaded_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def serve(log_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A `tinyvllm serve *args` process on a free loopback port (with `env` added to its environment), its output in
    log_dir/server.log; killed at the end if it is still running. (It is not healthy yet: see _wait_healthy.)"""
    port = _free_port()
    log_path = str(log_dir / "server.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "tinyvllm", "serve", "--port", str(port), *args],
                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**_single_threaded_env(), **(env or {})})
        try:
            yield Server(process, port, log_path)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("server"), "--api-key", API_KEY, "--num-kv-blocks", "512",
               "--max-num-seqs", "64", "--log-level", "warning",
               # as on a GPU, where it is the default: the engine core launches step N+1 before reading step N
               "--async-scheduling") as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(server):
    """Greedy reference outputs from the offline engine, computed while the server loads; then wait
    until the server is healthy."""
    import torch

    from tinyvllm import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(num_kv_blocks=256)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        completions = llm.generate(COMPLETION_PROMPTS, params, use_tqdm=False)
        chats = llm.chat(CHAT_MESSAGES, params, use_tqdm=False)
        reference = {"completions": [o.outputs[0].text for o in completions],
                     "chats": [o.outputs[0].text for o in chats]}
        del llm
    finally:
        torch.set_num_threads(threads)
    _wait_healthy(server)
    return reference


def _wait_healthy(server: Server, timeout: float = 240.0) -> None:
    from tinyvllm.entrypoints.bench_serve import wait_healthy

    try:
        wait_healthy(server.process, server.url, timeout)
    except RuntimeError as e:
        pytest.fail(f"{e}:\n{server.log()}")


@pytest.fixture(scope="module")
def live(server, offline):
    return server


# ---- the openai client ---------------------------------------------------------------------------------
def test_models_health_and_version(live):
    assert httpx.get(f"{live.url}/health", trust_env=False).status_code == 200  # no key needed
    models = live.client().models.list()
    assert [m.id for m in models.data] == [live.model]
    assert live.http().get("/version").json()["version"]


def test_completion_streamed_equals_unstreamed(live, offline):
    client = live.client()
    prompt = COMPLETION_PROMPTS[0]
    response = client.completions.create(model=live.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.text == offline["completions"][0]
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    chunks = list(client.completions.create(model=live.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    assert len({c.created for c in chunks}) == 1  # one creation time for the whole stream, as OpenAI's


def test_chat_streamed_equals_unstreamed(live, offline):
    client = live.client()
    messages = CHAT_MESSAGES[0]
    response = client.chat.completions.create(model=live.model, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0)
    message = response.choices[0].message
    assert message.role == "assistant"
    assert message.content == offline["chats"][0]
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(model=live.model, messages=messages, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage, no usage chunk


def test_done_ends_the_body_in_the_same_message():
    """`data: [DONE]` and the end of the body are one ASGI message (so one write): a client that stops reading
    at [DONE] finds the response complete, and its connection is reused rather than closed."""
    from tinyvllm.entrypoints.openai.serving import EventStream

    class Stub:
        def abort(self) -> None: ...
        def close(self) -> None: ...

    async def events():
        yield '{"a": 1}'
        yield '{"a": 2}'

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)  # (no disconnect)
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "headers": []}
    asyncio.run(EventStream(events(), Stub(), Stub())(scope, receive, send))  # type: ignore[arg-type]
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b'data: {"a": 1}\n\n', True), (b'data: {"a": 2}\n\n', True), (b"data: [DONE]\n\n", False)]


def test_completion_prompt_forms(live):
    """A prompt as a string, a list of strings, token ids, or a list of token-id lists; n per prompt."""
    http = live.http()
    ids = http.post("/tokenize", json={"prompt": "Hello, my name is"}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "Hello, my name is"
    body = {"model": live.model, "max_tokens": SHORT, "temperature": 0}
    as_text = http.post("/v1/completions", json={**body, "prompt": "Hello, my name is"}).json()
    as_ids = http.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert as_text["choices"][0]["text"] == as_ids["choices"][0]["text"]
    many = http.post("/v1/completions", json={**body, "prompt": [ids, ids[:3]], "n": 2}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == many["choices"][1]["text"] == as_ids["choices"][0]["text"]
    assert many["usage"]["prompt_tokens"] == len(ids) + 3
    strings = http.post("/v1/completions", json={**body, "prompt": ["Hello, my name is", "Hi"]}).json()
    assert strings["choices"][0]["text"] == as_text["choices"][0]["text"]


def test_n_stop_and_seed(live, offline):
    client = live.client()
    sampled = client.chat.completions.create(model=live.model, messages=CHAT_MESSAGES[1], max_tokens=SHORT, n=2,
                                             temperature=1.0, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    assert all(c.message.content is not None for c in sampled.choices)
    assert 2 <= sampled.usage.completion_tokens <= 2 * SHORT

    # stop: cut the greedy completion at a word it is known to contain
    reference = offline["completions"][1]
    words = reference.split()
    stop = words[len(words) // 2] if len(words) > 2 else words[-1]
    stopped = client.completions.create(model=live.model, prompt=COMPLETION_PROMPTS[1], max_tokens=MAX_TOKENS,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].text == reference[: reference.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    # seed: temperature 1 with a seed is reproducible
    def seeded() -> str:
        return client.completions.create(model=live.model, prompt="My favourite animal is", max_tokens=SHORT,
                                         temperature=1.0, seed=42).choices[0].text

    first = seeded()
    assert first and seeded() == first


def test_logprobs(live):
    client = live.client()
    completion = client.completions.create(model=live.model, prompt="The sun rises in the", max_tokens=SHORT,
                                           temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert lp <= 0 and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy: the chosen token is the top one

    chat = client.chat.completions.create(model=live.model, messages=CHAT_MESSAGES[0], max_tokens=SHORT,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_echo_and_prompt_logprobs(live):
    """What lm-evaluation-harness sends to score a text (echo, logprobs 1, max_tokens 1, temperature 0, the prompt
    as token ids or text): the prompt's text, then per token (the first null) its logprob and the top ones, then
    the generated token's; max_tokens 0 echoes the prompt alone; streamed, the echo comes with the first chunk; and
    vLLM's prompt_logprobs on both endpoints."""
    http = live.http()
    text = "The capital of France is Paris"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    score = {"model": live.model, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0}
    by_ids = http.post("/v1/completions", json={**score, "prompt": ids}).json()
    by_text = http.post("/v1/completions", json={**score, "prompt": text}).json()
    for answer in (by_ids, by_text):
        (choice,) = answer["choices"]
        lp = choice["logprobs"]
        assert choice["text"].startswith(text) and answer["usage"]["completion_tokens"] == 1
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v <= 0 for v in lp["token_logprobs"][1:]) and "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids) + 1)]
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert 1 <= len(top) <= 2 and max(top.values()) >= value - 1e-6
    assert by_ids["choices"][0]["logprobs"] == by_text["choices"][0]["logprobs"]
    plain = http.post("/v1/completions", json={**score, "echo": False, "prompt": ids}).json()["choices"][0]
    assert plain["logprobs"]["token_logprobs"] == by_ids["choices"][0]["logprobs"]["token_logprobs"][-1:]

    alone = http.post("/v1/completions", json={**score, "prompt": ids, "max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == text and alone["choices"][0]["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == by_ids["choices"][0]["logprobs"]["token_logprobs"][:-1]

    with http.stream("POST", "/v1/completions", json={**score, "prompt": ids, "max_tokens": 3, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    whole = http.post("/v1/completions", json={**score, "prompt": ids, "max_tokens": 3}).json()["choices"][0]
    assert streamed == whole["text"] and tokens == whole["logprobs"]["tokens"]

    vllm_shape = http.post("/v1/completions", json={"model": live.model, "prompt": ids, "max_tokens": 1,
                                                    "temperature": 0, "prompt_logprobs": 2}).json()["choices"][0]
    entries = vllm_shape["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, value in zip(ids[1:], entries[1:], by_ids["choices"][0]["logprobs"]["token_logprobs"][1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-5) and 2 <= len(entry) <= 3
    chat = http.post("/v1/chat/completions", json={"model": live.model, "messages": CHAT_MESSAGES[0],
                                                   "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]

    _assert_error(http.post("/v1/completions", json={**score, "prompt": ids, "stream": True, "prompt_logprobs": 1}),
                  400, "prompt_logprobs")
    _assert_error(http.post("/v1/completions", json={"model": live.model, "prompt": ids, "max_tokens": 0}), 400,
                  "max_tokens")
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]


def test_structured_output_through_the_openai_client(live):
    """20 chat requests at once with a JSON schema (nested object, enum, array, required fields) at temperature 0.8
    all return JSON that validates; a regex and a choice (vLLM's extra fields) hold on /v1/completions; JSON mode
    returns an object."""
    from concurrent.futures import ThreadPoolExecutor

    jsonschema = pytest.importorskip("jsonschema")
    client = live.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": USER_SCHEMA}}

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": "Describe a user of a web service in JSON."}],
            temperature=0.8, seed=seed, max_tokens=200, response_format=fmt)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.choices[0].message.content), USER_SCHEMA)

    regex = r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\."
    for seed in range(3):
        text = client.completions.create(model=live.model, prompt="A person:", temperature=0.8, seed=seed,
                                         max_tokens=20, extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, text.choices[0].text), text.choices[0].text
        choice = client.completions.create(model=live.model, prompt="Is water wet? Answer:", temperature=0.8,
                                           seed=seed, max_tokens=5, extra_body={"guided_choice": ["yes", "no"]})
        assert choice.choices[0].text in ("yes", "no")
    # JSON mode: every answer that ends by itself is an object (at temperature 0.8 this small model may go on past
    # max_tokens, cut mid-object, as any engine's would: a few seeds, so that some end)
    modes = [client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "A JSON object"}],
                                            temperature=0.8, seed=seed, max_tokens=100,
                                            response_format={"type": "json_object"}).choices[0] for seed in range(4)]
    ended = [choice.message.content for choice in modes if choice.finish_reason == "stop"]
    assert ended, [choice.message.content for choice in modes]
    assert all(isinstance(json.loads(content), dict) for content in ended), ended


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}


def test_tool_calls_through_the_openai_client(live):
    """A named tool_choice returns a tool call whose arguments validate against the function's parameters, and
    streamed it reassembles to the same; "required" returns calls of the given tools; a conversation holding the
    assistant's call and the tool's answer renders and is answered."""
    jsonschema = pytest.importorskip("jsonschema")
    client = live.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=live.model, messages=messages, tools=[WEATHER, CLOCK],
                                            tool_choice=named, temperature=0, max_tokens=100)
    (call,) = answer.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), parameters["get_weather"])

    pieces = list(client.chat.completions.create(model=live.model, messages=messages, tools=[WEATHER, CLOCK],
                                                 tool_choice=named, temperature=0, max_tokens=100, stream=True))
    deltas = [tc for piece in pieces if piece.choices for tc in piece.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments

    required = client.chat.completions.create(model=live.model, messages=messages, tools=[WEATHER, CLOCK],
                                              tool_choice="required", temperature=0.8, seed=2, max_tokens=200)
    assert required.choices[0].finish_reason == "tool_calls"
    for made in required.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(made.function.arguments), parameters[made.function.name])

    follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model=live.model, messages=follow, tools=[WEATHER], temperature=0,
                                           max_tokens=20)
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


# ---- many at once ----------------------------------------------------------------------------------------
def test_32_concurrent_streams_match_offline(live, offline):
    """32 streams at once (each prompt 4 times, completions and chats): each greedy output equals the
    offline engine's for the same prompt, whatever else shared its batches."""
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(trust_env=False,
                                                              limits=httpx.Limits(max_connections=64)))

    async def completion(prompt: str) -> str:
        stream = await client.completions.create(model=live.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def chat(messages: list[dict[str, str]]) -> str:
        stream = await client.chat.completions.create(model=live.model, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run() -> tuple[list[str], list[str]]:
        async with client:
            jobs = [completion(p) for p in COMPLETION_PROMPTS * 4] + [chat(m) for m in CHAT_MESSAGES * 4]
            results = await asyncio.gather(*jobs)
        return results[:16], results[16:]

    before = live.metrics()
    completions, chats = asyncio.run(run())
    assert completions == offline["completions"] * 4
    assert chats == offline["chats"] * 4
    after = live.metrics()
    assert after["tinyvllm:generation_tokens_total"] > before["tinyvllm:generation_tokens_total"]
    assert after["tinyvllm:prefix_cache_hits_total"] > before["tinyvllm:prefix_cache_hits_total"]


def test_concurrent_tokenizing_small_and_large_bodies(live):
    """Small bodies are handled on the event loop when the input thread is idle, large ones on that thread:
    40 /tokenize calls at once, bodies of 40 bytes to 13 KB, each answer equal to the same call's made alone."""
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(5 + (i % 4) * 900)) for i in range(40)]
    assert min(map(len, texts)) < 100 and max(map(len, texts)) > 12_000
    with live.http() as http:
        alone = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=300, trust_env=False) as client:
            responses = await asyncio.gather(*[client.post("/tokenize", json={"prompt": t}) for t in texts])
        return [r.json()["tokens"] for r in responses]

    assert asyncio.run(run()) == alone


# ---- errors ----------------------------------------------------------------------------------------------
def _assert_error(response: Any, status: int, param: str | None = "any") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"]
    if param != "any":
        assert error["param"] == param


def test_errors_then_good_requests(live):
    """Every error with its status and body, each followed by a request that succeeds; a stream in flight
    meanwhile is not disturbed."""
    http = live.http()
    good = {"model": live.model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}

    def check_good() -> None:
        response = http.post("/v1/completions", json=good)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 1

    async def background_stream() -> str:
        async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=300, trust_env=False) as client:
            text = []
            async with client.stream("POST", "/v1/completions", json={
                    **good, "prompt": COMPLETION_PROMPTS[2], "max_tokens": MAX_TOKENS, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(text)

    def errors() -> None:
        cases = [
            (lambda: http.post("/v1/completions", content=b'{"prompt": "Hi", ', headers={
                "Content-Type": "application/json"}), 400, None),
            (lambda: http.post("/v1/completions", json={"model": live.model, "max_tokens": 2}), 400, "prompt"),
            (lambda: http.post("/v1/chat/completions", json={"model": live.model}), 400, "messages"),
            (lambda: http.post("/v1/completions", json={**good, "temperature": -0.5}), 400, "temperature"),
            (lambda: http.post("/v1/completions", json={**good, "temperature": "hot"}), 400, "temperature"),
            (lambda: http.post("/v1/completions", json={**good, "max_tokens": 0}), 400, "max_tokens"),
            (lambda: http.post("/v1/completions", json={**good, "prompt": [5] * 9000}), 400, "prompt"),
            (lambda: http.post("/v1/completions", json={**good, "prompt": [5] * 8000, "max_tokens": 500}), 400,
             "max_tokens"),
            (lambda: http.post("/v1/completions", json={**good, "prompt": [10**9]}), 400, "any"),
            (lambda: http.post("/v1/completions", json={**good, "model": "gpt-5"}), 404, "model"),
            (lambda: http.post("/v1/chat/completions", json={
                "model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}), 404, "model"),
            (lambda: live.http(key=None).post("/v1/completions", json=good), 401, "any"),
            (lambda: live.http(key="wrong-key").post("/v1/completions", json=good), 401, "any"),
            (lambda: live.http(key=None).get("/v1/models"), 401, "any"),
        ]
        for send, status, param in cases:
            _assert_error(send(), status, param)
            check_good()

    async def run() -> str:
        stream = asyncio.create_task(background_stream())
        await asyncio.to_thread(errors)
        return await stream

    assert asyncio.run(run()) == live.client().completions.create(
        model=live.model, prompt=COMPLETION_PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    # the open paths need no key, and the openai client surfaces our errors as its exceptions
    assert live.http(key=None).get("/metrics").status_code == 200
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="gpt-5", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        live.client().completions.create(model=live.model, prompt="Hi", max_tokens=1, temperature=-1)


def test_unsupported_fields_are_refused(live):
    """What the server would not honour (tools, logit_bias, a field it does not know, a constraint on the output
    that does not compile, or two of them) is a 400 that names it and says what to do, not free text that ignores
    it; what it honours, harmless metadata, the values that ask for nothing, and unknown fields sent as null still
    pass."""
    client = live.client()
    messages = CHAT_MESSAGES[0]
    refused = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "answer"}}), "response_format"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex"),
        (dict(extra_body={"guided_json": {"type": "object", "properties": 3}}), "guided_json"),
        (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={
            "type": "function", "function": {"name": "g"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
        (dict(function_call={"name": "f"}), "function_call"),
        (dict(logit_bias={"5": 10}), "logit_bias"),
        (dict(reasoning_effort="high"), "reasoning_effort"),
    ]
    for kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=live.model, messages=messages, max_tokens=1, **kwargs)
        assert caught.value.body["param"] == param, caught.value.body
        message = caught.value.body["message"]
        assert param in message and any(advice in message for advice in (
            "remove", "compile", "send one", "supported", "needs", "name one")), message
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=live.model, prompt="Hi", max_tokens=1, logit_bias={"5": 10})
    with pytest.raises(openai.BadRequestError, match="best_of_n"):
        client.completions.create(model=live.model, prompt="Hi", max_tokens=1, extra_body={"best_of_n": 2})
    http = live.http()
    nested = http.post("/v1/chat/completions", json={"model": live.model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi", "tool_calls": [{"id": "1", "type": "function"}]}]})
    _assert_error(nested, 400, "messages")  # (a call without its function)
    assert "messages.0.tool_calls.0.function" in nested.json()["error"]["message"]
    _assert_error(http.post("/tokenize", json={"prompt": "Hi", "truncate": 3}), 400, "truncate")

    accepted = client.chat.completions.create(
        model=live.model, messages=messages, max_tokens=1, user="u-1", response_format={"type": "text"},
        tool_choice="none", logit_bias={}, metadata={"team": "a"}, parallel_tool_calls=False, safety_identifier="s",
        store=False, extra_body={"unknown_but_null": None, "top_k": 5})
    assert accepted.usage.completion_tokens == 1
    body = {"model": live.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi", "refusal": None}],
            "tools": None, "tool_choice": "auto", "functions": [], "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"


# ---- aborts and metrics --------------------------------------------------------------------------------
def _wait_idle(live: Server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = live.metrics()
        idle = (m["tinyvllm:num_requests_running"] == 0 and m["tinyvllm:num_requests_waiting"] == 0
                and m["tinyvllm:kv_cache_usage_perc"] == 0)
        if idle or time.time() > deadline:
            return m
        time.sleep(0.2)


def test_client_disconnect_aborts_and_frees_kv(live):
    """A client that goes away aborts its request, which frees its KV blocks and counts under
    request_success_total{finished_reason="abort"}."""
    start = _wait_idle(live)
    aborted = live.finished().get("abort", 0)
    body = {"model": live.model, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}
    # streamed: read a few chunks, then drop the connection
    with live.http() as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = 0
        for line in response.iter_lines():
            lines += line.startswith("data: ")
            if lines == 3:
                break
    m = _wait_idle(live)
    assert m["tinyvllm:num_requests_running"] == 0 and m["tinyvllm:kv_cache_usage_perc"] == 0, m
    generated = m["tinyvllm:generation_tokens_total"] - start["tinyvllm:generation_tokens_total"]
    assert generated < 100  # aborted, not run to its 400 tokens
    assert live.finished().get("abort", 0) == aborted + 1

    # not streamed: the client gives up waiting
    with pytest.raises(httpx.TimeoutException), live.http() as http:
        http.post("/v1/completions", json=body, timeout=2.0)
    m2 = _wait_idle(live)
    assert m2["tinyvllm:num_requests_running"] == 0 and m2["tinyvllm:kv_cache_usage_perc"] == 0, m2
    # aborted when the client left, not run to its 400 tokens (what the engine decodes in the 2 s before depends on
    # its speed: ~110 tokens on this project's 2-core CI machine)
    assert m2["tinyvllm:generation_tokens_total"] - m["tinyvllm:generation_tokens_total"] < body["max_tokens"] // 2
    assert m2["tinyvllm:num_free_kv_blocks"] == m2["tinyvllm:num_kv_blocks"]
    assert live.finished().get("abort", 0) == aborted + 2


def test_metrics_parse_and_move(live):
    text = live.http(key=None).get("/metrics").text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                 "generation_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds"):
        assert f"tinyvllm:{name}" in families, name
    assert families["tinyvllm:prompt_tokens"].type == "counter"
    assert families["tinyvllm:time_to_first_token_seconds"].type == "histogram"
    before = live.metrics()
    live.http().post("/v1/completions", json={"model": live.model, "prompt": "Count: one, two,", "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True}).raise_for_status()
    after = live.metrics()

    def moved(name: str) -> float:
        return after[f"tinyvllm:{name}"] - before[f"tinyvllm:{name}"]

    assert moved("prompt_tokens_total") > 0
    assert moved("prefix_cache_queries_total") > 0
    assert moved("generation_tokens_total") == 4
    assert moved("time_to_first_token_seconds_count") == 1
    assert moved("inter_token_latency_seconds_count") == 3  # one per token after the first
    assert moved("e2e_request_latency_seconds_count") == 1
    assert moved("time_to_first_token_seconds_sum") > 0
    # The engine core's share of the time to first token: its queue and its prefill, both within it
    assert moved("request_queue_time_seconds_count") == moved("request_prefill_time_seconds_count") == 1
    queue, prefill = moved("request_queue_time_seconds_sum"), moved("request_prefill_time_seconds_sum")
    assert queue >= 0 and prefill > 0 and queue + prefill < moved("time_to_first_token_seconds_sum")


# ---- the load generator ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_clients", [1, 2])
def test_bench_serve(live, tmp_path, num_clients):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "tinyvllm", "bench", "serve", "--base-url", live.url, "--api-key", API_KEY,
         "--num-prompts", "4", "--concurrency", "2", "--max-tokens", "4", "--input-len", "8",
         "--duration-limit", "120", "--num-clients", str(num_clients), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_single_threaded_env())
    assert result.returncode == 0, result.stdout + result.stderr
    for label in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "P90 ITL (ms):"):
        assert label in result.stdout, result.stdout
    summary = json.loads(out.read_text())
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 16 and summary["total_input_tokens"] == 32
    assert summary["ttft_ms"]["median"] > 0
    # --concurrency 2, split over the clients when there are two: both slots start at the common origin, and
    # a third request only once one of them has ended.
    starts = sorted(r["start"] for r in summary["requests"])
    assert 0 <= starts[0] <= starts[1] < 1.0
    assert starts[2] >= min(r["start"] + r["latency"] for r in summary["requests"]) - 0.05


# ---- last: shutdown ---------------------------------------------------------------------------------------
def test_graceful_shutdown_on_sigterm(live):
    """SIGTERM with a stream in flight: the stream ends, the process exits 0 within a few seconds."""
    with live.http() as http, http.stream("POST", "/v1/completions", json={
            "model": live.model, "prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as response:
        lines = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 2:
                    live.process.send_signal(signal.SIGTERM)
                    start = time.time()
        assert lines[-1] == "data: [DONE]"
        assert len(lines) < 100
    assert live.process.wait(timeout=15) == 0, live.log()
    assert time.time() - start < 15

