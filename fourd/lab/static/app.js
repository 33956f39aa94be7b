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
const count = (n, one, many = `${one}s`) => `${n.toLocaleString("en")} ${n === 1 ? one : many}`;

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

// Numbers as people write them: whole numbers from 100 up, three significant digits below.
const fmt = (x) => (Math.abs(x) >= 100 ? Math.round(x).toLocaleString("en") : String(+x.toPrecision(3)));

// About six axis ticks at 1, 2 or 5 times a power of ten.
function ticks(span) {
  if (!(span > 0)) return [0];
  const raw = span / 6, power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((k) => k * power).find((s) => s >= raw);
  return Array.from({ length: Math.floor(span / step + 1e-9) + 1 }, (_, i) => i * step);
}

const FONT_PX = 11, CHAR_PX = 6.5;  // every label of a drawing is FONT_PX on screen at any width

// rows: [{label, right, rightInfo, blocks: [{kind, start, dur, text, info}]}], times in `unit`. The drawing
// is as wide as its container in CSS pixels, so its text keeps its size; it is redrawn when the window resizes.
// Drawings that share a time axis pass the rows of all of them as `aligned`, so their label columns match.
function drawTimeline(container, rows, span, unit, aligned = rows) {
  container.lastDraw = [rows, span, unit, aligned];
  const width = Math.max(480, container.clientWidth || 1100), rowH = 20, gap = 4, top = 4, axis = 22;
  const widest = (texts) => CHAR_PX * Math.max(0, ...texts.map((t) => String(t || "").length));
  const left = Math.min(0.3 * width, Math.max(60, widest(aligned.map((r) => r.label)) + 10));
  const right = Math.min(0.3 * width, Math.max(40, widest(aligned.map((r) => r.right)) + 12));
  const plotW = width - left - right, height = top + rows.length * (rowH + gap) + axis;
  const scale = span > 0 ? plotW / span : 0;
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img" }, null, SVG_NS);
  rows.forEach((row, i) => {
    const y = top + i * (rowH + gap), base = y + rowH - 6;
    const g = el("g", { class: "row" }, svg, SVG_NS);
    el("text", { x: 0, y: base, text: row.label }, g, SVG_NS);
    el("rect", { class: "row-bg", x: left, y, width: plotW, height: rowH }, g, SVG_NS);
    for (const b of row.blocks) {
      const x = left + b.start * scale, w = Math.max(b.dur * scale, 0.5);
      el("rect", { class: `blk ${b.kind}`, x: x.toFixed(2), y, width: w.toFixed(2), height: rowH,
                   "data-info": b.info }, g, SVG_NS);
      if (b.text !== undefined && w >= 6 + CHAR_PX * String(b.text).length) {
        el("text", { class: `in ${b.kind}`, x: (x + w / 2).toFixed(2), y: base, "text-anchor": "middle",
                     text: b.text }, g, SVG_NS);
      }
    }
    if (row.right) el("text", { class: "peak", x: width - right + 8, y: base, text: row.right, "data-info": row.rightInfo }, g, SVG_NS);
  });
  const bottom = top + rows.length * (rowH + gap);
  const all = ticks(span);
  for (const t of all) {
    const x = left + t * scale, last = t === all[all.length - 1];
    el("line", { class: "tick", x1: x, x2: x, y1: top, y2: bottom }, svg, SVG_NS);
    el("text", { class: "axis", x, y: bottom + 14, "text-anchor": t === 0 ? "start" : "middle",
                 text: last ? `${fmt(t)} ${unit}` : fmt(t) }, svg, SVG_NS);
  }
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
  if (!q.has("v") && q.has("V")) q.set("v", q.get("V"));  // links may name it V, as the page does
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
  $("makespan").textContent = `${fmt(data.makespan)} units`;
  const zb = data.schedule === "zero-bubble";
  $("legend-b").textContent = zb ? "input gradients (the first half of backward)" : "backward";
  $("legend-w").hidden = !zb;
  $("legend-peak").textContent = data.v > 1
    ? `peak: the most activations a GPU holds at once, in microbatches' worth (each of its ${data.v} stages holds 1/${data.v} of a microbatch's)`
    : "peak: the most microbatches whose activations a GPU holds at once";
  const rows = data.ranks.map((r) => ({
    label: data.v > 1 ? `GPU ${r.rank} · stages ${r.stages.join(",")}` : `GPU ${r.rank}`,
    right: peakText(r.peak_in_flight, data.v),
    rightInfo: `GPU ${r.rank} holds at most ${r.peak_in_flight} (stage, microbatch) activations at once`,
    blocks: r.events.map(([kind, stage, mb, start, dur]) => ({
      kind, start, dur, text: mb,
      info: `${KINDS[kind]} of microbatch ${mb} on stage ${stage} (GPU ${r.rank}): from ${fmt(start)} to ${fmt(start + dur)} units`,
    })),
  }));
  drawTimeline($("timeline"), rows, data.makespan, "units");
}

const KINDS = { F: "forward", B: "backward", I: "input gradients", W: "weight gradients" };

// With V stages per GPU each in-flight (stage, microbatch) holds 1/V of a microbatch's activations on that GPU.
function peakText(inFlight, v) {
  if (v === 1) return `peak ${count(inFlight, "microbatch", "microbatches")}`;
  return `peak ${count(inFlight / v, "microbatch's", "microbatches'")} worth`;
}

// ---------------------------------------------------------------- the cluster row

const fetchCluster = latest((q) => api("cluster", q));
// Sixteen colours, each at least 34 apart from every other in CIELAB (ΔE*ab) and at least 3:1 against the
// white index written on it; group i takes colour i mod 16.
const PALETTE = [
  "#1f63c6", "#549c00", "#b40018", "#009c9c", "#f054b4", "#6c5424", "#6c3c60", "#d87800",
  "#d87878", "#780c90", "#005418", "#249cd8", "#9c9018", "#9c0048", "#00a86c", "#b478cc",
];

const NAMES = { tp: "TP", cp: "CP", pp: "PP", dp: "DP" };
const LEVELS = {
  nvlink: "inside one server (NVLink)", rack: "inside one rack", pod: "across racks inside one pod",
  "cross-pod": "across pods",
};

// s.levels counts the groups by the widest part of the cluster their members reach.
function describeSpan(dim, s, perServer) {
  if (s.size <= 1) return null;
  const head = `${NAMES[dim]}: ${s.groups.toLocaleString("en")} groups of ${s.size}`;
  const levels = Object.entries(s.levels);
  if (levels.length === 1) return `${head}, each ${LEVELS[levels[0][0]]}`;
  const parts = levels.map(([level, n]) => `${n.toLocaleString("en")} ${LEVELS[level]}`).join(", ");
  const inside = s.levels.nvlink || 0;
  const why = inside
    ? `${dim}=${s.size} does not divide a server's ${perServer} GPUs, so ${(s.groups - inside).toLocaleString("en")} groups straddle servers`
    : "the groups do not line up with the racks";
  return `${head}: ${parts}; ${why}`;
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
          style: `background:${PALETTE[order.get(gpu.groups[dim]) % PALETTE.length]}`,
          title: `rank ${rank}: tp ${c.tp}, cp ${c.cp}, pp ${c.pp}, dp ${c.dp}`,
          text: c[dim],
        }, gpus);
      }
    }
  }
  const lines = Object.keys(NAMES).map((d) => describeSpan(d, data.spans[d], data.gpus_per_server)).filter(Boolean);
  if (data.world > data.gpus.length) lines.push(`showing ranks 0–${data.gpus.length - 1} of ${data.world.toLocaleString("en")}`);
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
  const [low, high] = plan.step_time_s_interval || [], [mfuLow, mfuHigh] = plan.mfu_interval || [];
  $("plan-interval").textContent = low === undefined ? "–" // the suite's residuals (docs/planner.md)
    : `${low.toFixed(2)} – ${high.toFixed(2)} s, MFU ${percent(mfuLow)} – ${percent(mfuHigh)}`;
  $("plan-tflops").textContent = `${plan.tflops_per_gpu.toFixed(0)} TFLOP/s`;
  $("plan-fits").textContent = plan.fits ? "fits" : "does not fit";
  const lay = Object.entries(plan.layout).map(([k, v]) => `${k}=${v}`).join(",");
  const chosen = plan.chosen_by_planner.length ? ` · chosen by the planner: ${plan.chosen_by_planner.join(", ")}` : "";
  $("plan-config").textContent = `${lay} · ${plan.schedule}${plan.schedule === "interleaved" ? ` V=${plan.virtual_stages}` : ""}`
    + ` · ${count(plan.microbatches, "microbatch", "microbatches")} of ${count(plan.micro_batch_seqs, "sequence")}`
    + ` · ZeRO ${plan.zero}`
    + ` · recompute ${plan.recompute} · stack ${plan.stack}${chosen}`;
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
  fill($("plan-stack"), data.stacks, "fourd");
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
        info: `${b.name}${b.cat ? ` [${b.cat}]` : ""}: from ${fmt((b.ts - t0) / 1000)} ms for ${fmt(b.dur / 1000)} ms`,
      })),
    })),
  };
}

// The measured and the simulated trace share one time axis in ms, as long as the longer of the two.
const shown = {};

function showTrace(which, doc, name) {
  const events = Array.isArray(doc) ? doc : doc.traceEvents;
  if (!Array.isArray(events)) throw new Error("not a Chrome trace: no traceEvents list");
  shown[which] = traceRows(events);
  $(`${which}-name`).textContent = `${name} · ${fmt(shown[which].span)} ms`;
  const span = Math.max(...Object.values(shown).map((t) => t.span));
  const aligned = Object.values(shown).flatMap((t) => t.rows);
  for (const [w, t] of Object.entries(shown)) drawTimeline($(w), t.rows, span, "ms", aligned);
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
  window.addEventListener("resize", debounced(() => {
    for (const c of document.querySelectorAll(".timeline")) if (c.lastDraw) drawTimeline(c, ...c.lastDraw);
  }, 100));
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
