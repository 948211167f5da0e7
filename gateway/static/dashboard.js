// The live page: reads /dashboard/stream (one snapshot a second), keeps five minutes of them,
// and draws rates from each engine's cumulative counters. Latency charts draw each engine's own
// p50 (solid) and p90 (dashed), measured in the engine, beside the gateway's (grey): the gap
// between them is the gateway's own work and the network.
"use strict";

const SPAN_S = 300, RATE_S = 5, TILE_S = 10;
const GATEWAY_COLOR = "#8a93a6", P90_DASH = [5, 3];
const history = [];   // snapshots, oldest first

const fmt = {
  secs: (v) => v === null || v === undefined ? "–" : v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`,
  pct: (v) => v === null || v === undefined ? "–" : `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`,
  num: (v) => v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2).replace(/\.?0+$/, "") || "0",
  axisSecs: (v) => v === 0 ? "0" : v < 1 ? `${+(v * 1000).toPrecision(2)}ms` : `${+v.toPrecision(2)}s`,
  axisPct: (v) => `${Math.round(v * 100)}%`,
  axisNum: (v) => v >= 1000 ? `${+(v / 1000).toFixed(1)}k` : `${+v.toFixed(2)}`,
};

const CHARTS = [
  {id: "ttft", title: "Time to first token", format: fmt.axisSecs, quantiles: "ttft"},
  {id: "itl", title: "Inter-token latency", format: fmt.axisSecs, quantiles: "itl"},
  {id: "tps", title: "Output tokens/s", format: fmt.axisNum, rate: true, engine: (e, past, dt) => delta(e, past, "generation_tokens") / dt},
  {id: "running", title: "Requests running", format: fmt.axisNum, engine: (e) => e.running},
  {id: "waiting", title: "Requests waiting", format: fmt.axisNum, engine: (e) => e.waiting},
  {id: "kv", title: "KV cache used", format: fmt.axisPct, max: 1, engine: (e) => e.kv_usage},
  {id: "hit", title: "Prefix-cache hit rate", format: fmt.axisPct, max: 1, rate: true, engine: (e, past) => ratio(e, past, "prefix_hits", "prefix_queries")},
  {id: "tier", title: "Prefix hits from the KV tier", format: fmt.axisPct, max: 1, rate: true, engine: (e, past) => e.tier_hits === undefined ? null : ratio(e, past, "tier_hits", "prefix_queries")},
  {id: "tierbytes", title: "KV tier MB moved/s", format: fmt.axisNum, rate: true, engine: (e, past, dt) => e.tier_bytes === undefined ? null : delta(e, past, "tier_bytes") / dt / 1e6},
  {id: "tierblocks", title: "KV tier blocks", format: fmt.axisNum, engine: (e) => e.tier_blocks === undefined ? null : e.tier_blocks},
  {id: "spec", title: "Speculative acceptance", format: fmt.axisPct, max: 1, rate: true, engine: (e, past) => ratio(e, past, "spec_accepted_tokens", "spec_draft_tokens")},
  {id: "pre", title: "Preemptions/s", format: fmt.axisNum, rate: true, engine: (e, past, dt) => delta(e, past, "preemptions") / dt},
  {id: "batchrows", title: "Batch rows per step", format: fmt.axisNum, rate: true, engine: (e, past) => ratio(e, past, "batch_rows", "steps")},
  {id: "batchlines", title: "Batch lines/s", format: fmt.axisNum, rate: true, engine: (e, past, dt) => delta(e, past, "batch_finished") / dt},
];

// A counter's growth; an engine that restarted (its counter fell) counts from zero.
function delta(e, past, key) {
  if (!past) return 0;
  const d = e[key] - past[key];
  return d >= 0 ? d : e[key];
}

function ratio(e, past, num, den) {
  const d = delta(e, past, den);
  return d > 0 ? delta(e, past, num) / d : null;
}

// The snapshot closest to `seconds` before the i-th.
function back(i, seconds) {
  const t = history[i].t - seconds;
  let j = i;
  while (j > 0 && history[j - 1].t >= t - 0.5) j--;
  return j === i ? null : history[j];
}

function engineIds() {
  const ids = new Set();
  for (const s of history) for (const id of Object.keys(s.engines)) ids.add(id);
  return [...ids].sort();
}

function buildCharts() {
  const root = document.getElementById("charts");
  for (const c of CHARTS) {
    const card = document.createElement("div");
    card.className = "card";
    card.innerHTML = `<h2>${c.title}<span class="legend" id="legend-${c.id}"></span></h2><canvas id="chart-${c.id}"></canvas>`;
    root.appendChild(card);
  }
}

const value = (v) => v === undefined ? null : v;
// A cluster's engine ids already say "engine-…"; the embedded engine is "0".
const engineLabel = (id) => id.startsWith("engine") ? id : `engine ${id}`;

// p50 and p90 of one latency: each engine's in its colour, then the gateway's in grey.
function quantileSeries(q, ids) {
  const out = [];
  const add = (label, color, width, get) => {
    for (const [p, dash] of [["p50", []], ["p90", P90_DASH]]) {
      out.push({label, color, width, dash, points: history.map((s) => [s.t, get(s, `${q}_${p}`)])});
    }
  };
  ids.forEach((id, k) => add(engineLabel(id), PALETTE[k % PALETTE.length], 1.8,
    (s, key) => s.engines[id] ? value(s.engines[id][key]) : null));
  add("gateway", GATEWAY_COLOR, 1.2, (s, key) => value(s[key]));
  return out;
}

function seriesFor(c, ids) {
  if (c.quantiles) return quantileSeries(c.quantiles, ids);
  return ids.map((id, k) => ({
    label: engineLabel(id), color: PALETTE[k % PALETTE.length],
    points: history.map((s, i) => {
      const e = s.engines[id];
      if (!e) return [s.t, null];
      const past = back(i, RATE_S), before = past && past.engines[id];
      if (c.rate && !before) return [s.t, null];   // a rate needs an earlier snapshot of this engine
      return [s.t, c.engine(e, before, past ? s.t - past.t : 1)];
    }),
  }));
}

function draw() {
  const ids = engineIds();
  for (const c of CHARTS) {
    const series = seriesFor(c, ids);
    drawChart(document.getElementById(`chart-${c.id}`), series, {spanS: SPAN_S, max: c.max, format: c.format});
    const labels = new Map(series.map((s) => [s.label, s.color]));   // one entry per engine
    document.getElementById(`legend-${c.id}`).innerHTML = [...labels].map(([label, color]) =>
      `<span><i style="background:${color}"></i>${escapeHtml(label)}</span>`).join("") +
      (c.quantiles ? `<span class="key"><i class="solid"></i>p50 <i class="dashed"></i>p90</span>` : "");
  }
}

// Engine ids come from the cluster's registry, not from this page: never markup.
function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function sum(engines, f) {
  return Object.values(engines).reduce((a, e) => a + f(e), 0);
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function updateTiles() {
  const i = history.length - 1, now = history[i];
  const past = back(i, TILE_S), minute = back(i, 60);
  const dt = past ? now.t - past.t : 0;
  const totals = (s) => ({
    gen: sum(s.engines, (e) => e.generation_tokens), prompt: sum(s.engines, (e) => e.prompt_tokens),
    hits: sum(s.engines, (e) => e.prefix_hits), queries: sum(s.engines, (e) => e.prefix_queries),
    acc: sum(s.engines, (e) => e.spec_accepted_tokens), drafts: sum(s.engines, (e) => e.spec_draft_tokens),
    pre: sum(s.engines, (e) => e.preemptions),
  });
  const cur = totals(now), old = past ? totals(past) : null, min = minute ? totals(minute) : null;
  const grew = (k, from) => from ? Math.max(0, cur[k] - from[k]) : 0;
  setText("v-ttft", fmt.secs(now.ttft_p50)); setText("s-ttft", `p90 ${fmt.secs(now.ttft_p90)}`);
  setText("v-itl", fmt.secs(now.itl_p50)); setText("s-itl", `p90 ${fmt.secs(now.itl_p90)}`);
  setText("v-tps", dt ? fmt.num(grew("gen", old) / dt) : "–");
  setText("s-tps", `prompt ${dt ? fmt.num(grew("prompt", old) / dt) : "–"} tok/s`);
  setText("v-running", sum(now.engines, (e) => e.running));
  setText("s-running", `waiting ${sum(now.engines, (e) => e.waiting)}`);
  const blocks = sum(now.engines, (e) => e.kv_blocks_total);
  setText("v-kv", blocks ? fmt.pct(sum(now.engines, (e) => e.kv_usage * e.kv_blocks_total) / blocks) : "–");
  setText("s-kv", `of ${blocks} blocks`);
  const q = grew("queries", old), d = grew("drafts", old);
  setText("v-hit", q ? fmt.pct(grew("hits", old) / q) : "–");
  setText("v-spec", d ? fmt.pct(grew("acc", old) / d) : "–");
  setText("s-spec", d ? `${grew("acc", old)} of ${d} drafted` : "no drafts");
  setText("v-pre", min ? grew("pre", min) : "0");
}

function updateTable() {
  const i = history.length - 1, now = history[i], past = back(i, TILE_S);
  const rows = Object.entries(now.engines).map(([id, e]) => {
    const p = past && past.engines[id];
    const dt = p ? now.t - past.t : 0;
    const hit = p ? ratio(e, p, "prefix_hits", "prefix_queries") : null;
    const acc = p ? ratio(e, p, "spec_accepted_tokens", "spec_draft_tokens") : null;
    const quantiles = (q) => `${fmt.secs(value(e[`${q}_p50`]))} · ${fmt.secs(value(e[`${q}_p90`]))}`;
    return `<tr><td>${escapeHtml(id)}</td><td>${quantiles("ttft")}</td><td>${quantiles("itl")}</td>` +
      `<td>${e.running}</td><td>${e.waiting}</td><td>${fmt.pct(e.kv_usage)}</td>` +
      `<td>${dt ? fmt.num(delta(e, p, "generation_tokens") / dt) : "–"}</td><td>${fmt.pct(hit)}</td>` +
      `<td>${fmt.pct(acc)}</td><td>${e.preemptions}</td><td>${e.generation_tokens}</td></tr>`;
  });
  document.querySelector("#engines tbody").innerHTML = rows.join("") ||
    `<tr><td colspan="11">no engine is serving</td></tr>`;
}

function onSnapshot(s) {
  history.push(s);
  while (history.length && history[0].t < s.t - SPAN_S - RATE_S) history.shift();
  const n = Object.keys(s.engines).length;
  setText("model", `${s.model || "–"} · ${n} engine${n === 1 ? "" : "s"}`);
  updateTiles();
  updateTable();
  draw();
}

function setStatus(text, cls) {
  setText("status", text);
  document.getElementById("dot").className = `dot ${cls}`;
}

async function connect() {
  try {
    const r = await MatineeKey.fetch("/dashboard/stream", {cache: "no-store"});
    if (!r.ok) throw new Error(`the stream answered ${r.status}`);
    setStatus("live", "live");
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) if (line.startsWith("data: ")) onSnapshot(JSON.parse(line.slice(6)));
      }
    }
    setStatus("reconnecting…", "down");
  } catch (err) {
    setStatus(`reconnecting… (${err.message})`, "down");
  }
  setTimeout(connect, 2000);
}

buildCharts();
window.addEventListener("resize", () => history.length && draw());
connect();
