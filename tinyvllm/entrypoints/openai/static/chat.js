// tinyvllm's chat page: a conversation streamed from /v1/chat/completions (server-sent events). No dependencies.
// Text from the model or the user reaches the page only through textContent, or through render(), which escapes
// all of it before adding its own few tags.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "tinyvllm.apiKey";
const SETTINGS_STORAGE = "tinyvllm.settings";
const SETTINGS = ["temperature", "top-p", "max-tokens", "system"];  // the ids of the settings' fields

const state = {
  model: null,  // the served model's name (GET /v1/models); a request without one gets the served model too
  history: [],  // this conversation's messages, [{role, content}], without the system prompt
  controller: null,  // the AbortController of the answer that is streaming, if one is
};

// ---- Markdown, small and safe: escape everything, then add tags for fences, inline code, bold, italics ----
function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// One paragraph of escaped text: `code` first, so that nothing inside it turns bold or italic.
function renderInline(escaped) {
  return escaped.split(/(`[^`\n]+`)/).map((part, i) => i % 2
    ? `<code>${part.slice(1, -1)}</code>`
    : part.replace(/\*\*(\S(?:.*?\S)?)\*\*/g, "<strong>$1</strong>").replace(/\*(\S(?:.*?\S)?)\*/g, "<em>$1</em>"),
  ).join("");
}

function render(text) {
  // Split at the ``` fence lines: even parts are prose, odd parts code (an unclosed fence, still streaming, is
  // code to the end).
  return escapeHtml(text).split(/^[ \t]*```.*$/m).map((part, i) => {
    if (i % 2) return `<pre><code>${part.replace(/^\n/, "").replace(/\n$/, "")}</code></pre>`;
    return part.split(/\n[ \t]*\n/).map((p) => p.trim()).filter(Boolean)
      .map((p) => `<p>${renderInline(p).replace(/\n/g, "<br>")}</p>`).join("");
  }).join("");
}

// ---- the conversation on the page ----
function addMessage(role, text = "") {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  message.append(content);
  if (role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    message.append(stats);
  }
  $("messages").append(message);
  setText(message, text);
  return message;
}

function setText(message, text) {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;  // (else the reader scrolled up)
  const content = message.querySelector(".content");
  if (message.classList.contains("user")) content.textContent = text;
  else content.innerHTML = render(text);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function setStats(message, text, isError = false) {
  const stats = message.querySelector(".stats");
  stats.textContent = text;
  stats.classList.toggle("error", isError);
}

// fn(latest value) at most once per frame: rendering a long answer again for every token would be wasted work.
// flush() runs a call still waiting for its frame now.
function perFrame(fn) {
  let latest, frame = 0;
  const run = () => { frame = 0; fn(latest); };
  const call = (value) => {
    latest = value;
    frame ||= requestAnimationFrame(run);
  };
  call.flush = () => { if (frame) { cancelAnimationFrame(frame); run(); } };
  return call;
}

// ---- the server ----
function headers() {
  const key = localStorage.getItem(KEY_STORAGE);
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

async function errorMessage(response) {
  if (response.status === 401) askForKey();
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function askForKey() {
  $("key-form").hidden = false;
  $("api-key").focus();
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorMessage(response));
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
  } catch (e) {
    $("model").textContent = e.message;  // (a 401 has shown the key's field too)
  }
}

// The JSON payloads of a server-sent event stream, up to `data: [DONE]`.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function readSettings() {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  return { temperature: number("temperature"), top_p: number("top-p"), max_tokens: number("max-tokens"),
           system: $("system").value.trim() };
}

function setStreaming(controller) {
  state.controller = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
}

async function send(text) {
  const { system, ...sampling } = readSettings();
  const conversation = state.history;  // (New chat, meanwhile, starts another: this answer stays with its own)
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant");
  const show = perFrame((value) => setText(answer, value));
  const messages = system ? [{ role: "system", content: system }, ...conversation] : [...conversation];
  const controller = new AbortController();
  setStreaming(controller);
  setStats(answer, "…");
  const start = performance.now();
  let firstTokenAt = null, reply = "", usage = null, error = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model: state.model ?? undefined, messages, ...sampling, stream: true,
                             stream_options: { include_usage: true } }),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);  // (the server ended the stream early)
      if (event.usage) usage = event.usage;
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        firstTokenAt ??= performance.now();
        reply += delta;
        show(reply);
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") error = e.message;  // (an AbortError is the Stop button)
  } finally {
    if (state.controller === controller) setStreaming(null);  // (unless New chat has moved on)
  }
  show.flush();
  if (error !== null) {
    // The question goes back to the input box, to send again; the conversation forgets it.
    conversation.pop();
    if ($("input").value === "") $("input").value = text;
    setStats(answer, error, true);
    return;
  }
  conversation.push({ role: "assistant", content: reply });
  const end = performance.now();
  const ttft = firstTokenAt === null ? "" : ` · time to first token ${Math.round(firstTokenAt - start)} ms`;
  if (controller.signal.aborted) {
    setStats(answer, `stopped${ttft}`);
  } else if (usage) {
    // Decode speed: the tokens after the first, over the time after the first.
    const n = usage.completion_tokens;
    const seconds = (end - firstTokenAt) / 1000;
    const rate = n > 1 && seconds > 0 ? ` · ${((n - 1) / seconds).toFixed(1)} tokens/s` : "";
    setStats(answer, `${n} tokens${rate}${ttft}`);
  } else {
    setStats(answer, ttft.slice(3));
  }
}

// ---- the controls ----
function newChat() {
  state.controller?.abort();
  setStreaming(null);
  state.history = [];
  $("messages").replaceChildren();
  $("input").focus();
}

function restoreSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE)) ?? {};
  } catch { /* (none saved, or not ours) */ }
  for (const id of SETTINGS) if (typeof saved[id] === "string") $(id).value = saved[id];
}

function saveSettings() {
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(Object.fromEntries(SETTINGS.map((id) => [id, $(id).value]))));
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", newChat);
$("settings-toggle").addEventListener("click", () => {
  $("settings").hidden = !$("settings").hidden;
  $("settings-toggle").setAttribute("aria-expanded", String(!$("settings").hidden));
});
$("settings").addEventListener("input", saveSettings);
$("settings").addEventListener("submit", (event) => event.preventDefault());
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  $("api-key").value = "";
  $("key-form").hidden = true;
  loadModel();
});

restoreSettings();
loadModel();
$("input").focus();

// For tests and the curious: the page's own rendering path.
window.tinyvllmChat = { render, addMessage, send };
