// The status page: polls the control API (cookie-authenticated, read-only) every second
// and redraws runs, their latest round, a plot of each run's metrics, and the nodes.
"use strict";
const rounds = {};      // run id -> {after: last event seq, series: {metric: [[round, value]]}}
const PERIOD_MS = 1000;

async function get(path) {
  const response = await fetch(path, {credentials: "same-origin"});
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

async function pollRounds(run) {
  const seen = rounds[run.id] || (rounds[run.id] = {after: 0, series: {}, latest: null});
  const body = await get(`/api/runs/${run.id}/events?after=${seen.after}`);
  for (const event of body.events) {
    seen.after = Math.max(seen.after, event.seq);
    if (event.kind !== "round" || !event.data) continue;
    seen.latest = event.data;
    for (const [key, value] of Object.entries(event.data.metrics || {})) {
      if (typeof value !== "number") continue;
      (seen.series[key] || (seen.series[key] = [])).push([event.data.round, value]);
    }
  }
  return seen;
}

async function refresh() {
  const {runs} = await get("/api/runs");
  const body = document.querySelector("#runs tbody");
  const rows = [];
  for (const run of runs.slice().reverse()) {
    const seen = await pollRounds(run);
    const row = document.createElement("tr");
    row.id = `run-${run.id}`;
    row.dataset.state = run.state;
    cell(row, run.id);
    cell(row, run.name);
    cell(row, run.state, `state-${run.state}`);
    cell(row, `${run.rounds_completed} / ${run.rounds}`, "round").dataset.round = String(run.rounds_completed);
    const metrics = seen.latest ? Object.entries(seen.latest.metrics || {})
      .filter(([, v]) => typeof v === "number").map(([k, v]) => `${k} ${v.toPrecision(4)}`).join(", ") : "";
    cell(row, metrics, "metrics");
    row.insertCell().appendChild(MeshPlot.draw(seen.series, 240, 60));
    rows.push(row);
  }
  body.replaceChildren(...rows);
  const nodes = await get("/api/nodes");
  document.getElementById("address").textContent = `nodes join at ${nodes.address}`;
  const nbody = document.querySelector("#nodes tbody");
  nbody.replaceChildren(...nodes.nodes.map((n) => {
    const row = document.createElement("tr");
    cell(row, n.id);
    cell(row, n.connected ? "yes" : "no");
    cell(row, n.busy_run || "");
    cell(row, String(n.runs_served));
    cell(row, (n.caps && n.caps.platform) || "");
    cell(row, new Date(n.last_seen * 1000).toLocaleTimeString());
    return row;
  }));
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

async function loop() {
  try { await refresh(); } catch (error) {
    document.getElementById("updated").textContent = `update failed: ${error.message}`;
  }
  setTimeout(loop, PERIOD_MS);
}
loop();
