"""The chat page that `tinyvllm serve` serves at / (issue 49), in a real browser: headless Chromium, driven by
Playwright, against a real server of the embedded model with an API key. The page asks for the key, streams an
answer token by token, stops a long one (which frees its KV blocks on the server), and shows the model's text as
text, never as HTML. The browser tests skip without the system's Chromium or the playwright package (.ci/run
installs Chromium, the dev extra playwright); the page's routes and --no-ui are checked without a browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_server import API_KEY, ROOT, Server, _wait_healthy, finished_counts, httpx, serve

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"  # Debian's `chromium` package (Playwright drives it; no `playwright install`)
# The screenshot each run keeps (a git-ignored folder: docs/chat-page.png, shown in the README, is a copy of one)
SCREENSHOT = Path(ROOT) / "test-artifacts" / "chat-page.png"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("chat-page"), "--api-key", API_KEY, "--num-kv-blocks", "256",
               "--max-num-seqs", "4", "--log-level", "warning") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (pip)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"the browser test needs Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, chat_server) -> Iterator[Any]:
    """A fresh page (its own localStorage) on a healthy server; `page.dialogs` collects every alert() and the like,
    `page.errors` the page's uncaught errors and console errors (a script that the page's Content-Security-Policy
    blocked would show there), but for the 401s of the key's absence."""
    _wait_healthy(chat_server)
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    page = context.new_page()
    page.dialogs, page.errors = [], []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("console", lambda message: message.type == "error" and "401" not in message.text
            and page.errors.append(message.text))
    yield page
    context.close()


def _answer_text(page: Any) -> str:
    return page.locator(".message.assistant .content").last.inner_text()


def _stats(page: Any) -> str:
    return page.locator(".message.assistant .stats").last.inner_text()


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def test_chat_streams_stops_and_frees_the_kv_cache(page, chat_server, tmp_path):
    """A user's round: the key, an answer streamed token by token with its stats, a long one stopped midway (the
    server aborts it and frees its KV blocks), New chat. The screenshot of the first answer is the README's."""
    requests: list[dict[str, Any]] = []
    page.on("request", lambda request: request.url.endswith("/v1/chat/completions") and requests.append(
        {"body": json.loads(request.post_data), "authorization": request.headers.get("authorization")}))
    page.goto(chat_server.url)
    # The server has a key: the page asks for it (a message sent without it fails, and goes back to the input box),
    # keeps it, and then shows the served model's name.
    page.locator("#key-form").wait_for(state="visible")
    page.fill("#input", "Hello")
    page.press("#input", "Enter")
    _wait_for(lambda: "API key" in _stats(page), 10, "error without the key")
    assert page.input_value("#input") == "Hello"
    page.click("#new-chat")
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    page.wait_for_function(f"document.getElementById('model').textContent === {json.dumps(chat_server.model)}")
    assert page.evaluate("localStorage.getItem('tinyvllm.apiKey')") == API_KEY

    page.click("#settings-toggle")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    page.fill("#input", "Write a Python function that returns the square of a number.")
    page.press("#input", "Enter")
    # The answer grows as it streams: several lengths before the stats line says it is done.
    lengths = []
    deadline = time.time() + 60
    while "tokens/s" not in _stats(page):
        assert time.time() < deadline, "the first answer did not finish within 60 s"
        lengths.append(len(_answer_text(page)))
        time.sleep(0.02)
    answer = _answer_text(page)
    grown = sorted({n for n in lengths if n > 0})
    assert len(grown) >= 2 and grown[-1] <= len(answer), lengths
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s · time to first token \d+ ms", _stats(page)), _stats(page)
    page.screenshot(path=str(tmp_path / "chat-page.png"))
    SCREENSHOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(tmp_path / "chat-page.png", SCREENSHOT)

    # A long answer, stopped while it streams: the request is aborted and its KV blocks are freed.
    aborted = finished_counts(httpx.get(f"{chat_server.url}/metrics", trust_env=False).text).get("abort", 0)
    page.fill("#max-tokens", "2000")
    page.fill("#input", "Count from 1 to 1000, one number per line.")
    page.click("#send")
    _wait_for(lambda: len(_answer_text(page)) > 0, 60, "second answer")
    streaming = chat_server.metrics()
    assert streaming["tinyvllm:num_requests_running"] == 1 and streaming["tinyvllm:kv_cache_usage_perc"] > 0
    page.click("#stop")
    start = time.time()
    _wait_for(lambda: chat_server.metrics()["tinyvllm:kv_cache_usage_perc"] == 0, 5, "free KV cache after Stop")
    stopped_after = time.time() - start
    assert chat_server.metrics()["tinyvllm:num_requests_running"] == 0
    assert finished_counts(httpx.get(f"{chat_server.url}/metrics", trust_env=False).text)["abort"] == aborted + 1
    assert _stats(page).startswith("stopped")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    print(f"KV cache free {stopped_after:.2f} s after Stop")

    # Each request with the key carried it, asked for the usage, and the second one the conversation so far.
    assert [r["authorization"] for r in requests] == [None, f"Bearer {API_KEY}", f"Bearer {API_KEY}"]
    first, second = (r["body"] for r in requests[1:])
    assert first["stream"] and first["stream_options"] == {"include_usage": True}
    assert (first["temperature"], first["max_tokens"], second["max_tokens"]) == (0, 48, 2000)
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    # (the answer as the model wrote it, which the page showed less its Markdown)
    unmarked = lambda text: re.sub(r"```\w*|[`*\s]", "", text)
    assert unmarked(second["messages"][1]["content"]) == unmarked(answer) != ""

    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    assert page.dialogs == [] and page.errors == []


def test_model_text_is_shown_as_text(page, chat_server):
    """What the model (or the user) writes reaches the page as text: markup in it is shown, never run; the small
    Markdown renderer adds its own few tags around escaped text."""
    page.goto(chat_server.url)
    page.wait_for_function("window.tinyvllmChat !== undefined")
    hostile = ("Look: <img src=x onerror=alert(1)> and <script>alert(2)</script>\n\n"
               "**bold** *it* `<b>code</b>`\n```html\n<img src=x onerror=alert(3)>\n```")
    page.evaluate("text => window.tinyvllmChat.addMessage('assistant', text)", hostile)
    page.evaluate("text => window.tinyvllmChat.addMessage('user', text)", "<img src=x onerror=alert(4)>")
    page.wait_for_timeout(300)  # (time for an image's onerror, were there an image)
    messages = page.locator("#messages")
    assert messages.locator("img, script, b").count() == 0
    text = messages.inner_text()
    for shown in ("<img src=x onerror=alert(1)>", "<script>alert(2)</script>", "<b>code</b>",
                  "<img src=x onerror=alert(3)>", "<img src=x onerror=alert(4)>"):
        assert shown in text, text
    assert messages.locator("strong").inner_text() == "bold" and messages.locator("em").inner_text() == "it"
    assert messages.locator("pre code").inner_text().strip() == "<img src=x onerror=alert(3)>"
    assert page.dialogs == []


# ---- the routes, without a browser ----------------------------------------------------------------------------
def test_page_needs_no_key_and_no_ui_turns_it_off(tiny_text_checkpoint):
    """The page's files are open (it asks for the key itself), the API still needs the key, and --no-ui leaves no
    page: / is a 404 as before."""
    from starlette.testclient import TestClient

    from tinyvllm.config import EngineConfig
    from tinyvllm.engine.async_engine import AsyncLLMEngine
    from tinyvllm.entrypoints.cli import build_parser
    from tinyvllm.entrypoints.openai.api_server import build_app

    assert build_parser().parse_args(["serve"]).ui is True
    assert build_parser().parse_args(["serve", "--no-ui"]).ui is False
    engine = AsyncLLMEngine.from_config(EngineConfig.from_kwargs(model=tiny_text_checkpoint, device="cpu",
                                                                 num_kv_blocks=16))
    # (TestClient outside a `with`: the apps' lifespans, which would start and stop the engine, do not run)
    with_page = TestClient(build_app(engine, "tiny", API_KEY, max_body_mb=1))
    without = TestClient(build_app(engine, "tiny", None, max_body_mb=1, ui=False))
    try:
        page = with_page.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for path, kind in (("/static/chat.js", "text/javascript"), ("/static/chat.css", "text/css")):
            response = with_page.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
            assert f'"{path}"' in page.text  # (the page loads it)
        assert with_page.get("/v1/models").status_code == 401
        assert with_page.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert with_page.get("/static/other.js").status_code == 401  # (only the page's own files are open)
        for path in ("/", "/static/chat.js"):
            assert without.get(path).status_code == 404
    finally:
        engine.shutdown()
