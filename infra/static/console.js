// clora console: a client of the control-plane API (/api). No framework, no CDN.
// Every piece of data reaches the page through textContent, attributes or uPlot (which writes
// labels as textContent and values on a canvas), never innerHTML, so tenant names, comments and
// feedback text cannot inject markup. Charts are uPlot's, vendored under /static/vendor/uplot.
"use strict";

const TOKEN_KEY = "clora-admin-token";
const REFRESH_MS = 2000;
let timer = null;

// --- tiny DOM helpers ------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick" || k === "onsubmit") node[k] = v;
    else if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

function fmtTime(t) { return t ? new Date(t * 1000).toLocaleString() : "—"; }
function fmtNum(x, d = 3) { return (x === null || x === undefined) ? "—" : Number(x).toFixed(d); }

// --- API -----------------------------------------------------------------------------

async function api(path, opts = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const resp = await fetch("/api" + path, {
    ...opts,
    headers: { "Authorization": "Bearer " + token, "Content-Type": "application/json" },
  });
  const body = await resp.json().catch(() => ({}));
  if (resp.status === 401) { signOut(); throw new Error("admin token rejected"); }
  if (!resp.ok) throw new Error(body.error ? body.error.message : resp.statusText);
  return body;
}

// --- charts (uPlot, vendored under /static/vendor/uplot: no CDN) -----------------------
// One uPlot per chart slot, kept across refreshes (new data goes in with setData, so a hover
// survives the 2 s refresh); a chart whose series change, or a page change, builds new ones.

const charts = new Map();   // chart key -> { u, key, notes }
const INK = "#8b98a5", GRID = "#263140";
const fmtSec = uPlot.fmtDate("{HH}:{mm}:{ss}"), fmtMin = uPlot.fmtDate("{HH}:{mm}");
const fmtDay = uPlot.fmtDate("{MMM} {D} {HH}:{mm}"), fmtFull = uPlot.fmtDate("{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}");

function dropChart(c) {
  if (c.resized) c.resized.disconnect();
  c.u.destroy();
}

function dropCharts() {
  for (const c of charts.values()) dropChart(c);
  charts.clear();
}

// x-axis tick labels, as precise as the visible span needs; written on the chart as
// data-x-labels too, since the canvas itself carries no text
function timeLabels(u, splits) {
  const span = u.scales.x.max - u.scales.x.min;
  const fmt = span > 2 * 86400 ? fmtDay : span > 600 ? fmtMin : fmtSec;
  const labels = splits.map(t => fmt(new Date(t * 1000)));
  u.root.parentNode && (u.root.parentNode.dataset.xLabels = labels.join(" "));
  return labels;
}

// at least a minute of time on the x-axis, and a margin so end points are not cut in half
function timeRange(u, min, max) {
  if (min === null || max === null) { const now = Date.now() / 1000; return [now - 3600, now]; }
  const pad = Math.max(30 - (max - min) / 2, (max - min) * 0.03);
  return [min - pad, max + pad];
}

// series: [{label, color, values}] sharing `xs` (unix seconds); `notes[i]` (e.g. "step 20",
// "v3") is shown with the time of point i in the hover legend. Counts start the y-axis at 0.
function timeChart(slotId, title, xs, series, { notes = [], dots = false, counts = false, digits = 3 } = {}) {
  const slot = document.getElementById(slotId);
  let head = slot.querySelector(":scope > .chart-title"), box = slot.querySelector(":scope > .chart");
  if (!head || !box) {
    head = el("h3", { class: "chart-title" });
    box = el("div", { class: "chart" });
    slot.replaceChildren(head, box);
  }
  head.textContent = title;
  const order = xs.map((_, i) => i).sort((a, b) => xs[a] - xs[b]);   // uPlot wants x ascending
  const data = [order.map(i => xs[i]), ...series.map(s => order.map(i => s.values[i] ?? null))];
  const sortedNotes = order.map(i => notes[i]);
  box.dataset.points = String(data.slice(1).reduce((n, ys) => n + ys.filter(y => y !== null).length, 0));
  box.dataset.empty = xs.length ? "false" : "true";
  const key = slotId + "|" + series.map(s => s.label).join(",") + "|" + dots + "|" + counts;
  const have = charts.get(slotId);
  if (have && have.key === key && box.contains(have.u.root)) {
    have.notes = sortedNotes;
    have.u.setData(data);
    return;
  }
  if (have) dropChart(have);
  const entry = { key, notes: sortedNotes, u: null, resized: null };
  const yRange = counts ? (u, min, max) => [0, max > 0 ? max * 1.1 : 1]
    : (u, min, max) => min === null ? [0, 1] : uPlot.rangeNum(min, max, 0.1, true);
  entry.u = new uPlot({
    width: Math.max(240, box.clientWidth || 400), height: 170,
    cursor: { drag: { x: false, y: false, setScale: false } },
    legend: { live: true },
    scales: { x: { time: true, range: timeRange }, y: { range: yRange } },
    axes: [
      { stroke: INK, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID, width: 1 }, values: timeLabels, space: 70 },
      { stroke: INK, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID, width: 1 }, size: 56 },
    ],
    series: [
      { label: "time", value: (u, t, si, idx) => t === null || idx === null ? "—"
        : fmtFull(new Date(t * 1000)) + (entry.notes[idx] ? ` (${entry.notes[idx]})` : "") },
      ...series.map(s => ({ label: s.label, stroke: s.color, width: 2, spanGaps: true,
        points: { show: dots, size: 7, fill: s.color, stroke: s.color },
        value: (u, v) => v === null || v === undefined ? "—" : fmtNum(v, digits) })),
    ],
  }, data, box);
  charts.set(slotId, entry);
  entry.resized = new ResizeObserver(() => {
    if (box.clientWidth && Math.abs(box.clientWidth - entry.u.width) > 1) entry.u.setSize({ width: box.clientWidth, height: 170 });
  });
  entry.resized.observe(box);
}

// a tenant's reward trend in its overview row: a line, no axes (kept per tenant across refreshes)
function sparkline(tenantId, values) {
  const data = [values.map((_, i) => i), values.map(v => v ?? null)];
  const key = "spark:" + tenantId;
  const have = charts.get(key);
  const cell = el("div", { class: "spark", "data-points": String(data[1].filter(v => v !== null).length) });
  if (have) { have.u.setData(data); cell.append(have.u.root); return cell; }
  const u = new uPlot({
    width: 140, height: 40, legend: { show: false }, cursor: { show: false },
    scales: { x: { time: false }, y: { range: (u, min, max) => min === null ? [0, 1] : uPlot.rangeNum(min, max, 0.1, true) } },
    axes: [{ show: false }, { show: false }],
    series: [{}, { stroke: "#3fb950", width: 2, spanGaps: true, points: { show: values.length === 1 } }],
  }, data, cell);
  charts.set(key, { key, u, notes: [] });
  return cell;
}

// --- views ---------------------------------------------------------------------------

function view() { return document.getElementById("view"); }

async function renderOverview(first) {
  const data = await api("/tenants");
  const dlq = await api("/dlq?n=20");
  const platform = await api("/platform/events?n=20");
  const engine = await api("/engine");
  const rows = data.tenants.map(t => el("tr", { "data-tenant": t.id },
    el("td", {}, el("a", { href: "#/tenant/" + encodeURIComponent(t.id) }, t.id), el("div", { class: "muted" }, t.name)),
    el("td", {}, el("span", { class: "pill " + (t.paused ? "paused" : "learning") }, t.paused ? "paused" : "learning"),
      t.training_error ? el("div", { class: "pill failing", title: t.training_error.error }, "training fails") : "",
      t.paused_reason ? el("div", { class: "pill failing", title: t.paused_reason }, "reward hacking") : "",
      t.drift_refusal ? el("div", { class: "pill failing", title: t.drift_refusal.reason }, "drift refused") : ""),
    el("td", { class: "live" }, t.live_version === null ? "base" : "v" + t.live_version,
      t.rollbacks ? el("div", { class: "rolled-back", title: "versions the reward guard rolled back" }, `${t.rollbacks} rolled back`) : ""),
    el("td", { class: "depth" }, `${t.buffer_depth.sft} / ${t.buffer_depth.preference} / ${t.buffer_depth.rl}`),
    el("td", { class: "traffic", title: "requests the gateway answered in the last hour" }, String(t.last_hour.requests ?? 0),
      t.last_hour.errors ? el("div", { class: "rolled-back" }, `${t.last_hour.errors} errors`) : ""),
    el("td", {}, String(data.consumer_lag ?? "—")),
    el("td", {}, fmtTime(t.last_publish)),
    el("td", {}, sparkline(t.id, t.reward_trend)),
  ));
  const table = el("table", { id: "tenants" },
    el("thead", {}, el("tr", {}, ["tenant", "state", "live", "buffer sft / pref / rl", "requests (1 h)", "consumer lag", "last publish", "reward trend"].map(h => el("th", {}, h)))),
    el("tbody", {}, rows));
  const dlqTable = el("table", { id: "dlq" },
    el("thead", {}, el("tr", {}, ["time", "topic", "reason", ""].map(h => el("th", {}, h)))),
    el("tbody", {}, dlq.dead_letters.map(d => el("tr", {},
      el("td", {}, fmtTime(d.time)), el("td", {}, d.source_topic), el("td", { class: "mono" }, d.reason),
      el("td", {}, el("button", { onclick: () => act(() => api(`/dlq/${encodeURIComponent(d.event_id)}/replay`, { method: "POST" })) }, "replay"))))));
  const eventsTable = el("table", { id: "platform-events" },
    el("thead", {}, el("tr", {}, ["time", "service", "what happened", ""].map(h => el("th", {}, h)))),
    el("tbody", {}, platform.events.map(e => el("tr", { class: e.kind === "data_lost" || e.kind === "restart_failed" ? "alert" : "" },
      el("td", {}, fmtTime(e.time)), el("td", {}, e.service),
      el("td", {}, el("span", { class: "pill " + (e.kind === "restarted" ? "learning" : "failing") }, e.kind)),
      el("td", { class: "mono" }, e.detail)))));
  // every gateway's replicas; a replica out of rotation for an adapter (load or canary failed) says why
  const replicaRows = engine.gateways.flatMap(g => g.replicas.map(r => el("tr", { class: r.healthy ? "" : "alert", "data-replica": r.url },
    el("td", {}, g.gateway), el("td", { class: "mono" }, `${r.index} ${r.url}`), el("td", {}, r.kind),
    el("td", {}, el("span", { class: "pill " + (r.healthy ? "learning" : "failing") }, r.healthy ? "in rotation" : "out")),
    el("td", {}, String(r.resident.length)), el("td", {}, String(r.in_flight)),
    el("td", { class: "refused" }, r.refused.map(x => el("div", { class: "pill failing", title: x.detail },
      `${x.adapter}: ${x.reason} ×${x.failures}` + (x.retry_in_s > 0 ? `, retry in ${Math.round(x.retry_in_s)} s` : "")))))));
  const engineTable = el("table", { id: "engine" },
    el("thead", {}, el("tr", {}, ["gateway", "replica", "kind", "state", "resident", "in flight", "out of rotation for"].map(h => el("th", {}, h)))),
    el("tbody", {}, replicaRows));
  if (first) {
    dropCharts();
    const form = el("form", { id: "create-tenant", class: "inline", onsubmit: createTenant },
      el("label", {}, "tenant id", el("input", { name: "id", required: true, pattern: "[a-z0-9][a-z0-9_-]*" })),
      el("label", {}, "display name", el("input", { name: "name" })),
      el("button", { type: "submit" }, "Create tenant"));
    view().replaceChildren(
      el("div", { id: "alerts-slot" }),
      el("section", { class: "card" }, el("h2", {}, "Tenants"), el("div", { id: "tenants-slot" })),
      el("section", { class: "card" }, el("h2", {}, "New tenant"), form, el("div", { id: "new-key" })),
      el("section", { class: "card" }, el("h2", {}, "Engine replicas"), el("div", { id: "engine-slot" })),
      el("section", { class: "card" }, el("h2", {}, "Dead letters"), el("div", { id: "dlq-slot" })),
      el("section", { class: "card" }, el("h2", {}, "Platform events"), el("div", { id: "events-slot" })));
  }
  document.getElementById("tenants-slot").replaceChildren(table);
  const shown = new Set(data.tenants.map(t => "spark:" + t.id));
  for (const [key, c] of charts) if (key.startsWith("spark:") && !shown.has(key)) { dropChart(c); charts.delete(key); }
  // a guard paused these tenants: an operator must look before resuming them
  const alerted = data.tenants.filter(t => t.paused_reason);
  document.getElementById("alerts-slot").replaceChildren(...(alerted.length ? [el("section", { class: "card alert", id: "alerts" },
    el("h2", {}, "Alerts"), ...alerted.map(t => el("p", { class: "error" },
      el("a", { href: "#/tenant/" + encodeURIComponent(t.id) }, t.id), ": paused, " + t.paused_reason)))] : []));
  document.getElementById("engine-slot").replaceChildren(engineTable);
  document.getElementById("dlq-slot").replaceChildren(dlqTable);
  document.getElementById("events-slot").replaceChildren(eventsTable);
}

async function createTenant(ev) {
  ev.preventDefault();
  const f = ev.target;
  try {
    const res = await api("/tenants", { method: "POST", body: JSON.stringify({ id: f.id.value, name: f.name.value }) });
    showKey(res.api_key, "API key for " + res.tenant.id);
    f.reset();
    refresh();
  } catch (e) { showError(e); }
}

function showKey(key, label, slot = "new-key", id = "shown-key") {
  document.getElementById(slot).replaceChildren(
    el("p", {}, label + " — shown once, copy it now:"), el("code", { class: "key", id }, key));
}

async function renderTenant(id, first) {
  const enc = encodeURIComponent(id);
  const [t, versions, metrics, feedback, buffers, traffic, freshness, tinkerKeys] = await Promise.all([
    api(`/tenants/${enc}`), api(`/tenants/${enc}/versions`), api(`/tenants/${enc}/metrics`),
    api(`/tenants/${enc}/feedback?n=30`), api(`/tenants/${enc}/buffers?n=5`), api(`/tenants/${enc}/traffic?minutes=60`),
    api(`/tenants/${enc}/freshness`), api(`/tenants/${enc}/tinker-keys`)]);
  if (first) {
    dropCharts();
    view().replaceChildren(
      el("p", {}, el("a", { href: "#/" }, "← all tenants")),
      el("section", { class: "card" }, el("h2", { id: "tenant-title" }), el("div", { id: "tenant-head" })),
      el("section", { class: "grid" },
        el("div", { class: "card", id: "chart-reward" }), el("div", { class: "card", id: "chart-loss" }),
        el("div", { class: "card", id: "chart-eval" }), el("div", { class: "card", id: "chart-served" }),
        el("div", { class: "card", id: "chart-requests" }), el("div", { class: "card", id: "chart-latency" }),
        el("div", { class: "card", id: "freshness" })),
      el("section", { class: "card" }, el("h2", {}, "Adapter versions"), el("div", { id: "versions-slot" })),
      el("section", { class: "card" }, el("h2", {}, "Learning policy"), policyForm(id, t.policy)),
      el("section", { class: "card" }, el("h2", {}, "API keys"), el("div", { id: "keys-slot" }), el("div", { id: "new-key" })),
      el("section", { class: "card" }, el("h2", {}, "Tinker keys"),
        el("p", { class: "muted" }, "For the Tinker-compatible training API: the official tinker SDK trains LoRA runs as this tenant with one (TINKER_API_KEY)."),
        el("div", { id: "tinker-keys-slot" }), el("div", { id: "new-tinker-key" })),
      el("section", { class: "card" }, el("h2", {}, "Recent feedback"), el("div", { id: "feedback-slot" })),
      el("section", { class: "card" }, el("h2", {}, "Replay buffers"), el("div", { id: "buffers-slot" })),
      el("section", { class: "card danger" }, el("h2", {}, "Delete tenant"), deleteForm(id)));
  }
  document.getElementById("tenant-title").textContent = `${t.id} ${t.name ? "— " + t.name : ""}`;
  document.getElementById("tenant-head").replaceChildren(
    el("span", { class: "pill " + (t.paused ? "paused" : "learning"), id: "state" }, t.paused ? "paused" : "learning"), " ",
    el("span", {}, "live: "), el("span", { class: "live", id: "live-version" }, versions.live === null ? "base" : "v" + versions.live), " ",
    el("button", { id: "pause-toggle", onclick: () => act(() => api(`/tenants/${enc}/${t.paused ? "resume" : "pause"}`, { method: "POST" })) },
      t.paused ? "resume learning" : "pause learning"), " ",
    el("button", { id: "rollback", onclick: () => act(() => api(`/tenants/${enc}/rollback`, { method: "POST", body: "{}" })) }, "roll back"),
    t.training_error ? el("p", { class: "error", id: "training-error" },
      `training fails (${t.training_error.failures} time(s) in a row, next try in ${Math.round(t.training_error.retry_in_s)} s): ${t.training_error.error}`) : "",
    t.paused_reason ? el("p", { class: "error alert", id: "guard-alert" }, `Paused by a guard — ${t.paused_reason}`) : "",
    t.drift_refusal ? el("p", { class: "error", id: "drift-refusal" },
      `step ${t.drift_refusal.step}'s candidate was not published (forgetting guard): ${t.drift_refusal.reason}`) : "",
    t.alerts.length ? el("div", { id: "alert-history" }, t.alerts.slice(0, 5).map(a =>
      el("div", { class: "rolled-back" }, `${fmtTime(a.time)} ${a.kind.replace("_", " ")}: ${a.detail}`))) : "");
  // the learner's history: one point per step that reported the value, at the time it did
  const pts = metrics.points.filter(p => typeof p.time === "number");
  const learnerChart = (slotId, title, key, color) => {
    const has = pts.filter(p => p[key] !== null && p[key] !== undefined);
    timeChart(slotId, title, has.map(p => p.time), [{ label: key, color, values: has.map(p => p[key]) }],
      { notes: has.map(p => p.step === undefined ? "" : "step " + p.step) });
  };
  learnerChart("chart-reward", "reward", "reward", "#3fb950");
  learnerChart("chart-loss", "training loss", "loss", "#f85149");
  learnerChart("chart-eval", "held-out loss (lower is better)", "eval", "#4fb0ff");
  // what each version earned while it served (the reward guard compares these), at its publish time
  const served = versions.versions.filter(v => v.served_reward);
  timeChart("chart-served", "mean reward each version served", served.map(v => v.created_at),
    [{ label: "served reward", color: "#d29922", values: served.map(v => v.served_reward.mean) }],
    { notes: served.map(v => "v" + v.version), dots: true });
  // what the gateway served it, minute by minute
  const minutes = traffic.minutes.map(m => m.minute);
  const lastHour = traffic.minutes.reduce((n, m) => n + (m.requests ?? 0), 0);
  timeChart("chart-requests", `requests per minute (last hour: ${lastHour})`, minutes, [
    { label: "requests", color: "#4fb0ff", values: traffic.minutes.map(m => m.requests ?? 0) },
    { label: "refused", color: "#d29922", values: traffic.minutes.map(m => m.refused ?? 0) },
    { label: "errors", color: "#f85149", values: traffic.minutes.map(m => m.errors ?? 0) }], { counts: true, digits: 0 });
  timeChart("chart-latency", "mean latency of answered requests (s)", minutes,
    [{ label: "latency s", color: "#a371f7", values: traffic.minutes.map(m => m.ok ? m.latency_s / m.ok : null) }],
    { dots: true });
  // feedback -> served: from each feedback event's 202 to the first completion of the version first
  // trained on it, per version at the time it first served
  if (first || !document.getElementById("freshness-summary")) {
    document.getElementById("freshness").replaceChildren(el("p", { id: "freshness-summary", class: "muted" }),
      el("div", { id: "chart-freshness" }));
  }
  document.getElementById("freshness-summary").textContent = freshness.events
    ? `feedback → served: p50 ${fmtNum(freshness.p50_s, 1)} s, p99 ${fmtNum(freshness.p99_s, 1)} s over ${freshness.events} events`
    : "feedback → served: no version trained on feedback has served yet";
  const fv = freshness.versions;
  timeChart("chart-freshness", "feedback → served s per version (pub: publish → served)", fv.map(v => v.first_served_at), [
    { label: "p50", color: "#4fb0ff", values: fv.map(v => v.p50_s) },
    { label: "p99", color: "#f85149", values: fv.map(v => v.p99_s) },
    { label: "pub", color: "#8b98a5", values: fv.map(v => v.published_to_served_s) }],
    { notes: fv.map(v => "v" + v.version), dots: true, digits: 1 });
  const freshCell = (f) => !f ? "—" : f.events
    ? `${fmtNum(f.p50_s, 1)} / ${fmtNum(f.p99_s, 1)} s (${f.events})` : `no feedback (${fmtNum(f.published_to_served_s, 1)} s to serve)`;
  document.getElementById("versions-slot").replaceChildren(el("table", { id: "versions" },
    el("thead", {}, el("tr", {}, ["version", "parent", "step", "examples", "eval", "served reward", "feedback → served p50 / p99", "feedback window", "created", ""].map(h => el("th", {}, h)))),
    el("tbody", {}, versions.versions.slice().reverse().map(v => el("tr", { "data-version": v.version },
      el("td", { class: v.version === versions.live ? "live" : "" }, "v" + v.version + (v.version === versions.live ? " (live)" : ""),
        v.rolled_back ? el("div", { class: "rolled-back", title: v.rolled_back.reason }, `rolled back to v${v.rolled_back.to} by the ${v.rolled_back.guard === "reward_hacking" ? "reward-hacking" : "reward"} guard`) : "",
        // weights a Tinker training run saved for sampling (never made live by it)
        v.source === "tinker" ? el("div", { class: "tinker", title: "saved through the Tinker-compatible training API" },
          "from the Tinker API", el("div", { class: "mono" }, v.tinker_path || "unnamed sampler (save_weights_and_get_sampling_client)")) : ""),
      el("td", {}, v.parent_version === null ? "—" : "v" + v.parent_version),
      el("td", {}, String(v.step)), el("td", {}, String(v.examples_seen)),
      el("td", { class: "mono" }, Object.entries(v.eval_scores).map(([k, s]) => `${k}=${fmtNum(s)}`).join(" ")),
      el("td", { class: "served-reward" }, v.served_reward ? `${fmtNum(v.served_reward.mean, 2)} (${v.served_reward.samples})` : "—"),
      el("td", { class: "freshness" }, freshCell(v.freshness)),
      el("td", {}, v.feedback_window ? `${fmtTime(v.feedback_window[0])} → ${fmtTime(v.feedback_window[1])}` : "—"),
      el("td", {}, fmtTime(v.created_at)),
      el("td", {}, v.version === versions.live ? "" : el("button", { class: "promote", onclick: () => act(() => api(`/tenants/${enc}/versions/${v.version}/promote`, { method: "POST" })) }, "make live")))))));
  document.getElementById("keys-slot").replaceChildren(el("table", { id: "keys" },
    el("thead", {}, el("tr", {}, ["key id", "created", "state", ""].map(h => el("th", {}, h)))),
    el("tbody", {}, t.keys.map(k => el("tr", {},
      el("td", { class: "mono" }, k.key_id), el("td", {}, fmtTime(k.created_at)),
      el("td", {}, k.revoked_at ? "revoked " + fmtTime(k.revoked_at) : "active"),
      el("td", {}, k.revoked_at ? "" : el("button", { onclick: () => act(() => api(`/tenants/${enc}/keys/${k.key_id}`, { method: "DELETE" })) }, "revoke"))))),
    el("tfoot", {}, el("tr", {}, el("td", { colspan: 4 },
      el("button", { id: "new-key-btn", onclick: () => keyAction(api(`/tenants/${enc}/keys`, { method: "POST" })) }, "new key"), " ",
      el("button", { onclick: () => keyAction(api(`/tenants/${enc}/keys/rotate`, { method: "POST" })) }, "rotate (revoke all others)"))))));
  renderTinkerKeys(enc, tinkerKeys.tinker_keys);
  document.getElementById("feedback-slot").replaceChildren(el("table", { id: "feedback" },
    el("thead", {}, el("tr", {}, ["time", "interaction", "prompt → answer (version)", "source", "key", "score", "comment", "correction"].map(h => el("th", {}, h)))),
    el("tbody", {}, feedback.feedback.map(f => el("tr", {},
      el("td", {}, fmtTime(f.time)), el("td", { class: "mono" }, f.interaction_id),
      el("td", { class: "interaction" }, f.interaction
        ? `${f.interaction.prompt ?? ""} → ${f.interaction.response ?? f.interaction.tool_calls.map(c => c.name + "(" + c.arguments + ")").join(" ")}` +
          (f.interaction.adapter_version === null ? " (base)" : ` (v${f.interaction.adapter_version})`)
        : "(interaction not seen yet)"),
      el("td", {}, f.source),
      el("td", {}, f.key ?? ""), el("td", {}, fmtNum(f.score, 2)), el("td", { class: "comment" }, f.comment ?? ""),
      el("td", {}, f.correction ?? ""))))));
  document.getElementById("buffers-slot").replaceChildren(
    el("p", { id: "buffer-depth" }, `sft ${buffers.depth.sft} · preference ${buffers.depth.preference} · rl ${buffers.depth.rl}`),
    el("p", { class: "muted" }, `added ${buffers.stats.added ?? 0} · duplicates ${buffers.stats.duplicates ?? 0} · evicted ${buffers.stats.evicted ?? 0}`),
    // scores the reward spec refused: stored and listed above, not trained on
    el("p", { class: "muted", id: "untrained-feedback" }, "not trained (reward spec): " +
      (Object.entries(t.untrained_feedback).map(([why, n]) => `${why.replaceAll("_", " ")} ${n}`).join(" · ") || "none")));
}

// the tenant's keys for the training API: issue one (shown once), revoke one
function renderTinkerKeys(enc, keys) {
  const issue = async () => {
    try {
      const res = await api(`/tenants/${enc}/tinker-keys`, { method: "POST" });
      showKey(res.tinker_key, "new Tinker key", "new-tinker-key", "shown-tinker-key");
      refresh();
    } catch (e) { showError(e); }
  };
  document.getElementById("tinker-keys-slot").replaceChildren(el("table", { id: "tinker-keys" },
    el("thead", {}, el("tr", {}, ["key id", "created", "state", ""].map(h => el("th", {}, h)))),
    el("tbody", {}, keys.map(k => el("tr", { "data-key": k.key_id },
      el("td", { class: "mono" }, k.key_id), el("td", {}, fmtTime(k.created_at)),
      el("td", {}, k.revoked_at ? "revoked " + fmtTime(k.revoked_at) : "active"),
      el("td", {}, k.revoked_at ? "" : el("button", { class: "revoke-tinker-key", onclick: () => act(() => api(`/tenants/${enc}/tinker-keys/${encodeURIComponent(k.key_id)}`, { method: "DELETE" })) }, "revoke"))))),
    el("tfoot", {}, el("tr", {}, el("td", { colspan: 4 },
      el("button", { id: "new-tinker-key-btn", onclick: issue }, "new Tinker key"))))));
}

function policyForm(id, p) {
  const field = (name, value, attrs = {}) => el("label", {}, name, el("input", { name, value, ...attrs }));
  const algo = el("select", { name: "algorithm" }, ["sft", "dpo", "rl", "kto", "auto"].map(a => el("option", { value: a, selected: a === p.algorithm }, a)));
  const msg = el("span", { id: "policy-msg" });
  const form = el("form", { class: "inline", id: "policy-form", onsubmit: async ev => {
    ev.preventDefault();
    const f = ev.target;
    const changes = { algorithm: f.algorithm.value };
    for (const k of ["learning_rate", "batch_size", "weight", "priority", "min_new_examples"]) changes[k] = Number(f[k].value);
    changes.reward_guard = f.reward_guard.checked;
    const spec = f.reward_spec.value.trim();   // empty: no spec, every score trains as is
    try { changes.reward_spec = spec ? JSON.parse(spec) : null; }
    catch (e) { msg.textContent = "reward spec is not JSON: " + e.message; msg.className = "error"; return; }
    try { await api(`/tenants/${encodeURIComponent(id)}/policy`, { method: "PATCH", body: JSON.stringify(changes) }); msg.textContent = "saved"; msg.className = ""; }
    catch (e) { msg.textContent = e.message; msg.className = "error"; }
  } },
    el("label", {}, "algorithm", algo),
    field("learning_rate", p.learning_rate, { type: "number", step: "any" }), field("batch_size", p.batch_size, { type: "number" }),
    field("weight", p.weight, { type: "number", step: "any" }), field("priority", p.priority, { type: "number" }),
    field("min_new_examples", p.min_new_examples, { type: "number" }),
    el("label", { title: "roll the live version back when its served reward drops measurably below the version it replaced" },
      "reward guard", el("input", { name: "reward_guard", type: "checkbox", checked: p.reward_guard })),
    el("label", { title: 'which feedback keys train, e.g. {"keys": {"thumbs": {"type": "bool", "sources": ["user"]}}} (docs/events.md); empty: every score trains as its own reward' },
      "reward spec (JSON)", el("textarea", { name: "reward_spec", rows: 4, cols: 48, spellcheck: "false" },
        p.reward_spec ? JSON.stringify(p.reward_spec) : "")),
    el("button", { type: "submit" }, "Save"), msg);
  return form;
}

// deleting is for good (adapters, buffers, keys, checkpoints): the operator types the id to confirm
function deleteForm(id) {
  const input = el("input", { name: "confirm", placeholder: id, autocomplete: "off", "aria-label": "tenant id to confirm" });
  const button = el("button", { type: "submit", id: "delete-tenant-btn", disabled: "" }, "Delete");
  input.addEventListener("input", () => { button.disabled = input.value !== id; });
  const form = el("form", { id: "delete-tenant" },
    el("p", { class: "muted" }, "Deletes the tenant for good: its adapter versions, replay buffers, API and Tinker keys and training checkpoints. Type its id to confirm."),
    input, " ", button);
  form.addEventListener("submit", async ev => {
    ev.preventDefault();
    if (input.value !== id) return;
    try {
      await api(`/tenants/${encodeURIComponent(id)}`, { method: "DELETE" });
      location.hash = "#/";
    } catch (e) { showError(e); }
  });
  return form;
}

async function keyAction(promise) {
  try { const res = await promise; showKey(res.api_key, "new API key"); refresh(); } catch (e) { showError(e); }
}

async function act(fn) {
  try { await fn(); await refresh(); } catch (e) { showError(e); }
}

function showError(e) {
  const s = document.getElementById("status");
  s.textContent = "error: " + e.message;
  s.className = "status error";
}

// --- routing and refresh ---------------------------------------------------------------

async function refresh(first = false) {
  if (!sessionStorage.getItem(TOKEN_KEY)) return;
  const hash = location.hash || "#/";
  try {
    if (hash.startsWith("#/tenant/")) await renderTenant(decodeURIComponent(hash.slice(9)), first);
    else await renderOverview(first);
    const s = document.getElementById("status");
    s.textContent = "updated " + new Date().toLocaleTimeString();
    s.className = "status";
  } catch (e) { showError(e); }
}

function start() {
  const signedIn = !!sessionStorage.getItem(TOKEN_KEY);
  document.getElementById("login").hidden = signedIn;
  document.getElementById("logout").hidden = !signedIn;
  if (timer) clearInterval(timer);
  if (!signedIn) { view().replaceChildren(); return; }
  refresh(true);
  timer = setInterval(() => refresh(false), REFRESH_MS);
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  start();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login-form").onsubmit = async ev => {
    ev.preventDefault();
    const token = document.getElementById("token").value.trim();
    const resp = await fetch("/api/tenants", { headers: { "Authorization": "Bearer " + token } });
    if (resp.status === 401) { document.getElementById("login-error").textContent = "that token was rejected"; return; }
    sessionStorage.setItem(TOKEN_KEY, token);
    start();
  };
  document.getElementById("logout").onclick = signOut;
  window.addEventListener("hashchange", () => refresh(true));
  start();
});
