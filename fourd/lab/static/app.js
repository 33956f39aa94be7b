// The lab page. It draws what the server's API computes (fourd's schedules, simulator, layouts
// and planner) and keeps no model of its own: no schedule, cost or layout rule lives here.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG_NS = "http://www.w3.org/2000/svg";

async function api(endpoint, params) {
  const res = await fetch(`/api/${endpoint}?${new URLSearchParams(params)}`);
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || `${res.status} ${res.statusText}`);
  return body;
}

function showError(id, err) {
  const el = $(id);
  el.hidden = !err;
  el.textContent = err ? String(err.message || err) : "";
}

function el(tag, attrs = {}, parent = null, ns = null) {
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k === "style") node.style.cssText = v;  // CSSOM, which the page's CSP allows; a style attribute it would not
    else node.setAttribute(k, v);
  }
  if (parent) parent.appendChild(node);
  return node;
}

const percent = (x) => `${(100 * x).toFixed(1)} %`;

// Only the newest answer of each kind is drawn, however the requests overtake one another.
function latest(fn) {
  let ticket = 0;
  return async (...args) => {
    const mine = ++ticket;
    try {
      const result = await fn(...args);
      return mine === ticket ? result : undefined;
    } catch (err) {
      if (mine === ticket) throw err;
      return undefined;
    }
  };
}

// ---------------------------------------------------------------- timelines

// rows: [{label, right, blocks: [{kind, start, dur, text, info}]}], times in one unit.
function drawTimeline(container, rows, span, unit) {
  const longest = Math.max(0, ...rows.map((r) => r.label.length));
  const width = 1100, left = Math.min(280, Math.max(120, 7 * longest)), right = 80, rowH = 18, gap = 4, top = 4, axis = 18;
  const plotW = width - left - right;
  const height = top + rows.length * (rowH + gap) + axis;
  const scale = span > 0 ? plotW / span : 0;
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" }, null, SVG_NS);
  rows.forEach((row, i) => {
    const y = top + i * (rowH + gap);
    const g = el("g", { class: "row" }, svg, SVG_NS);
    el("text", { x: 0, y: y + rowH - 5, text: row.label }, g, SVG_NS);
    el("rect", { class: "row-bg", x: left, y, width: plotW, height: rowH }, g, SVG_NS);
    for (const b of row.blocks) {
      const x = left + b.start * scale, w = Math.max(b.dur * scale, 0.5);
      el("rect", { class: `blk ${b.kind}`, x: x.toFixed(2), y, width: w.toFixed(2), height: rowH,
                   "data-info": b.info }, g, SVG_NS);
      if (b.text !== undefined && w >= 14) {
        el("text", { class: `in ${b.kind}`, x: (x + w / 2).toFixed(2), y: y + rowH - 5, "text-anchor": "middle",
                     text: b.text }, g, SVG_NS);
      }
    }
    if (row.right) el("text", { class: "peak", x: width - right + 6, y: y + rowH - 5, text: row.right }, g, SVG_NS);
  });
  const yAxis = top + rows.length * (rowH + gap) + 12;
  el("text", { class: "peak", x: left, y: yAxis, text: `0 ${unit}` }, svg, SVG_NS);
  el("text", { class: "peak", x: left + plotW, y: yAxis, "text-anchor": "end", text: `${+span.toFixed(3)} ${unit}` }, svg, SVG_NS);
  const status = el("div", { class: "note", text: "\u00a0" });
  svg.addEventListener("mouseover", (e) => { if (e.target.dataset.info) status.textContent = e.target.dataset.info; });
  container.replaceChildren(svg, status);
}

// ---------------------------------------------------------------- the bench

function benchParams() {
  const q = { p: $("p").value, m: $("m").value, schedule: $("schedule").value };
  if (q.schedule === "interleaved") q.v = $("v").value;
  return q;
}

function readURL() {
  const q = new URLSearchParams(location.search);
  if (!q.has("v") && q.has("V")) q.set("v", q.get("V"));  // the seed names it V
  for (const k of ["p", "m", "v"]) if (q.has(k)) $(k).value = q.get(k);
  const s = q.get("schedule");
  if (s && [...$("schedule").options].some((o) => o.value === s)) $("schedule").value = s;
  if (q.has("layout")) $("layout").value = q.get("layout");
}

function writeURL() {
  const q = new URLSearchParams(benchParams());
  if ($("layout").value !== $("layout").defaultValue) q.set("layout", $("layout").value);
  history.replaceState(null, "", `?${q}${location.hash}`);
}

const fetchSchedule = latest((q) => api("schedule", q));

async function updateBench() {
  for (const k of ["p", "m", "v"]) $(`${k}-value`).textContent = $(k).value;
  $("v-label").hidden = $("schedule").value !== "interleaved";
  writeURL();
  let data;
  try {
    data = await fetchSchedule(benchParams());
  } catch (err) {
    showError("bench-error", err);
    return;
  }
  if (!data) return;
  showError("bench-error", null);
  $("idle").textContent = percent(data.idle_fraction);
  $("speedup").textContent = `${data.speedup.toFixed(2)}×`;
  $("makespan").textContent = `${+data.makespan.toFixed(3)} units`;
  const rows = data.ranks.map((r) => ({
    label: data.v > 1 ? `GPU ${r.rank} · ${r.stages.join(",")}` : `stage ${r.rank}`,
    // A stage of an interleaved rank holds 1/V of its layers: count its activations in whole microbatches.
    right: `peak ${+(r.peak_in_flight / data.v).toFixed(2)}`,
    blocks: r.events.map(([kind, stage, mb, start, dur]) => ({
      kind, start, dur, text: mb,
      info: `${kind} of microbatch ${mb} on stage ${stage} (GPU ${r.rank}): t = ${+start.toFixed(3)} to ${+(start + dur).toFixed(3)}`,
    })),
  }));
  drawTimeline($("timeline"), rows, data.makespan, "units");
}

// ---------------------------------------------------------------- the cluster row

const fetchCluster = latest((q) => api("cluster", q));
const groupColour = (index, n) => (n <= 1 ? "hsl(215 55% 45%)" : `hsl(${(index * 137.508) % 360} 58% 44%)`);

const NAMES = { tp: "TP", cp: "CP", pp: "PP", dp: "DP" };
const LEVELS = {
  nvlink: "inside one server (NVLink)", rack: "inside one rack", pod: "across racks inside one pod",
  "cross-pod": "across pods",
};

function describeSpan(dim, s) {
  if (s.size <= 1) return null;
  return `${NAMES[dim]}: ${s.groups.toLocaleString()} groups of ${s.size}, each ${LEVELS[s.level] || s.level}`;
}

async function updateCluster() {
  writeURL();
  let data;
  try {
    data = await fetchCluster({ layout: $("layout").value });
  } catch (err) {
    showError("cluster-error", err);
    return;
  }
  if (!data) return;
  showError("cluster-error", null);
  // CP groups are offered only when the layout sets cp.
  const cpOption = $("colour-by").querySelector("option[value=cp]");
  cpOption.disabled = data.spans.cp.size === 1;
  if (cpOption.disabled && $("colour-by").value === "cp") $("colour-by").value = "pp";
  const dim = $("colour-by").value;
  // Groups are named by their first rank; colours go to them in order of appearance.
  const order = new Map();
  for (const g of data.gpus) if (!order.has(g.groups[dim])) order.set(g.groups[dim], order.size);
  const racks = $("racks");
  racks.replaceChildren();
  const perRack = data.servers_per_rack * data.gpus_per_server;
  for (let r = 0; r < data.racks; r++) {
    const rack = el("div", { class: "rack" }, racks);
    el("div", { class: "label", text: `rack ${r}` }, rack);
    for (let s = 0; s < data.servers_per_rack; s++) {
      const server = el("div", { class: "server" }, rack);
      el("div", { class: "label", text: `server ${r * data.servers_per_rack + s}` }, server);
      const gpus = el("div", { class: "gpus" }, server);
      for (let k = 0; k < data.gpus_per_server; k++) {
        const rank = r * perRack + s * data.gpus_per_server + k;
        const gpu = data.gpus[rank];
        if (!gpu) {
          el("div", { class: "gpu unused", title: `GPU ${rank}: not used by ${data.layout}`, text: "·" }, gpus);
          continue;
        }
        const c = gpu.coords;
        el("div", {
          class: "gpu", "data-rank": rank, "data-group": gpu.groups[dim],
          style: `background:${groupColour(order.get(gpu.groups[dim]), order.size)}`,
          title: `rank ${rank}: tp ${c.tp}, cp ${c.cp}, pp ${c.pp}, dp ${c.dp}`,
          text: c[dim],
        }, gpus);
      }
    }
  }
  const lines = Object.keys(NAMES).map((d) => describeSpan(d, data.spans[d])).filter(Boolean);
  if (data.world > data.gpus.length) lines.push(`showing ranks 0–${data.gpus.length - 1} of ${data.world.toLocaleString()}`);
  $("spans").replaceChildren(...lines.map((t) => el("li", { text: t })));
}

// ---------------------------------------------------------------- the planner panel

const fetchPlan = latest((q) => api("plan", q));
const MEMORY_PARTS = ["params", "grads", "optimizer", "activations", "other", "reserve"];

function formParams(form) {
  const q = {};
  for (const [k, v] of new FormData(form)) if (typeof v === "string" && v !== "") q[k] = v;
  return q;
}

async function updatePlan() {
  let data;
  try {
    data = await fetchPlan(formParams($("plan-form")));
  } catch (err) {
    showError("plan-error", err);
    return;
  }
  if (!data) return;
  showError("plan-error", null);
  const plan = data.plan;
  $("plan-mfu").textContent = percent(plan.mfu);
  $("plan-step").textContent = `${plan.step_time_s.toFixed(2)} s`;
  $("plan-tflops").textContent = `${plan.tflops_per_gpu.toFixed(0)} TFLOP/s`;
  $("plan-fits").textContent = plan.fits ? "fits" : "does not fit";
  const lay = Object.entries(plan.layout).map(([k, v]) => `${k}=${v}`).join(",");
  const chosen = plan.chosen_by_planner.length ? ` · chosen by the planner: ${plan.chosen_by_planner.join(", ")}` : "";
  $("plan-config").textContent = `${lay} · ${plan.schedule}${plan.schedule === "interleaved" ? ` V=${plan.virtual_stages}` : ""}`
    + ` · ${plan.microbatches} microbatches of ${plan.micro_batch_seqs} sequences · ZeRO ${plan.zero}`
    + ` · recompute ${plan.recompute}${chosen}`;
  $("plan-why").replaceChildren(...data.why.map((t) => el("li", { text: t })));
  const cap = data.gpu_memory_gb;
  const used = (m) => MEMORY_PARTS.reduce((sum, part) => sum + m[part], 0);
  const most = Math.max(1.02 * cap, ...data.memory.map(used));  // room to show the red line
  const bars = data.memory.map((m) => {
    const bar = el("div", { class: "bar" });
    el("span", { class: "label", text: m.label }, bar);
    const track = el("div", { class: "track", title: `${used(m).toFixed(1)} GB of ${cap} GB` }, bar);
    let at = 0;
    for (const part of MEMORY_PARTS) {
      el("div", { class: `seg ${part}`, title: `${part}: ${m[part].toFixed(2)} GB`,
                  style: `left:${(100 * at / most).toFixed(3)}%;width:${(100 * m[part] / most).toFixed(3)}%` }, track);
      at += m[part];
    }
    el("div", { class: "cap", style: `left:${(100 * cap / most).toFixed(3)}%` }, track);
    el("span", { text: `${used(m).toFixed(1)} GB` }, bar);
    return bar;
  });
  const legend = el("div", { class: "legend" });
  for (const part of MEMORY_PARTS) {
    el("span", { class: `sw seg ${part}`, style: "position:static" }, legend);
    legend.append(` ${part} `);
  }
  legend.append(`· red line: the GPU's ${cap} GB`);
  $("memory").replaceChildren(...bars, legend);
}

async function loadOptions() {
  const data = await api("options", {});
  const fill = (select, names, chosen) => {
    select.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
    if (names.includes(chosen)) select.value = chosen;
  };
  fill($("plan-model"), data.models, "llama3-405b");
  fill($("plan-cluster"), data.clusters, "llama3-h100");
}

// ---------------------------------------------------------------- traces

// Chrome trace events (complete "X" events, or "B"/"E" pairs) to timeline rows, one per thread.
function traceRows(events) {
  const names = new Map(), rows = new Map(), open = new Map();
  const key = (e) => `${e.pid}/${e.tid}`;
  const row = (e) => {
    if (!rows.has(key(e))) rows.set(key(e), { pid: e.pid, tid: e.tid, blocks: [] });
    return rows.get(key(e));
  };
  const add = (e, ts, dur) => row(e).blocks.push({ name: String(e.name ?? ""), ts, dur, cat: e.cat });
  for (const e of events) {
    if (!e || typeof e !== "object") continue;
    if (e.ph === "M" && e.name === "thread_name") names.set(key(e), e.args?.name);
    else if (e.ph === "M" && e.name === "process_name") names.set(`${e.pid}`, e.args?.name);
    else if (e.ph === "X" && Number.isFinite(e.ts)) add(e, e.ts, Number(e.dur) || 0);
    else if (e.ph === "B" && Number.isFinite(e.ts)) open.set(`${key(e)}:${e.name}`, e);
    else if (e.ph === "E" && Number.isFinite(e.ts)) {
      const b = open.get(`${key(e)}:${e.name}`) ?? [...open.values()].reverse().find((o) => key(o) === key(e));
      if (b) { open.delete(`${key(b)}:${b.name}`); add(b, b.ts, e.ts - b.ts); }
    }
  }
  const all = [...rows.values()];
  if (!all.length) throw new Error("the trace holds no timed events (ph X, or B and E)");
  const t0 = Math.min(...all.flatMap((r) => r.blocks.map((b) => b.ts)));
  const t1 = Math.max(...all.flatMap((r) => r.blocks.map((b) => b.ts + b.dur)));
  all.sort((a, b) => (a.pid - b.pid) || (a.tid - b.tid));
  // The trainer and the simulator name compute events by action ("F3.0", "I1.2", "W") and file
  // transfers under the category pp (pipeline sends) or ag, rs, ar (data-parallel collectives).
  const COMM = { pp: "pp", ag: "dp", rs: "dp", ar: "dp" };
  const kind = (name, cat) => {
    const m = /^([FBIW])(?![A-Za-z])/.exec(name);
    if (m) return m[1];
    const n = name.toLowerCase();
    if (n.startsWith("forward") || n.startsWith("fwd")) return "F";
    if (n.startsWith("backward") || n.startsWith("bwd")) return "B";
    if (n.startsWith("weight")) return "W";
    return COMM[cat] || "other";
  };
  return {
    span: (t1 - t0) / 1000,
    rows: all.map((r) => ({
      label: names.get(`${r.pid}/${r.tid}`) || names.get(`${r.pid}`) || `pid ${r.pid} tid ${r.tid}`,
      blocks: r.blocks.map((b) => ({
        kind: kind(b.name, b.cat), start: (b.ts - t0) / 1000, dur: b.dur / 1000,
        info: `${b.name}${b.cat ? ` [${b.cat}]` : ""}: ${((b.ts - t0) / 1000).toFixed(3)} ms, ${(b.dur / 1000).toFixed(3)} ms`,
      })),
    })),
  };
}

function showTrace(which, doc, name) {
  const events = Array.isArray(doc) ? doc : doc.traceEvents;
  if (!Array.isArray(events)) throw new Error("not a Chrome trace: no traceEvents list");
  const { rows, span } = traceRows(events);
  $(`${which}-name`).textContent = name;
  if (span < 10000) {
    drawTimeline($(which), rows, span, "ms");
    return;
  }
  const inSeconds = rows.map((r) => ({ ...r, blocks: r.blocks.map((b) => ({ ...b, start: b.start / 1000, dur: b.dur / 1000 })) }));
  drawTimeline($(which), inSeconds, span / 1000, "s");
}

async function openTrace(ev) {
  ev.preventDefault();
  try {
    const file = $("trace-file").files[0];
    if (file) showTrace("measured", JSON.parse(await file.text()), file.name);
    else if ($("trace-path").value) {
      const data = await api("trace", { path: $("trace-path").value });
      showTrace("measured", data, data.path);
    } else throw new Error("choose a trace file, or give its path");
    showError("trace-error", null);
  } catch (err) {
    showError("trace-error", err);
  }
}

async function simulateTrace() {
  try {
    const q = formParams($("plan-form"));
    const data = await api("simtrace", q);
    showTrace("simulated", data, `${q.model} · ${q.layout} · ${q.schedule}`);
    showError("trace-error", null);
  } catch (err) {
    showError("trace-error", err);
  }
}

// ---------------------------------------------------------------- wiring

function debounced(fn, ms) {
  let timer;
  return () => { clearTimeout(timer); timer = setTimeout(fn, ms); };
}

function main() {
  readURL();
  const bench = debounced(updateBench, 30);
  for (const id of ["p", "m", "v", "schedule"]) $(id).addEventListener("input", bench);
  $("bench-form").addEventListener("submit", (e) => e.preventDefault());
  $("cluster-form").addEventListener("submit", (e) => { e.preventDefault(); updateCluster(); });
  $("layout").addEventListener("input", debounced(updateCluster, 250));
  $("colour-by").addEventListener("input", updateCluster);
  $("plan-form").addEventListener("submit", (e) => { e.preventDefault(); updatePlan(); });
  $("trace-form").addEventListener("submit", openTrace);
  $("simulate").addEventListener("click", simulateTrace);
  updateBench();
  updateCluster();
  loadOptions().then(updatePlan).catch((err) => showError("plan-error", err));
}

main();
