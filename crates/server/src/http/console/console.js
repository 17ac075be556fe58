// sandfork's web console: one module, no framework. Every call goes to the
// node's (or gateway's) own control plane with the API key typed at login,
// kept in sessionStorage (this tab only). Pages are hash routes:
// #/sandboxes, #/sandbox/<id>, #/tree/<id>, #/templates.
// Data reaches the page as text nodes only (never innerHTML).

const KEY = "sandfork.apiKey";
const $ = (sel) => document.querySelector(sel);
const view = () => $("#view");
let refresh = null; // the sandbox page's timer

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// A request with the key; the node's JSON error message on failure.
async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY) || "";
  const headers = { "X-API-Key": key, ...(options.body ? { "Content-Type": "application/json" } : {}) };
  const res = await fetch(path, { ...options, headers });
  const text = await res.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!res.ok) {
    const message = (body && body.message) || text || res.statusText;
    if (res.status === 401) {
      logout(`The node refused the API key (401: ${message}).`);
    }
    throw new ApiError(res.status, message);
  }
  return body;
}

// An element: h("a", {href: "#"}, "text", child, ...).
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

const stateTag = (state) => h("span", { class: `state ${state}`, "data-state": state }, state);
const status = () => $("#status");

function say(message, isError = false) {
  const el = status();
  if (!el) return;
  el.textContent = message;
  el.className = isError ? "error" : "muted";
}

// Runs a lifecycle action, then redraws the page.
async function act(label, path, method) {
  say(`${label}…`);
  try {
    await api(path, { method, body: method === "POST" ? "{}" : undefined });
    say(`${label}: done.`);
  } catch (e) {
    say(`${label} failed: ${e.message}`, true);
    return;
  }
  // A killed sandbox has no page left to show.
  if (method === "DELETE" && location.hash.startsWith("#/sandbox/")) location.hash = "#/sandboxes";
  else await route();
}

function actions(sbx) {
  const id = sbx.sandboxID;
  const buttons = [];
  if (sbx.state === "running") {
    buttons.push(h("button", { type: "button", "data-action": "pause", onclick: () => act(`Pausing ${id}`, `/sandboxes/${id}/pause`, "POST") }, "Pause"));
  }
  if (sbx.state === "paused") {
    buttons.push(h("button", { type: "button", "data-action": "resume", onclick: () => act(`Resuming ${id}`, `/sandboxes/${id}/resume`, "POST") }, "Resume"));
  }
  if (sbx.state === "running" || sbx.state === "paused") {
    buttons.push(h("button", { type: "button", class: "danger", "data-action": "kill", onclick: () => {
      if (confirm(`Kill sandbox ${id}?`)) act(`Killing ${id}`, `/sandboxes/${id}`, "DELETE");
    } }, "Kill"));
  }
  return buttons;
}

// ---- Sandboxes --------------------------------------------------------------

const filters = { state: "", template: "", metadata: "" };

// "k=v, k2=v2" as E2B's SDKs send the metadata filter.
function metadataQuery(text) {
  return text.split(",").map((p) => p.trim()).filter(Boolean).map((p) => {
    const [k, ...v] = p.split("=");
    return `${encodeURIComponent(k.trim())}=${encodeURIComponent(v.join("=").trim())}`;
  }).join("&");
}

async function listSandboxes() {
  const q = new URLSearchParams({ limit: "100", state: filters.state || "running,paused" });
  const meta = metadataQuery(filters.metadata);
  if (meta) q.set("metadata", meta);
  const all = [];
  let next = "";
  do {
    if (next) q.set("nextToken", next);
    const key = sessionStorage.getItem(KEY) || "";
    const res = await fetch(`/v2/sandboxes?${q}`, { headers: { "X-API-Key": key } });
    if (!res.ok) {
      const body = await res.json().catch(() => ({}));
      if (res.status === 401) logout(`The node refused the API key (401: ${body.message || res.statusText}).`);
      throw new ApiError(res.status, body.message || res.statusText);
    }
    all.push(...(await res.json()));
    next = res.headers.get("x-next-token") || "";
  } while (next && all.length < 1000);
  const t = filters.template.trim();
  return t ? all.filter((s) => s.templateID === t || s.alias === t) : all;
}

async function sandboxesPage() {
  const input = (name, placeholder) => h("input", { name, placeholder, value: filters[name], onchange: (e) => {
    filters[name] = e.target.value;
    route();
  } });
  const stateSelect = h("select", { name: "state", onchange: (e) => {
    filters.state = e.target.value;
    route();
  } }, ["", "running", "paused"].map((s) => h("option", { value: s, selected: filters.state === s }, s || "any")));
  const rows = h("tbody");
  view().replaceChildren(
    h("h1", {}, "Sandboxes"),
    h("div", { class: "filters" },
      h("label", {}, "State", stateSelect),
      h("label", {}, "Template", input("template", "base")),
      h("label", {}, "Metadata", input("metadata", "key=value, key2=value2")),
      h("button", { type: "button", onclick: () => route() }, "Refresh")),
    h("p", { id: "status" }),
    h("table", { id: "sandboxes" },
      h("thead", {}, h("tr", {}, ["Sandbox", "Template", "State", "Started", "CPU / memory", "Metadata", ""].map((c) => h("th", {}, c)))),
      rows));
  const list = await listSandboxes();
  list.sort((a, b) => (a.startedAt < b.startedAt ? 1 : -1));
  rows.replaceChildren(...list.map((s) => h("tr", { "data-sandbox-id": s.sandboxID },
    h("td", {}, h("a", { class: "id", href: `#/sandbox/${s.sandboxID}` }, s.sandboxID)),
    h("td", {}, s.alias || s.templateID),
    h("td", {}, stateTag(s.state)),
    h("td", {}, new Date(s.startedAt).toLocaleString()),
    h("td", {}, `${s.cpuCount} vCPU / ${s.memoryMB} MiB`),
    h("td", {}, Object.entries(s.metadata || {}).map(([k, v]) => h("span", { class: "tag" }, `${k}=${v}`))),
    h("td", { class: "actions" }, h("a", { href: `#/tree/${s.sandboxID}` }, "Fork tree"), " ", actions(s)))));
  if (!list.length) say("No sandboxes match.");
}

// ---- The fork tree ----------------------------------------------------------

async function treePage(id) {
  view().replaceChildren(h("h1", {}, "Fork tree"), h("p", { id: "status" }), h("p", { class: "muted" }, "Loading…"));
  const lineage = await api(`/v1/sandboxes/${encodeURIComponent(id)}/lineage`);
  const kids = new Map();
  for (const n of lineage.nodes) {
    if (n.parentID) kids.set(n.parentID, [...(kids.get(n.parentID) || []), n]);
  }
  const draw = (n) => {
    const children = (kids.get(n.sandboxID) || []).sort((a, b) => a.branch - b.branch);
    const live = n.state === "running" || n.state === "paused";
    return h("li", { "data-sandbox-id": n.sandboxID, "data-state": n.state },
      h("span", { class: `node ${n.state}${n.sandboxID === id ? " current" : ""}` },
        n.branch === null ? h("span", { class: "branch" }, "root") : h("span", { class: "branch" }, `branch ${n.branch}`),
        live ? h("a", { class: "id", href: `#/sandbox/${n.sandboxID}` }, n.sandboxID) : h("span", { class: "id" }, n.sandboxID),
        stateTag(n.state),
        live ? actions(n) : null),
      children.length ? h("ul", {}, children.map(draw)) : null);
  };
  const root = lineage.nodes.find((n) => n.sandboxID === lineage.rootID);
  const counts = lineage.nodes.reduce((c, n) => ({ ...c, [n.state]: (c[n.state] || 0) + 1 }), {});
  view().replaceChildren(
    h("h1", {}, "Fork tree of ", h("span", { class: "id" }, id)),
    h("p", { id: "status" }),
    h("p", { class: "muted" }, `${lineage.nodes.length} sandboxes: `,
      Object.entries(counts).map(([s, c]) => `${c} ${s}`).join(", "),
      ". From the node's recent lifecycle events."),
    h("ul", { class: "tree", id: "tree" }, root ? draw(root) : null));
}

// ---- One sandbox ------------------------------------------------------------

// A line chart of `values` (numbers) as an inline SVG.
function chart(title, values, max, unit) {
  const w = 320, ht = 110, pad = 22;
  const NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  };
  svg.setAttribute("width", w);
  svg.setAttribute("height", ht);
  svg.setAttribute("viewBox", `0 0 ${w} ${ht}`);
  svg.append(el("line", { class: "axis", x1: pad, y1: ht - pad, x2: w, y2: ht - pad }));
  svg.append(el("text", { x: 0, y: 12 }, `${Math.round(max)}${unit}`));
  svg.append(el("text", { x: 0, y: ht - pad }, `0${unit}`));
  const top = max > 0 ? max : 1;
  const step = values.length > 1 ? (w - pad) / (values.length - 1) : 0;
  const points = values.map((v, i) => `${(pad + i * step).toFixed(1)},${(ht - pad - (v / top) * (ht - pad - 10)).toFixed(1)}`);
  if (points.length) svg.append(el("polyline", { points: points.join(" ") }));
  const last = values.length ? `${values[values.length - 1].toFixed(1)}${unit}` : "no samples yet";
  svg.append(el("text", { x: pad, y: ht - 4 }, `${values.length} samples, last ${last}`));
  return h("figure", { class: "chart" }, h("figcaption", {}, title), svg);
}

async function sandboxPage(id) {
  const s = await api(`/sandboxes/${encodeURIComponent(id)}`);
  const [metrics, logs] = await Promise.all([
    api(`/sandboxes/${encodeURIComponent(id)}/metrics`).catch(() => []),
    api(`/v2/sandboxes/${encodeURIComponent(id)}/logs?limit=200&direction=backward`).catch(() => ({ logs: [] })),
  ]);
  const mib = 1024 * 1024;
  const details = [["Sandbox", s.sandboxID], ["Template", s.alias || s.templateID], ["State", stateTag(s.state)],
    ["Started", new Date(s.startedAt).toLocaleString()], ["Ends", new Date(s.endAt).toLocaleString()],
    ["CPU / memory / disk", `${s.cpuCount} vCPU / ${s.memoryMB} MiB / ${s.diskSizeMB} MiB`],
    ["envd", s.envdVersion], ["Metadata", Object.entries(s.metadata || {}).map(([k, v]) => h("span", { class: "tag" }, `${k}=${v}`))]];
  const lines = (logs.logs || []).slice().sort((a, b) => (a.timestamp < b.timestamp ? -1 : 1));
  const memTotal = metrics.length ? metrics[metrics.length - 1].memTotal / mib : s.memoryMB;
  view().replaceChildren(
    h("h1", {}, "Sandbox ", h("span", { class: "id" }, s.sandboxID)),
    h("p", { id: "status" }),
    h("p", {}, h("a", { href: `#/tree/${s.sandboxID}` }, "Fork tree"), " ", actions(s)),
    h("dl", { class: "details card" }, details.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    h("h2", {}, "Metrics"),
    h("div", { class: "charts", id: "metrics" },
      chart("CPU", metrics.map((m) => m.cpuUsedPct), 100, "%"),
      chart("Memory", metrics.map((m) => m.memUsed / mib), memTotal, " MiB")),
    h("h2", {}, "Log tail"),
    h("pre", { class: "logs", id: "logs" }, lines.length
      ? lines.map((l) => `${l.timestamp} ${l.level} ${l.message}\n`).join("")
      : "no log lines"));
  refresh = setTimeout(() => route(), 5000);
}

// ---- Templates --------------------------------------------------------------

async function templatesPage() {
  const list = await api("/templates");
  view().replaceChildren(
    h("h1", {}, "Templates"),
    h("p", { id: "status" }),
    h("table", { id: "templates" },
      h("thead", {}, h("tr", {}, ["Template", "Names", "Build", "Status", "CPU / memory", "Spawned", "Updated"].map((c) => h("th", {}, c)))),
      h("tbody", {}, list.map((t) => h("tr", {},
        h("td", { class: "id" }, t.templateID),
        h("td", {}, [...new Set([...(t.names || []), ...(t.aliases || [])])].join(", ")),
        h("td", { class: "id" }, t.buildID),
        h("td", {}, t.buildStatus),
        h("td", {}, `${t.cpuCount} vCPU / ${t.memoryMB} MiB`),
        h("td", {}, t.spawnCount),
        h("td", {}, new Date(t.updatedAt).toLocaleString()))))));
}

// ---- Log in and routing -----------------------------------------------------

function logout(message) {
  sessionStorage.removeItem(KEY);
  showLogin(message);
}

function showLogin(message) {
  clearTimeout(refresh);
  $("#nav").hidden = true;
  view().replaceChildren();
  $("#login").hidden = false;
  const err = $("#login-error");
  err.hidden = !message;
  err.textContent = message || "";
}

async function login(event) {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  sessionStorage.setItem(KEY, key);
  try {
    // Any keyed route tells a known key from an unknown one.
    await api("/v2/sandboxes?limit=1");
  } catch (e) {
    if (e.status !== 401) showLogin(`Could not log in: ${e.message}`);
    return;
  }
  $("#api-key").value = "";
  if (!location.hash || location.hash === "#/") location.hash = "#/sandboxes";
  else route();
}

async function route() {
  clearTimeout(refresh);
  if (!sessionStorage.getItem(KEY)) return showLogin();
  $("#login").hidden = true;
  $("#login-error").hidden = true;
  $("#nav").hidden = false;
  const [, page, id] = location.hash.split("/");
  try {
    if (page === "sandbox" && id) await sandboxPage(decodeURIComponent(id));
    else if (page === "tree" && id) await treePage(decodeURIComponent(id));
    else if (page === "templates") await templatesPage();
    else await sandboxesPage();
  } catch (e) {
    if (e.status === 401) return;
    view().replaceChildren(h("p", { class: "error", role: "alert" }, `Error: ${e.message}`));
  }
}

$("#login").addEventListener("submit", login);
$("#logout").addEventListener("click", () => logout());
window.addEventListener("hashchange", route);
route();
