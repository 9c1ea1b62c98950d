"use strict";
// specserve's chat page: plain DOM, no framework, no build step. Model output and anything typed is only
// ever put on the page through textContent, never as HTML.

const STORE_CONVS = "specserve.conversations";
const STORE_KEY = "specserve.apiKey";
const STORE_MODEL = "specserve.model";  // the model picked on a router (serve --models-dir)
// The draft-free speculative types the server accepts; "draft" is offered only when /props names a draft model.
const SPEC_TYPES = ["none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-suffix", "ngram-cache"];
// Settings field -> the key of its default in /props' default_generation_settings.params.
const DEFAULT_KEYS = {temperature: "temperature", top_p: "top_p", top_k: "top_k", max_tokens: "n_predict",
  seed: "seed", "speculative.type": "speculative.type", "speculative.n_max": "speculative.n_max"};

const $ = (id) => document.getElementById(id);
const app = {convs: [], current: null, props: null, controller: null, ready: false, model: null};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- storage ---------------------------------------------------------------------------------------

function loadConvs() {
  try {
    const convs = JSON.parse(localStorage.getItem(STORE_CONVS) || "[]");
    if (Array.isArray(convs)) return convs.filter((c) => c && Array.isArray(c.messages));
  } catch (e) { /* a corrupt store starts afresh rather than breaking the page */ }
  return [];
}

function saveConvs() {
  try {
    localStorage.setItem(STORE_CONVS, JSON.stringify(app.convs));
  } catch (e) { /* quota full: the chat goes on, only unsaved */ }
}

function newConv() {
  const conv = {id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat",
    messages: [], settings: {}};
  app.convs.unshift(conv);
  selectConv(conv);
  saveConvs();
}

function selectConv(conv) {
  app.current = conv;
  renderList();
  renderMessages();
  renderSettings();
  $("prompt").focus();
}

// ---- server ----------------------------------------------------------------------------------------

function authHeaders() {
  const key = localStorage.getItem(STORE_KEY);
  return key ? {Authorization: "Bearer " + key} : {};
}

function setStatus(state, text) {
  const node = $("server-status");
  node.dataset.state = state;
  node.textContent = text;
  $("key-form").classList.toggle("needed", state === "needs-key");
}

async function connect() {
  app.ready = false;
  updateButtons();
  // /health is public and answers 503 while the model loads
  for (;;) {
    try {
      const r = await fetch("/health");
      if (r.ok) break;
      const body = await r.json().catch(() => ({}));
      setStatus("loading", (body.error && body.error.message) || "loading model…");
    } catch (e) {
      setStatus("offline", "server unreachable, retrying…");
    }
    await new Promise((done) => setTimeout(done, 1000));
  }
  if (!(await pickModel())) return;
  if (app.model) setStatus("loading", "loading " + app.model + "…");
  const r = await fetch("/props" + (app.model ? "?model=" + encodeURIComponent(app.model) : ""),
    {headers: authHeaders()});
  if (r.status === 401) {
    setStatus("needs-key", "this server needs an API key: enter it below");
    $("api-key").focus();
    return;
  }
  if (!r.ok) {
    setStatus("error", "/props answered " + r.status);
    return;
  }
  app.props = await r.json();
  $("model-name").textContent = app.props.model_alias || "specserve";
  setStatus("ready", "ready · " + app.props.total_slots + " slot(s)");
  app.ready = true;
  renderSettings();
  updateButtons();
}

// A router lists its models with a status each: offer them in the picker (hidden on a one-model server) and
// send the chosen one with every request. False where the page cannot go on (a key is needed).
async function pickModel() {
  const r = await fetch("/v1/models", {headers: authHeaders()});
  if (r.status === 401) {
    setStatus("needs-key", "this server needs an API key: enter it below");
    $("api-key").focus();
    return false;
  }
  const models = r.ok ? ((await r.json()).data || []) : [];
  const picker = $("model-pick");
  const router = models.some((m) => m.status);
  picker.hidden = !router;
  if (!router) {
    app.model = null;
    return true;
  }
  const saved = localStorage.getItem(STORE_MODEL);
  app.model = models.some((m) => m.id === saved) ? saved : models[0].id;
  picker.replaceChildren(...models.map((m) => {
    const option = el("option", "", m.id + " (" + m.status.value + ")");
    option.value = m.id;
    return option;
  }));
  picker.value = app.model;
  return true;
}

// ---- rendering -------------------------------------------------------------------------------------

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of app.convs) {
    const item = el("li", conv === app.current ? "current" : "");
    const open = el("button", "open", conv.title);
    open.type = "button";
    open.addEventListener("click", () => { if (!app.controller) selectConv(conv); });
    const del = el("button", "delete", "×");
    del.type = "button";
    del.setAttribute("aria-label", "Delete " + conv.title);
    del.addEventListener("click", () => deleteConv(conv));
    item.append(open, del);
    list.append(item);
  }
  $("chat-title").textContent = app.current ? app.current.title : "";
}

function deleteConv(conv) {
  if (app.controller && conv === app.current) return;  // not the one streaming
  app.convs = app.convs.filter((c) => c !== conv);
  saveConvs();
  if (conv !== app.current) renderList();
  else if (app.convs.length) selectConv(app.convs[0]);
  else newConv();
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  for (const msg of app.current.messages) box.append(messageNode(msg));
  box.scrollTop = box.scrollHeight;
}

function messageNode(msg) {
  const node = el("div", "msg " + msg.role);
  node.dataset.state = msg.state || "done";
  node.append(el("div", "role", msg.role));
  if (msg.role === "assistant") {
    // the model's reasoning, collapsed: the answer is what the reader came for
    const reasoning = el("details", "reasoning");
    reasoning.append(el("summary", "", "reasoning"), el("div", "reasoning-text", ""));
    node.append(reasoning);
  }
  node.append(el("div", "text", msg.content));
  if (msg.role === "assistant") node.append(el("div", "tool-calls"), el("div", "stats", statsText(msg)));
  if (msg.role === "assistant") fillParts(node, msg);
  return node;
}

// Reasoning and tool calls of an answer (delta.reasoning_content, delta.tool_calls) into its node.
function fillParts(node, msg) {
  const reasoning = node.querySelector(".reasoning");
  reasoning.hidden = !msg.reasoning;
  node.querySelector(".reasoning-text").textContent = msg.reasoning || "";
  const calls = node.querySelector(".tool-calls");
  calls.replaceChildren(...(msg.toolCalls || []).map((c) =>
    el("div", "tool-call", "tool call: " + c.name + "(" + c.arguments + ")")));
}

function fmt(x, digits = 1) {
  return Number(x).toFixed(digits);
}

// What the page knows about a message's speed: the server's timings once the final chunk came, before that
// a live lower bound (a streamed chunk holds one or more tokens: several when a draft was accepted).
function statsText(msg) {
  if (msg.error) return "error: " + msg.error;
  const t = msg.timings;
  if (t) {
    const parts = [t.predicted_n + " tokens", fmt(t.predicted_per_second) + " tok/s"];
    parts.push(t.draft_n ? "draft " + t.draft_n_accepted + "/" + t.draft_n + " accepted (" +
      fmt(100 * t.draft_n_accepted / t.draft_n, 0) + "%)" : "no drafts");
    parts.push("prompt " + t.prompt_n + " tok" + (t.cache_n ? " (+" + t.cache_n + " cached)" : "") + " at " +
      fmt(t.prompt_per_second, 0) + " tok/s");
    if (msg.finish === "length") parts.push("stopped at max tokens");
    return parts.join(" · ");
  }
  const live = msg.live;
  const span = live ? live.last - live.first : 0;
  const rate = span > 0 ? "≥ " + fmt(1000 * (live.chunks - 1) / span) + " tok/s" : "";
  if (msg.state === "stopped") {
    return ["stopped", live ? live.chunks + " chunks" : "", rate].filter(Boolean).join(" · ");
  }
  if (msg.state === "streaming") return live ? "streaming · " + rate : "waiting for the first token…";
  return "";
}

function renderSettings() {
  const conv = app.current;
  if (!conv) return;
  const defaults = (app.props && app.props.default_generation_settings.params) || {};
  const select = $("s-spec_type");
  const types = SPEC_TYPES.concat(app.props && app.props.draft_model_path ? ["draft"] : []);
  const def = defaults["speculative.type"];
  select.replaceChildren(el("option", "", "server default" + (def ? " (" + def + ")" : "")));
  select.firstChild.value = "";
  for (const type of types) select.append(el("option", "", type));
  if (conv.settings["speculative.type"] && !types.includes(conv.settings["speculative.type"])) {
    delete conv.settings["speculative.type"];  // e.g. "draft" saved against a server that had a draft model
  }
  for (const input of document.querySelectorAll("#settings [data-setting]")) {
    const key = input.dataset.setting;
    input.value = conv.settings[key] === undefined ? "" : conv.settings[key];
    if (input.tagName === "INPUT" && DEFAULT_KEYS[key] && DEFAULT_KEYS[key] in defaults) {
      const value = defaults[DEFAULT_KEYS[key]];
      input.placeholder = key === "max_tokens" && value < 0 ? "no limit" : String(value);
    }
  }
}

function updateButtons() {
  const busy = app.controller !== null;
  document.body.dataset.busy = String(busy);
  $("send").disabled = busy || !app.ready;
  $("stop").disabled = !busy;
}

// ---- chatting --------------------------------------------------------------------------------------

function requestBody(conv) {
  const s = conv.settings;
  const messages = [];
  if (s.system && s.system.trim()) messages.push({role: "system", content: s.system});
  for (const m of conv.messages) {
    // a failed answer is left out; a stopped one stays, as the user saw it
    if (m.role === "user" || (m.role === "assistant" && !m.error && (m.content || m.toolCalls))) {
      const out = {role: m.role, content: m.content || null};
      if (m.toolCalls && m.toolCalls.length) {
        out.tool_calls = m.toolCalls.map((c) => ({id: c.id, type: "function",
          function: {name: c.name, arguments: c.arguments}}));
      }
      messages.push(out);
    }
  }
  const body = {messages, stream: true};
  if (app.model) body.model = app.model;
  const tools = parseTools(s.tools);
  if (tools) body.tools = tools;
  for (const input of document.querySelectorAll("#settings input[data-setting], #settings select")) {
    const key = input.dataset.setting;
    const raw = s[key];
    if (raw === undefined || raw === "") continue;
    const kind = input.dataset.kind;
    const value = kind === "int" ? parseInt(raw, 10) : kind === "float" ? parseFloat(raw) : raw;
    if (kind && !Number.isFinite(value)) continue;  // half-typed numbers are left to the server default
    body[key] = value;
  }
  return body;
}

// The settings' tools: an OpenAI `tools` list as JSON (a bare list of functions is wrapped); none if empty or
// not JSON (the field shows that itself).
function parseTools(text) {
  if (!text || !text.trim()) return null;
  try {
    const list = JSON.parse(text);
    if (!Array.isArray(list) || !list.length) return null;
    return list.map((t) => (t.type === "function" ? t : {type: "function", function: t}));
  } catch (e) {
    return null;
  }
}

async function send() {
  const text = $("prompt").value.trim();
  const conv = app.current;
  if (!text || app.controller || !app.ready) return;
  conv.messages.push({role: "user", content: text});
  if (conv.title === "New chat") conv.title = text.length > 40 ? text.slice(0, 40) + "…" : text;
  const body = requestBody(conv);
  const msg = {role: "assistant", content: "", state: "streaming"};
  conv.messages.push(msg);
  $("prompt").value = "";
  renderList();
  renderMessages();
  const node = $("messages").lastChild;
  const controller = new AbortController();
  app.controller = controller;
  updateButtons();
  try {
    await stream(body, msg, node, controller.signal);
  } catch (e) {
    if (e.name === "AbortError") msg.state = "stopped";
    else { msg.state = "error"; msg.error = String(e.message || e); }
  } finally {
    if (msg.state === "streaming") msg.state = msg.timings ? "done" : "error";
    if (msg.state === "error" && !msg.error) msg.error = "the stream ended without a final chunk";
    app.controller = null;
    draw(node, msg);
    updateButtons();
    saveConvs();
  }
}

function draw(node, msg) {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  node.dataset.state = msg.state;
  node.querySelector(".text").textContent = msg.content;
  fillParts(node, msg);
  node.querySelector(".stats").textContent = statsText(msg);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

// POST /v1/chat/completions with stream: the server applies the model's chat template; its last chunk (the
// one with finish_reason) carries llama-server's `timings`, draft counts included.
async function stream(body, msg, node, signal) {
  const r = await fetch("/v1/chat/completions", {method: "POST", signal, body: JSON.stringify(body),
    headers: {"Content-Type": "application/json", ...authHeaders()}});
  if (!r.ok) {
    const err = await r.json().catch(() => ({}));
    if (r.status === 401) setStatus("needs-key", "this server needs an API key: enter it below");
    throw new Error((err.error && err.error.message) || "HTTP " + r.status);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data), msg);
      draw(node, msg);
    }
  }
}

function onEvent(obj, msg) {
  if (obj.error) throw new Error(obj.error.message || "server error");
  const choice = obj.choices && obj.choices[0];
  const delta = (choice && choice.delta) || {};
  if (delta.reasoning_content) msg.reasoning = (msg.reasoning || "") + delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    msg.toolCalls = msg.toolCalls || [];
    const slot = msg.toolCalls[call.index] || (msg.toolCalls[call.index] = {id: "", name: "", arguments: ""});
    if (call.id) slot.id = call.id;
    if (call.function && call.function.name) slot.name += call.function.name;
    if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
  }
  const piece = delta.content;
  if (piece) {
    const now = performance.now();
    msg.live = msg.live || {chunks: 0, first: now, last: now};
    msg.live.chunks += 1;
    msg.live.last = now;
    msg.content += piece;
  }
  if (choice && choice.finish_reason) msg.finish = choice.finish_reason;
  if (obj.timings) msg.timings = obj.timings;
}

// ---- wiring ----------------------------------------------------------------------------------------

function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  // aborting the fetch closes the connection; the server cancels the task and frees its slot
  $("stop").addEventListener("click", () => { if (app.controller) app.controller.abort(); });
  $("new-chat").addEventListener("click", () => { if (!app.controller) newConv(); });
  $("toggle-settings").addEventListener("click", () => document.body.classList.toggle("settings-hidden"));
  $("model-pick").addEventListener("change", () => {
    localStorage.setItem(STORE_MODEL, $("model-pick").value);
    connect();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(STORE_KEY, key);
    else localStorage.removeItem(STORE_KEY);
    connect();
  });
  for (const input of document.querySelectorAll("#settings [data-setting]")) {
    input.addEventListener("input", () => {
      const value = input.value;
      if (value === "") delete app.current.settings[input.dataset.setting];
      else app.current.settings[input.dataset.setting] = value;
      saveConvs();
    });
  }
  $("reset-settings").addEventListener("click", () => {
    app.current.settings = {};
    saveConvs();
    renderSettings();
  });
}

function main() {
  wire();
  $("api-key").value = localStorage.getItem(STORE_KEY) || "";
  app.convs = loadConvs();
  for (const conv of app.convs) {
    conv.settings = conv.settings || {};
    // a page closed mid-answer leaves a message that no longer streams
    for (const m of conv.messages) if (m.state === "streaming") m.state = "stopped";
  }
  if (app.convs.length) selectConv(app.convs[0]);
  else newConv();
  connect();
}

main();
