// beeswarm's web app: chat through /v1/chat/completions (streamed), and the swarm as this server hears it
// (/api/swarm, polled). No framework and no build step. Everything a peer or the server sends is put in
// the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 2000;        // the swarm view's refresh
const HISTORY = 60;          // tokens/s samples kept per member for its sparkline (2 minutes)
const GONE_SHOWN_MS = 60000; // how long a member that left stays listed, struck through

const $ = (id) => document.getElementById(id);
const state = {
  config: null,
  key: sessionStorage.getItem("beeswarm.key"),
  messages: [],          // the conversation sent with each request
  controller: null,      // the reply being streamed (AbortController)
  history: new Map(),    // peer -> [tokens/s, ...]
  gone: new Map(),       // peer -> {row, since}
  lastSeen: new Map(),   // peer -> its last member row
  polling: false,
};

// ---- helpers ---------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
const short = (peer) => (peer && peer.length > 9 ? "…" + peer.slice(-8) : peer || "");
const span = (start, end) => `${start}–${end}`;   // layers [start, end)
const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

// An API error ({message, code}) as a sentence a person can act on.
const SENTENCES = {
  invalid_api_key: "This server needs its API key: enter it above, then send again.",
  no_route: "The swarm has no route right now: some layers have nobody serving them. Contributors usually fill " +
            "the gap within a minute; try again shortly.",
  swarm_busy: "The swarm is full right now: its contributors are serving other sessions. Try again in a few seconds.",
  swarm_failed: "The swarm kept failing on this request (contributors left or erred on the way). Try again shortly.",
  too_many_requests: "This server is answering as many requests as it takes at once. Try again in a moment.",
  audit_failed: "An audit caught a contributor returning wrong results, so this reply cannot be trusted. Send it again.",
};
class ApiFailure extends Error {
  constructor(error) { super(error.message || "error"); this.error = error; }
}
function sentence(error) {
  return SENTENCES[error.code] || error.message || "Something went wrong on the server.";
}
async function failureOf(response) {
  try {
    const body = await response.json();
    if (body && body.error) return new ApiFailure(body.error);
  } catch (_) { /* not JSON: fall through */ }
  return new ApiFailure({ message: `The server answered ${response.status} ${response.statusText}.` });
}
const UNREACHABLE = "Cannot reach the server: is `beeswarm serve` still running?";

// ---- tabs, theme -----------------------------------------------------------------------------------
const tabs = [$("tab-chat"), $("tab-swarm")];
function select(tab, focus = false) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", on);
    t.tabIndex = on ? 0 : -1;
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
  if (focus) tab.focus();
  history.replaceState(null, "", tab.id === "tab-swarm" ? "#swarm" : "#chat");
  if (tab.id === "tab-swarm") poll();
}
for (const t of tabs) {
  t.addEventListener("click", () => select(t));
  t.addEventListener("keydown", (e) => {
    const i = tabs.indexOf(t);
    const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[e.key];
    if (next === undefined) return;
    e.preventDefault();
    select(tabs[(next + tabs.length) % tabs.length], true);
  });
}

const THEMES = ["auto", "light", "dark"];
function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  $("theme").textContent = "Theme: " + theme;
  localStorage.setItem("beeswarm.theme", theme);
}
$("theme").addEventListener("click", () => {
  const now = localStorage.getItem("beeswarm.theme") || "auto";
  applyTheme(THEMES[(THEMES.indexOf(now) + 1) % THEMES.length]);
});

// ---- the API key -----------------------------------------------------------------------------------
function askForKey(note = "") {
  $("key-form").hidden = false;
  $("key-note").textContent = note;
  $("key-input").focus();
}
$("key-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  state.key = $("key-input").value.trim();
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      askForKey("That key was refused.");
      return;
    }
  } catch (_) {
    askForKey(UNREACHABLE);
    return;
  }
  sessionStorage.setItem("beeswarm.key", state.key);
  $("key-form").hidden = true;
  $("key-input").value = "";
  $("prompt").focus();
  poll();
});

// ---- chat ------------------------------------------------------------------------------------------
const FIELDS = ["temperature", "top_p", "repetition_penalty", "max_tokens"];
function resetSampling() {
  for (const f of FIELDS) $(f).value = state.config.defaults[f];
}
$("reset-sampling").addEventListener("click", resetSampling);

function sampling() {
  const out = {};
  for (const f of FIELDS) {
    const input = $(f);
    if (!input.checkValidity() || input.value === "") {
      throw new ApiFailure({ message: `${input.parentElement.firstChild.textContent.trim()} must be a number ` +
                                     `between ${input.min} and ${input.max || "the context's length"}.` });
    }
    out[f] = f === "max_tokens" ? parseInt(input.value, 10) : parseFloat(input.value);
  }
  return out;
}

function addMessage(role, text) {
  const content = el("div", { class: "content", text });
  const li = el("li", { class: role }, el("div", { class: "who", text: { user: "You", error: "Error" }[role] || "Swarm" }), content);
  $("messages").append(li);
  li.scrollIntoView({ block: "end" });
  return li;
}

function describe(extras, usage) {
  const parts = [];
  if (usage) parts.push(plural(usage.completion_tokens, "token"));
  if (extras) {
    parts.push(`${extras.tokens_per_s.toFixed(1)} tokens/s`, `first token ${extras.ttft_s.toFixed(2)} s`);
    if (extras.accepted_per_round != null) parts.push(`${extras.accepted_per_round.toFixed(2)} draft tokens accepted per round`);
    parts.push("route " + extras.route.map((s) => `${short(s.peer)} ${span(s.start, s.end)}`).join(" → "));
    parts.push(plural(extras.recoveries, "recovery").replace("recoverys", "recoveries"));
    const a = extras.audits || {};
    if (a.run) parts.push(`audits: ${a.passed} passed${a.failed ? `, ${a.failed} caught` : ""}${a.refused ? `, ${a.refused} refused` : ""}`);
  }
  return parts.join(" · ");
}

// Server-sent events of a fetch response body: yields each event's data.
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  let params;
  try {
    params = sampling();
  } catch (e) {
    addMessage("error", e.error.message);
    return;
  }
  $("prompt").value = "";
  const conversation = state.messages;  // "New chat" while this streams starts another: this reply stays in its own
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.classList.add("streaming");
  const content = reply.querySelector(".content");
  const controller = (state.controller = new AbortController());
  setBusy(true);
  let answer = "", extras = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model: state.config.model, messages: conversation, stream: true,
                             stream_options: { include_usage: true }, ...params }),
    });
    if (!response.ok) throw await failureOf(response);
    for await (const data of events(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiFailure(chunk.error);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.beeswarm) extras = chunk.beeswarm;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          content.textContent = answer;
        }
      }
    }
    conversation.push({ role: "assistant", content: answer });
    reply.append(el("div", { class: "meta", text: describe(extras, usage) }));
    reply.dataset.done = "true";
  } catch (e) {
    if (e.name === "AbortError") {  // stopped: what came stays in the conversation
      conversation.push({ role: "assistant", content: answer });
      reply.append(el("div", { class: "meta", text: "stopped" }));
      reply.dataset.done = "stopped";
    } else {
      conversation.pop();  // the question was not answered: it goes back to the box, to send again
      if (!$("prompt").value) $("prompt").value = text;
      reply.className = "error";
      reply.setAttribute("role", "alert");
      reply.querySelector(".who").textContent = "Error";
      content.textContent = e instanceof ApiFailure ? sentence(e.error) : UNREACHABLE;
      reply.dataset.done = "error";
      if (e instanceof ApiFailure && e.error.code === "invalid_api_key") askForKey(state.key ? "That key was refused." : "");
    }
  } finally {
    reply.classList.remove("streaming");
    if (state.controller === controller) state.controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (text && !state.controller && state.config) send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.controller) state.controller.abort();
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren();
  $("prompt").focus();
});

// ---- the swarm -------------------------------------------------------------------------------------
function sparkline(values) {
  const w = 90, h = 22, max = Math.max(1, ...values);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("aria-hidden", "true");
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  const step = values.length > 1 ? w / (HISTORY - 1) : 0;
  const x0 = w - step * (values.length - 1);
  line.setAttribute("points", values.map((v, i) => `${(x0 + i * step).toFixed(1)},${(h - 1 - (v / max) * (h - 2)).toFixed(1)}`).join(" "));
  svg.append(line);
  return svg;
}

function memberRow(m, gone) {
  const layers = m.spans.map(([s, e]) => span(s, e)).join(", ") || "–";
  const cells = [
    el("td", { class: "mono", title: m.peer, text: short(m.peer) + (m.coordinator ? " ★" : "") }),
    el("td", { text: m.role }),
    el("td", { text: gone ? "gone" : m.state }),
    el("td", { text: m.reach }),
    el("td", { text: layers }),
    el("td", { text: m.device || "–" }),
    el("td", { class: "num", text: m.tokens_per_s.toFixed(1) }),
    el("td", { class: "num", text: `${Math.round(m.busy * 100)}%` }),
    el("td", { class: "num", text: gone ? "–" : `${m.heartbeat_age_s.toFixed(1)} s` }),
    el("td", { class: "num", text: m.credits ? m.credits.balance.toLocaleString() + (m.credits.forfeited ? " (forfeited)" : "") : "–",
               title: m.credits ? `earned ${m.credits.earned.toLocaleString()}, spent ${m.credits.spent.toLocaleString()} ` +
                                  `layer-tokens; last hour +${m.credits.last_hour.earned.toLocaleString()}` : "no account yet" }),
    el("td", { title: "tokens/s served, the last two minutes" }, sparkline(state.history.get(m.peer) || [])),
  ];
  const row = el("tr", { "data-peer": m.peer, "data-state": gone ? "gone" : m.state }, ...cells);
  if (gone) row.className = "gone";
  if (m.coordinator) row.setAttribute("aria-label", "coordinator");
  return row;
}

function pipelines(list) {
  return el("ol", {}, ...list.map((p) => el("li", {
    text: p.stages.map((s) => `${short(s.node)} ${span(s.start, s.end)}`).join(" → ") +
          ` · ${p.tokens_per_s.toFixed(1)} tokens/s planned` +
          (p.micro_batches > 1 ? ` · ${p.micro_batches} micro-batches` : ""),
  })));
}

function render(r) {
  const now = Date.now();
  const contributors = r.members.filter((m) => m.role === "contributor").length;
  const summary = $("swarm-summary");
  summary.replaceChildren(
    r.coordinator ? `Coordinator ${short(r.coordinator)}, term ${r.term}, epoch ${r.epoch}. ` : "No coordinator heard yet. ",
    `${plural(contributors, "contributor")}, ${plural(r.members.length - contributors, "client")} besides this server. `,
    r.num_layers
      ? (r.complete
          ? el("span", { class: "complete", text: `All ${r.num_layers} layers served.` })
          : el("span", { class: "incomplete",
                         text: `${r.gaps.reduce((n, g) => n + g.end - g.start, 0)} of ${r.num_layers} layers unserved.` }))
      : "Layers: unknown yet.",
  );
  summary.dataset.complete = r.complete;

  const bar = $("layers");
  bar.replaceChildren(...r.spans.map((s) => {
    const who = s.nodes.map(short).join(", ");
    const seg = el("div", {
      class: "seg" + (s.replicas === 0 ? " gap" : s.replicas > 1 ? " r2" : ""),
      title: s.replicas ? `layers ${span(s.start, s.end)}: ${plural(s.replicas, "replica")} (${who})`
                        : `layers ${span(s.start, s.end)}: nobody serves them`,
      "data-replicas": s.replicas,
    }, span(s.start, s.end), el("span", { class: "names", text: s.replicas ? `×${s.replicas} ${who}` : "GAP" }));
    seg.style.flexGrow = s.end - s.start;
    return seg;
  }));
  bar.setAttribute("aria-label", r.spans.length
    ? r.spans.map((s) => `layers ${span(s.start, s.end)}: ${s.replicas ? plural(s.replicas, "replica") : "gap"}`).join("; ")
    : "no layers known yet");

  const peers = new Set(r.members.map((m) => m.peer));
  for (const m of r.members) {
    const h = state.history.get(m.peer) || [];
    h.push(m.tokens_per_s);
    if (h.length > HISTORY) h.shift();
    state.history.set(m.peer, h);
    state.gone.delete(m.peer);
  }
  for (const [peer, m] of state.lastSeen) {
    if (!peers.has(peer) && !state.gone.has(peer)) state.gone.set(peer, { row: m, since: now });
  }
  for (const [peer, g] of state.gone) {
    if (now - g.since > GONE_SHOWN_MS) {
      state.gone.delete(peer);
      state.history.delete(peer);  // a member gone for good takes its sparkline with it
    }
  }
  state.lastSeen = new Map(r.members.map((m) => [m.peer, m]));
  $("members").tBodies[0].replaceChildren(
    ...r.members.map((m) => memberRow(m, false)),
    ...[...state.gone.values()].map((g) => memberRow(g.row, true)),
  );

  const plans = $("plans");
  if (!r.plan) {
    plans.replaceChildren(el("p", { class: "muted", text: "No plan heard yet." }));
  } else {
    const p = r.plan;
    plans.replaceChildren(
      el("p", { text: `Term ${p.term}, epoch ${p.epoch}, by ${short(p.coordinator)}; objective ${p.objective}` +
                      (p.quant !== "none" ? `, ${p.quant} weights` : "") + (p.migrating ? "; migrating" : "") + "." }),
      el("h3", { class: "small", text: "Active" }), p.active.length ? pipelines(p.active) : el("p", { text: "(none)" }),
      el("h3", { class: "small", text: "Target" }),
      p.migrating ? pipelines(p.target) : el("p", { class: "muted", text: "the same as the active plan" }),
    );
    const standings = Object.entries(p.standings || {});
    if (standings.length) {
      plans.append(el("p", { class: "small", text: "Audits passed: " +
                             standings.map(([n, k]) => `${short(n)} ${k}`).join(", ") }));
    }
  }
  const excluded = r.plan ? r.plan.excluded : [];
  $("exclusions").replaceChildren(...(excluded.length ? excluded.map((e) => el("li", {
    text: `${short(e.node)}: ${e.reason}` +
          (e.until ? ` (until ${new Date(e.until * 1000).toLocaleString()})` : " (left out of plans)"),
  })) : [el("li", { class: "muted", text: "Nobody." })]));
  $("swarm-updated").textContent = `Updated ${new Date().toLocaleTimeString()}; refreshes every ${POLL_MS / 1000} s. ` +
    `This server: ${short(r.entry.peer)} (${r.entry.reach}); audits it ran: ${r.entry.audits.run}, ` +
    `caught ${r.entry.audits.failed}.`;
}

async function poll() {
  if (state.polling || !state.config) return;
  state.polling = true;
  const error = $("swarm-error");
  try {
    const response = await fetch("/api/swarm", { headers: headers() });
    if (!response.ok) throw await failureOf(response);
    render(await response.json());
    error.hidden = true;
  } catch (e) {
    error.textContent = e instanceof ApiFailure ? sentence(e.error) : UNREACHABLE;
    error.hidden = false;
    if (e instanceof ApiFailure && e.error.code === "invalid_api_key" && $("key-form").hidden) askForKey();
  } finally {
    state.polling = false;
  }
}

// ---- start -----------------------------------------------------------------------------------------
async function start() {
  applyTheme(localStorage.getItem("beeswarm.theme") || "auto");
  select(location.hash === "#swarm" ? tabs[1] : tabs[0]);  // before any fetch: the page opens where it was asked
  try {
    const response = await fetch("/api/config");
    if (!response.ok) throw await failureOf(response);
    state.config = await response.json();
  } catch (e) {
    $("model").textContent = UNREACHABLE;
    return;
  }
  $("model").textContent = `${state.config.model.split(/[\\/]/).filter(Boolean).pop()} · v${state.config.version}`;
  $("model").title = state.config.model;  // a local checkpoint's whole path
  $("max_tokens").max = state.config.context - 1;
  resetSampling();
  if (state.config.key_required && !state.key) askForKey();
  poll();
  setInterval(poll, POLL_MS);
  if (!state.config.key_required || state.key) $("prompt").focus();
}
start();
