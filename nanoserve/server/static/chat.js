// The nanoserve chat page: streams replies from /v1/chat/completions (SSE over fetch).
// Everything the model or the user wrote is inserted as text (textContent / text nodes), never
// parsed as HTML, so output such as "<script>" shows up literally and cannot run.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "nanoserve.apiKey";
const conversation = []; // {role, content} messages sent back to the server on every turn
let controller = null; // AbortController of the reply being streamed
let modelId = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  $("empty")?.remove();
  const box = document.createElement("div");
  box.className = "msg " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(label, body, meta);
  $("transcript").append(box);
  scrollDown();
  return { box, body, meta };
}

function scrollDown() {
  const t = $("transcript");
  t.scrollTop = t.scrollHeight;
}

async function errorText(response) {
  try {
    const data = await response.json();
    if (data?.error?.message) return `${response.status}: ${data.error.message}`;
  } catch (_) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText}`;
}

// Parses a text/event-stream body into {event, data} records (comments such as keep-alives skipped).
async function* sseEvents(response, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  signal.addEventListener("abort", () => reader.cancel().catch(() => {}), { once: true });
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line === "" || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") event = val;
        else if (field === "data") data.push(val);
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 1),
  };
  const topK = parseInt($("top-k").value, 10);
  if (topK > 0) body.top_k = topK;
  if (modelId) body.model = modelId;
  return body;
}

function describe(stats) {
  const parts = [];
  if (stats.ttft !== null) parts.push(`first token ${Math.round(stats.ttft)} ms`);
  parts.push(`${stats.tokens} tokens`);
  if (stats.tokens > 1 && stats.last > stats.first) {
    const rate = (stats.tokens - 1) / ((stats.last - stats.first) / 1000);
    parts.push(`${rate.toFixed(1)} tok/s`);
  }
  parts.push(`finish: ${stats.finish ?? "…"}`);
  // The server left the oldest turns out so the conversation fits the model's window.
  if (stats.dropped) parts.push(`${stats.dropped} oldest message${stats.dropped > 1 ? "s" : ""} left out`);
  return parts.join(" · ");
}

async function streamReply(reply, stats, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal,
  });
  if (!response.ok) throw new Error(await errorText(response));
  stats.dropped = Number(response.headers.get("X-Nanoserve-Dropped-Messages") ?? 0);
  for await (const { event, data } of sseEvents(response, signal)) {
    if (data === "[DONE]") break;
    const payload = JSON.parse(data);
    if (event === "error") throw new Error(payload?.error?.message ?? data);
    if (payload.usage) stats.tokens = payload.usage.completion_tokens;
    for (const choice of payload.choices ?? []) {
      const text = choice.delta?.content;
      if (text) {
        const now = performance.now();
        if (stats.first === null) { stats.first = now; stats.ttft = now - stats.start; }
        stats.last = now;
        stats.tokens += 1;
        reply.body.append(document.createTextNode(text));
        stats.text += text;
        scrollDown();
      }
      if (choice.finish_reason) stats.finish = choice.finish_reason;
    }
    reply.meta.textContent = describe(stats);
  }
}

async function send(event) {
  event?.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  addMessage("user", text);
  conversation.push({ role: "user", content: text });

  const reply = addMessage("assistant", "");
  reply.box.classList.add("streaming");
  const stats = { start: performance.now(), first: null, last: null, ttft: null, tokens: 0, text: "", finish: null };
  controller = new AbortController();
  setBusy(true);
  const signal = controller.signal;
  try {
    await streamReply(reply, stats, signal);
    if (signal.aborted) stats.finish = "stopped";
    else if (stats.finish === null) throw new Error("the stream ended before the reply was finished");
  } catch (err) {
    if (signal.aborted) {
      stats.finish = "stopped";
    } else {
      stats.finish = "error";
      addMessage("error", String(err.message ?? err));
    }
  } finally {
    reply.box.classList.remove("streaming");
    reply.meta.textContent = describe(stats);
    $("status").textContent = `Last reply: ${describe(stats)}`;
    // Keep even a partial reply in the conversation: it is what the user saw.
    if (stats.text) conversation.push({ role: "assistant", content: stats.text });
    controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy ? "true" : "false";
}

// The served models (GET /v1/models, the default first); the picker shows when there are several.
let models = [];

function showModel(card) {
  modelId = card.id;
  $("model").textContent = card.max_model_len ? `${card.id} · ${card.max_model_len}-token window` : card.id;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) {
      $("model").textContent = response.status === 401 ? "API key required (see Connection)" : await errorText(response);
      return;
    }
    const data = await response.json();
    models = data.data ?? [];
    const card = models.find((m) => m.id === modelId) ?? models[0];
    if (!card) return;
    const picker = $("model-picker");
    picker.replaceChildren(...models.map((m) => new Option(m.id, m.id)));  // text, never HTML
    picker.value = card.id;
    picker.hidden = models.length < 2;
    showModel(card);
  } catch (err) {
    $("model").textContent = "server unreachable";
  }
}

function bindRange(id) {
  const input = $(id);
  const show = () => { $(id + "-value").textContent = Number(input.value).toFixed(2); };
  input.addEventListener("input", show);
  show();
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) ?? "";
  $("api-key").addEventListener("change", () => {
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
    loadModel();
  });
  $("model-picker").addEventListener("change", () => {
    const card = models.find((m) => m.id === $("model-picker").value);
    if (card) showModel(card);
  });
  bindRange("temperature");
  bindRange("top-p");
  $("composer").addEventListener("submit", send);
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
    if (e.key === "Escape") controller?.abort();
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", () => {
    controller?.abort();
    conversation.length = 0;
    $("transcript").replaceChildren();
    $("status").textContent = "";
  });
  setBusy(false);
  loadModel();
  $("prompt").focus();
}

init();
