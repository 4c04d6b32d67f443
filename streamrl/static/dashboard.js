// streamrl dashboard: polls /api/summary and /api/series, draws SVG charts. No dependencies, no network
// beyond this server. Every value shown comes from the API; a role that has written nothing shows "-".
"use strict";

const S = {
  refreshMs: 1500,
  historyPoints: 2000,
  summary: null,
  series: {},      // role -> {lastId, points: [{id, values}]}
  samples: null,   // the last /api/samples answer
  timer: null,
};

// Metric names the page reads; the first one present in a role's points wins. Unknown names still appear in
// the "latest values" table, so a metric renamed by a role is never lost from view.
const K = {
  generated: ["generated_tokens_per_s", "gen_tokens_per_s", "output_tokens_per_s", "tokens_per_s"],
  trained: ["trained_tokens_per_s"],
  groupsPerS: ["groups_per_s"],
  inFlight: ["groups_in_flight", "in_flight"],
  greedy: ["greedy_accuracy", "accuracy/greedy", "eval/greedy_accuracy"],
  sampled: ["sampled_accuracy", "accuracy/sampled", "eval/sampled_accuracy"],
  version: ["policy_version", "version"],
  idle: ["idle_ratio"],
  rolloutIdle: ["idle_ratio", "wait_capacity_ratio"],
};

const COLORS = ["#2f6fde", "#e0632a", "#1f9d55", "#9b4dca", "#c53030", "#0e9aa7", "#b8860b", "#6b7385"];

// ---- data -----------------------------------------------------------------------------------------------

async function getJSON(url) {
  const resp = await fetch(url, { cache: "no-store" });
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error(body.error || `${url}: HTTP ${resp.status}`);
  return body;
}

async function pollSeries(role) {
  const s = S.series[role] || (S.series[role] = { lastId: null, points: [] });
  for (let round = 0; round < 50; round++) {
    const q = new URLSearchParams({ role, limit: String(S.historyPoints) });
    if (s.lastId) q.set("since", s.lastId);
    const data = await getJSON(`/api/series?${q}`);
    for (const p of data.points) s.points.push(p);
    if (data.last_id) s.lastId = data.last_id;
    if (!data.more) break;
  }
  if (s.points.length > S.historyPoints) s.points.splice(0, s.points.length - S.historyPoints);
}

function points(role) {
  return (S.series[role] && S.series[role].points) || [];
}

function latest(role) {
  const r = S.summary && S.summary.roles[role];
  return r ? r.values : null;
}

function pickKey(role, candidates) {
  const last = latest(role);
  const pts = points(role);
  for (const k of candidates) {
    if (last && k in last) return k;
    if (pts.some((p) => k in p.values)) return k;
  }
  return null;
}

// Rollout workers write to "rollout" or to one role each ("rollout-0", "rollout-1", ...): tiles add them up.
function rolloutRoles() {
  return S.summary ? Object.keys(S.summary.roles).filter((r) => /^rollout([-_.].*)?$/.test(r)).sort() : [];
}

function rolloutTotal(candidates, mean = false) {
  const vals = rolloutRoles().map((r) => value(r, candidates)).filter((v) => typeof v === "number");
  if (!vals.length) return null;
  const sum = vals.reduce((a, b) => a + b, 0);
  return mean ? sum / vals.length : sum;
}

function rolloutSeries(name, candidates) {
  const roles = rolloutRoles();
  return roles.map((r) => ({ name: roles.length === 1 ? name : `${name} ${r}`, label: `${name} (${r})`, pts: column(r, pickKey(r, candidates), "ts") }));
}

function value(role, candidates) {
  const last = latest(role);
  if (!last) return null;
  for (const k of candidates) if (k in last) return last[k];
  return null;
}

// [x, y] pairs of `key` against `xKey` for one role (null y breaks the line).
function column(role, key, xKey) {
  if (!key) return [];
  const out = [];
  for (const p of points(role)) {
    const x = p.values[xKey];
    if (typeof x !== "number" || !(key in p.values)) continue;
    const y = p.values[key];
    out.push([x, typeof y === "number" ? y : null]);
  }
  return out;
}

// ---- formatting -----------------------------------------------------------------------------------------

function fmt(v) {
  if (v === null || v === undefined || (typeof v === "number" && !isFinite(v))) return "-";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  if (Math.abs(v) >= 100) return v.toFixed(1);
  return String(Number(v.toPrecision(4)));
}

function fmtAge(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 90) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(1)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

// hh:mm:ss, with as many decimals of a second as a tick step below one second needs.
function clock(ts, step = 1) {
  const hms = new Date(ts * 1000).toTimeString().slice(0, 8);
  const decimals = step < 1 ? Math.min(3, Math.ceil(-Math.log10(step) - 1e-9)) : 0;
  return decimals ? `${hms}${(ts % 1).toFixed(decimals).slice(1)}` : hms;
}

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// ---- charts ---------------------------------------------------------------------------------------------

function niceTicks(lo, hi, count) {
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

const W = 560, H = 220, M = { l: 50, r: 12, t: 8, b: 34 };

function frame(xs, ys, opts) {
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (opts.yZero) { y0 = Math.min(0, y0); y1 = Math.max(0, y1); }
  if (opts.yMax !== undefined) y1 = Math.max(y1, opts.yMax);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const sx = (x) => M.l + ((x - x0) / (x1 - x0)) * (W - M.l - M.r);
  const sy = (y) => H - M.b - ((y - y0) / (y1 - y0)) * (H - M.t - M.b);
  let grid = "";
  for (const t of niceTicks(y0, y1, 4)) {
    grid += `<line class="grid" x1="${M.l}" x2="${W - M.r}" y1="${sy(t)}" y2="${sy(t)}"/>`;
    grid += `<text class="axis" x="${M.l - 4}" y="${sy(t) + 3}" text-anchor="end">${esc(fmt(t))}</text>`;
  }
  const xt = opts.xTime ? niceTicks(x0, x1, 5) : niceTicks(x0, x1, 6).filter((t) => !opts.xInt || Number.isInteger(t));
  const step = xt.length > 1 ? xt[1] - xt[0] : 1;
  for (const t of xt) {
    const label = opts.xTime ? clock(t, step) : fmt(t);
    grid += `<text class="axis" x="${sx(t)}" y="${H - M.b + 13}" text-anchor="middle">${esc(label)}</text>`;
  }
  const xLabel = opts.xTime ? "time" : opts.xLabel;
  if (xLabel) grid += `<text class="axis" x="${(M.l + W - M.r) / 2}" y="${H - 4}" text-anchor="middle">${esc(xLabel)}</text>`;
  return { sx, sy, grid };
}

function setEmpty(fig, message) {
  fig.querySelector(".plot").innerHTML = `<div class="empty">${esc(message)}</div>`;
  fig.querySelector(".legend").innerHTML = "";
  fig.dataset.points = "0";
}

// series: [{name, label, pts: [[x, y|null]]}]; draws polylines broken at nulls.
function lineChart(id, series, opts = {}) {
  const fig = document.getElementById(id);
  const live = series.filter((s) => s.pts.some((p) => p[1] !== null));
  if (!live.length) return setEmpty(fig, opts.empty || "no data yet");
  const xs = [], ys = [];
  for (const s of live) for (const [x, y] of s.pts) if (y !== null) { xs.push(x); ys.push(y); }
  const { sx, sy, grid } = frame(xs, ys, opts);
  let body = "", legend = "", total = 0;
  live.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    let d = "", pen = false, last = null, n = 0;
    for (const [x, y] of s.pts) {
      if (y === null) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`;
      pen = true; last = [x, y]; n++;
    }
    total += n;
    body += `<path class="line" stroke="${color}" d="${d}" data-name="${esc(s.name)}" data-count="${n}" data-last="${last[1]}"/>`;
    body += `<circle cx="${sx(last[0])}" cy="${sy(last[1])}" r="2.5" fill="${color}"/>`;
    legend += `<span data-name="${esc(s.name)}" data-last="${last[1]}"><i style="background:${color}"></i>${esc(s.label || s.name)}<b>${esc(fmt(last[1]))}</b></span>`;
  });
  fig.querySelector(".plot").innerHTML = `<svg viewBox="0 0 ${W} ${H}" role="img">${grid}${body}</svg>`;
  fig.querySelector(".legend").innerHTML = legend;
  fig.dataset.points = String(total);
}

function barChart(id, bars, opts = {}) {
  const fig = document.getElementById(id);
  if (!bars.length) return setEmpty(fig, opts.empty || "no data yet");
  const xs = bars.map((b) => b.x), ys = bars.map((b) => b.y);
  const { sx, sy, grid } = frame([Math.min(...xs) - 0.5, Math.max(...xs) + 0.5], ys, { yZero: true, xInt: true, xLabel: opts.xLabel });
  const width = Math.max(2, Math.min(40, (sx(1) - sx(0)) * 0.8));
  let body = "";
  for (const b of bars) {
    body += `<rect class="bar" fill="${COLORS[0]}" x="${sx(b.x) - width / 2}" y="${sy(b.y)}" width="${width}" height="${Math.max(0, sy(0) - sy(b.y))}" data-bucket="${b.x}" data-count="${b.y}"><title>${esc(`${b.x}: ${b.y}`)}</title></rect>`;
  }
  fig.querySelector(".plot").innerHTML = `<svg viewBox="0 0 ${W} ${H}" role="img">${grid}${body}</svg>`;
  fig.querySelector(".legend").innerHTML = opts.legend || "";
  fig.dataset.points = String(bars.length);
}

// ---- page sections --------------------------------------------------------------------------------------

const TILES = [
  { id: "step", label: "learner step", get: () => value("learner", ["step"]) },
  { id: "version", label: "policy version", get: () => (S.summary.policy_version ?? value("learner", K.version)) },
  { id: "reward", label: "training reward", get: () => value("learner", ["reward_mean"]) },
  { id: "greedy", label: "held-out greedy acc.", get: () => value("eval", K.greedy), sub: () => evalSub() },
  { id: "sampled", label: "held-out sampled acc.", get: () => value("eval", K.sampled), sub: () => evalSub() },
  { id: "generated", label: "generated tok/s", get: () => rolloutTotal(K.generated), sub: () => inFlightSub() },
  { id: "trained", label: "trained tok/s", get: () => value("learner", K.trained) },
  { id: "staleness", label: "staleness mean", get: () => value("learner", ["staleness/mean"]),
    sub: () => { const l = latest("learner"); return l && "staleness/max" in l ? `max ${fmt(l["staleness/max"])} · eta ${S.summary.eta}` : ""; } },
  { id: "backlog", label: "stream backlog", get: () => brokerSample("backlog"), sub: () => `bound ${fmt(brokerSample("max_backlog"))}` },
  { id: "pending", label: "pending entries", get: () => brokerSample("pending") },
  { id: "lag", label: "undelivered (lag)", get: () => brokerSample("lag") },
  { id: "idle-learner", label: "learner idle ratio", get: () => value("learner", K.idle) },
  { id: "idle-rollout", label: "rollout idle ratio", get: () => rolloutTotal(K.rolloutIdle, true) },
  // multi-turn tasks only: the workers' episode counters (a single-turn run shows "-")
  { id: "turns", label: "turns / episode", get: () => perEpisode("turns"),
    sub: () => { const n = rolloutTotal(["episodes"]); return n ? `${fmt(n)} episodes` : ""; } },
  { id: "tool-calls", label: "tool calls / episode", get: () => perEpisode("tool_calls"),
    sub: () => { const c = rolloutTotal(["tool_calls"]); return c ? `${fmt(rolloutTotal(["tool_errors"]) || 0)} of ${fmt(c)} failed` : ""; } },
];

function perEpisode(key) {
  const episodes = rolloutTotal(["episodes"]);
  return episodes ? (rolloutTotal([key]) || 0) / episodes : null;
}

function inFlightSub() {
  const n = rolloutTotal(K.inFlight);
  return n === null ? "" : `${fmt(n)} groups in flight`;
}

function evalSub() {
  const v = value("eval", K.version);
  return v === null ? "" : `at version ${fmt(v)}`;
}

function brokerSample(key) {
  const s = S.summary && S.summary.broker && S.summary.broker.sample;
  return s && key in s ? s[key] : null;
}

function renderTiles() {
  const host = document.getElementById("tiles");
  if (!host.children.length) {
    host.innerHTML = TILES.map((t) => `<div class="tile" id="tile-${t.id}"><div class="label">${esc(t.label)}</div><div class="value" id="stat-${t.id}">-</div><div class="sub"></div></div>`).join("");
  }
  for (const t of TILES) {
    const v = t.get();
    const el = document.getElementById(`stat-${t.id}`);
    el.textContent = fmt(v);
    if (v === null || v === undefined) delete el.dataset.value; else el.dataset.value = String(v);
    el.parentElement.querySelector(".sub").textContent = t.sub ? t.sub() : "";
  }
}

// The run's device plan (RUN_DIR/devices.json, written by up): which GPUs the learner and each engine see.
function describeDevices(plan) {
  if (!plan) return "no plan recorded";
  if (plan.device !== "cuda") return `CPU (${plan.placement})`;
  const engines = plan.engines.map((g, i) => `engine-${i} GPU ${g.join(",")}`);
  return [`${plan.placement}: learner GPU ${plan.learner.join(",")}`, ...engines].join(" · ");
}

function renderHeader() {
  const sum = S.summary;
  document.getElementById("run-id").textContent = sum.run_id;
  document.getElementById("eta").textContent = String(sum.eta);
  document.getElementById("devices").textContent = describeDevices(sum.devices);
  const stale = Math.max(30, 5 * S.refreshMs / 1000);
  const pills = Object.entries(sum.roles).map(([role, r]) => {
    const live = r.age_s !== null && r.age_s < stale ? 1 : 0;
    return `<span class="pill" data-role="${esc(role)}" data-live="${live}" title="last point ${esc(fmtAge(r.age_s))}">${esc(role)} · ${esc(fmtAge(r.age_s))}</span>`;
  });
  document.getElementById("roles").innerHTML = pills.join("") || `<span class="pill">no role has written metrics yet</span>`;
}

function rewardSeries() {
  const out = [{ name: "reward_mean", label: "reward (mean)", pts: column("learner", "reward_mean", "step") }];
  const keys = new Set();
  for (const p of points("learner")) for (const k of Object.keys(p.values)) if (k.startsWith("reward/")) keys.add(k);
  for (const k of [...keys].sort()) out.push({ name: k, label: k.slice(7), pts: column("learner", k, "step") });
  return out;
}

function stalenessHistogram() {
  const pts = points("learner").slice(-50);
  const counts = new Map();
  for (const p of pts) {
    for (const [k, v] of Object.entries(p.values)) {
      if (!k.startsWith("staleness/hist/") || typeof v !== "number") continue;
      const s = Number(k.slice(15));
      counts.set(s, (counts.get(s) || 0) + v);
    }
  }
  document.querySelector("#chart-staleness-hist .window").textContent = `last ${pts.length} steps`;
  return [...counts.entries()].sort((a, b) => a[0] - b[0]).map(([x, y]) => ({ x, y }));
}

function renderCharts() {
  lineChart("chart-reward", rewardSeries(), { xLabel: "step", xInt: true, empty: "the learner has not written a step yet" });
  const vKey = pickKey("eval", K.version) || "policy_version";
  lineChart("chart-accuracy", [
    { name: "greedy", label: "greedy", pts: column("eval", pickKey("eval", K.greedy), vKey) },
    { name: "sampled", label: "sampled", pts: column("eval", pickKey("eval", K.sampled), vKey) },
  ], { xLabel: "policy version", yZero: true, yMax: 1, xInt: true, empty: "no held-out evaluation yet" });
  lineChart("chart-throughput", [
    ...rolloutSeries("generated", K.generated),
    { name: "trained", label: "trained (learner)", pts: column("learner", "trained_tokens_per_s", "ts") },
  ], { xTime: true, yZero: true });
  lineChart("chart-staleness", ["min", "mean", "max"].map((k) => ({ name: `staleness/${k}`, label: k, pts: column("learner", `staleness/${k}`, "step") })),
    { xLabel: "step", yZero: true, xInt: true });
  barChart("chart-staleness-hist", stalenessHistogram(), { xLabel: "staleness (versions)" });
  lineChart("chart-stream", ["backlog", "pending", "lag"].map((k) => ({ name: k, label: k, pts: column("broker", k, "ts") })),
    { xTime: true, yZero: true, empty: "no broker sample yet" });
  lineChart("chart-is", [
    { name: "is_weight_mean", label: "mean", pts: column("learner", "is_weight_mean", "step") },
    { name: "is_weight_max", label: "max", pts: column("learner", "is_weight_max", "step") },
  ], { xLabel: "step", xInt: true });
  lineChart("chart-clip", ["clip_frac", "dual_clip_frac", "is_masked_frac", "mismatch_abs"].map((k) => ({ name: k, label: k, pts: column("learner", k, "step") })),
    { xLabel: "step", yZero: true, xInt: true });
  lineChart("chart-idle", [
    { name: "learner", label: "learner", pts: column("learner", "idle_ratio", "ts") },
    ...rolloutSeries("rollout", K.rolloutIdle),
  ], { xTime: true, yZero: true, yMax: 1 });
  lineChart("chart-loss", ["loss", "entropy", "grad_norm"].map((k) => ({ name: k, label: k, pts: column("learner", k, "step") })),
    { xLabel: "step", xInt: true });
}

function renderEngines() {
  const rows = (S.summary.engines || []).map((e) => {
    const health = e.health || (e.reachable === null ? "-" : "");
    const reach = e.reachable === null ? "-" : e.reachable ? "yes" : "no";
    const version = e.weight_version ?? (e.registry_weight_version ?? "-");
    const seen = e.last_seen ? fmtAge(S.summary.ts - e.last_seen) : "-";
    const err = e.probe_error || e.registry_error || "";
    return `<tr data-engine="${esc(e.engine_id)}"><td title="${esc(e.url)}">${esc(e.engine_id)}</td>` +
      `<td class="health-${esc(health)}">${esc(health)}</td><td class="${reach}">${reach}</td>` +
      `<td class="num weight-version">${esc(String(version))}</td><td class="num">${esc(fmt(e.running))}</td>` +
      `<td class="num">${esc(fmt(e.waiting))}</td>` +
      `<td class="num outstanding">${esc(fmt(rolloutTotal([`engine/${e.engine_id}/outstanding`])))}</td>` +
      `<td class="num">${esc(fmt(e.gen_throughput))}</td>` +
      `<td>${esc(seen)}</td><td title="${esc(err)}">${esc(err.slice(0, 60))}</td></tr>`;
  });
  document.querySelector("#engines tbody").innerHTML = rows.join("") || `<tr><td colspan="10">no engine registered or configured</td></tr>`;
}

function renderOutcomes() {
  const rows = [];
  const add = (group, name, v) => rows.push(`<tr data-key="${esc(group)}/${esc(name)}"><th>${esc(group)}</th><td>${esc(name)}</td><td class="num">${esc(fmt(v))}</td></tr>`);
  const l = latest("learner") || {};
  for (const k of Object.keys(l).sort()) if (k.startsWith("total/")) add("learner totals", k.slice(6), l[k]);
  const b = S.summary.broker || {};
  for (const [k, v] of Object.entries(b.counters || {}).sort()) add("broker", k, v);
  for (const [k, v] of Object.entries(b.dropped_by_reason || {}).sort()) add("dropped", k, v);
  for (const [k, v] of Object.entries(b.dead_lettered_by_reason || {}).sort()) add("dead-lettered", k, v);
  if (b.error) rows.push(`<tr><th>broker</th><td colspan="2" class="no">${esc(b.error)}</td></tr>`);
  document.querySelector("#outcomes tbody").innerHTML = rows.join("") || `<tr><td>nothing counted yet</td></tr>`;
}

// The latest evaluation's pass@k (pass@1, pass@8, ...) and accuracy per difficulty bucket (bucket/greedy/<b>,
// bucket/sampled/<b>, bucket/n/<b>), and which reward scored it (reward_source/<training|task|function>).
function renderEvalDetail() {
  const l = latest("eval") || {};
  const num = (k) => Number((k.match(/\d+/) || [Infinity])[0]);
  const passes = Object.keys(l).filter((k) => /^pass@\d+$/.test(k)).sort((a, b) => num(a) - num(b));
  document.querySelector("#eval-passk tbody").innerHTML = passes.map((k) =>
    `<tr data-key="${esc(k)}"><th>${esc(k)}</th><td class="num">${esc(fmt(l[k]))}</td></tr>`).join("")
    || `<tr><td colspan="2">no sampled evaluation yet</td></tr>`;
  const buckets = Object.keys(l).filter((k) => k.startsWith("bucket/n/")).map((k) => k.slice(9))
    .sort((a, b) => a.split("=")[0].localeCompare(b.split("=")[0]) || num(a) - num(b));
  document.querySelector("#eval-buckets tbody").innerHTML = buckets.map((b) =>
    `<tr data-bucket="${esc(b)}"><th>${esc(b)}</th><td class="num">${esc(fmt(l[`bucket/greedy/${b}`]))}</td>` +
    `<td class="num">${esc(fmt(l[`bucket/sampled/${b}`]))}</td><td class="num">${esc(fmt(l[`bucket/n/${b}`]))}</td></tr>`).join("")
    || `<tr><td colspan="4">no difficulty buckets (none yet, or the task has none)</td></tr>`;
  const source = Object.keys(l).find((k) => k.startsWith("reward_source/"));
  document.getElementById("eval-reward").textContent = source ? `(scored with the ${source.slice(14)} reward)` : "";
}

function renderLatest() {
  const blocks = Object.entries(S.summary.roles).map(([role, r]) => {
    const rows = Object.keys(r.values).sort().map((k) => `<tr data-role="${esc(role)}" data-key="${esc(k)}"><td>${esc(k)}</td><td class="num">${esc(fmt(r.values[k]))}</td></tr>`);
    return `<div><h3>${esc(role)} <small>(${esc(r.id)})</small></h3><table>${rows.join("")}</table></div>`;
  });
  document.getElementById("latest").innerHTML = blocks.join("") || "no role has written metrics yet";
}

// ---- live sample viewer (GET /api/samples: the archiver's latest samples) --------------------------------

async function pollSamples() {
  try {
    S.samples = await getJSON("/api/samples?limit=12");
  } catch (err) {
    S.samples = { error: err.message, samples: [] };
  }
}

function renderSamples() {
  const data = S.samples || { samples: [] };
  const a = data.archive || {};
  document.getElementById("archive-status").textContent = data.error ? `(API error: ${data.error})`
    : a.rows !== undefined ? `(archive: ${a.rows} rows in ${a.parts} parts, ${a.waiting} groups awaiting an outcome${a.error ? "; error: " + a.error : ""})`
    : "(no archiver has run)";
  const current = data.policy_version ?? 0;
  const blocks = data.samples.map((x) => {
    const toks = x.tokens.map((t, i) => {
      const v = x.versions[i];
      const lag = Math.max(0, current - v);
      return `<span class="tok" data-version="${v}" data-lag="${Math.min(lag, 4)}" title="version ${v} (${lag} behind)">${esc(t)}</span>`;
    }).join("");
    const comps = Object.entries(x.components || {}).map(([k, v]) => `${esc(k)} ${esc(fmt(v))}`).join(", ");
    return `<div class="sample" data-group="${esc(x.group_id)}" data-index="${x.sample_index}" data-reward="${x.reward}">
      <div class="meta"><b>${esc(x.group_id)} #${x.sample_index}</b> · reward <b>${esc(fmt(x.reward))}</b> (${comps}) · ${esc(x.finish_reason)}${x.reward_status !== "ok" ? " · reward " + esc(x.reward_status) : ""}</div>
      <div class="text"><span class="prompt">${esc(x.prompt)}</span>${toks}</div></div>`;
  });
  document.getElementById("samples").innerHTML = blocks.join("") || "no trajectory archived yet";
}

function setStatus(state, text) {
  const el = document.getElementById("status");
  el.dataset.state = state;
  el.textContent = text;
}

function render() {
  renderHeader();
  renderTiles();
  renderCharts();
  renderEngines();
  renderOutcomes();
  renderEvalDetail();
  renderLatest();
  renderSamples();
}

async function tick() {
  try {
    const sum = await getJSON("/api/summary");
    S.summary = sum;
    S.refreshMs = Math.round(sum.settings.refresh_s * 1000);
    S.historyPoints = sum.settings.history_points;
    await Promise.all([...Object.keys(sum.roles), "broker"].map(pollSeries).concat([pollSamples()]));
    render();
    setStatus("ok", `live · updated ${clock(sum.ts)}`);
    document.body.dataset.ready = "1";
  } catch (err) {
    setStatus("error", `API error: ${err.message}`);
  }
  S.timer = setTimeout(tick, S.refreshMs);
}

tick();
