"use strict";
// The live page of `muster serve --http`: asks the replica's JSON API every second and shows what
// it answers. Every value goes into the page as text (append of a string, textContent), never as
// markup: a job, node or reason cannot inject anything.

const REFRESH_MS = 1000;
const TOKEN_KEY = "muster-token";
const main = document.getElementById("main");
const where = document.getElementById("where");
const login = document.getElementById("login");
const tokenInput = document.getElementById("token");
let previous = null; // the last answer's highest step and when, for steps per second

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") e.className = value;
    else e.setAttribute(name, value);
  }
  for (const c of children) e.append(c instanceof Node ? c : c === null || c === undefined ? "-" : String(c));
  return e;
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, ...children) {
  const e = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) e.setAttribute(name, String(value));
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}

function seconds(s) {
  return s.toFixed(3) + " s";
}

function bytes(n) {
  return n >= 1048576 ? (n / 1048576).toFixed(1) + " MiB" : n >= 1024 ? (n / 1024).toFixed(1) + " KiB" : n + " B";
}

// One series of the job's history (JobHealth.history, oldest first) as a line over time.
function chart(title, samples, value, id) {
  const w = 360, h = 110, left = 44, bottom = 18, top = 8;
  const t0 = samples[0].unix_ms, span = Math.max(1, samples[samples.length - 1].unix_ms - t0);
  const most = Math.max(1e-9, ...samples.map(value));
  const x = (s) => left + ((s.unix_ms - t0) / span) * (w - left - 4);
  const y = (s) => top + (1 - value(s) / most) * (h - top - bottom);
  const points = samples.map((s) => x(s).toFixed(1) + "," + y(s).toFixed(1)).join(" ");
  const last = value(samples[samples.length - 1]);
  return el("figure", { class: "chart", id: id },
    el("figcaption", {}, title, " ", el("b", {}, Number.isInteger(last) ? last : last.toFixed(1))),
    svg("svg", { width: w, height: h, viewBox: "0 0 " + w + " " + h, role: "img" },
      svg("line", { x1: left, y1: h - bottom, x2: w, y2: h - bottom, class: "axis" }),
      svg("line", { x1: left, y1: top, x2: left, y2: h - bottom, class: "axis" }),
      svg("text", { x: left - 4, y: top + 8, "text-anchor": "end" }, Number.isInteger(most) ? most : most.toFixed(1)),
      svg("text", { x: left - 4, y: h - bottom, "text-anchor": "end" }, "0"),
      svg("text", { x: left, y: h - 4 }, new Date(t0).toLocaleTimeString()),
      svg("text", { x: w - 4, y: h - 4, "text-anchor": "end" }, new Date(t0 + span).toLocaleTimeString()),
      svg("polyline", { points: points, class: "series" })));
}

// A recovery's phases (RecoveryRecord) one after another, to scale, the slowest marked.
const PHASES = [
  ["detected", "detected", (r) => r.detection_s],
  ["delivered", "maps delivered", (r) => r.delivered_s],
  ["aborted", "old group aborted", (r) => r.abort_s],
  ["formed", "new group formed", (r) => r.form_s],
  ["moved", "state moved", (r) => r.sync_s],
  ["first_step", "first step", (r) => r.first_step_s],
];

// Where a recovery's state came from (RecoveryRecord.tier).
const TIERS = {
  replica: "the ranks' own (in memory)", snapshot: "peer snapshots", checkpoint: "durable checkpoint",
  none: "nothing: lost, begun again",
};

function timeline(r) {
  const w = 720, h = 22;
  const total = PHASES.reduce((sum, [, , d]) => sum + d(r), 0) || 1;
  const bar = svg("svg", { width: w, height: h, viewBox: "0 0 " + w + " " + h, role: "img" });
  let at = 0;
  for (const [key, name, d] of PHASES) {
    const width = (d(r) / total) * w;
    if (width > 0) {
      bar.append(svg("rect", { x: at.toFixed(1), y: 0, width: width.toFixed(1), height: h,
        class: "phase-" + key + (r.slowest === key ? " slowest" : "") }, svg("title", {}, name + " " + seconds(d(r)))));
    }
    if (key === "detected") bar.append(svg("line", { x1: at + width, y1: 0, x2: at + width, y2: h, class: "decided" }));
    at += width;
  }
  const legend = PHASES.map(([key, name, d]) => {
    const moved = key === "moved" && r.bytes_moved
      ? " (" + bytes(r.bytes_moved) + (r.transfer_s ? ", " + bytes(r.bytes_moved / r.transfer_s) + "/s" : "") + ")" : "";
    return el("li", { class: "phase-" + key + (r.slowest === key ? " slowest" : "") }, name, " ", seconds(d(r)), moved);
  });
  legend.splice(1, 0, el("li", { class: "decided" }, "decided ", when(r.decided_unix_ms)));
  return el("div", { class: "recovery", id: "recovery-" + r.generation },
    el("p", {}, "Generation ", r.generation, r.planned ? " (planned)" : "",
      r.superseded_by ? ": superseded by generation " + r.superseded_by + " " : ": every rank stepping ",
      seconds(r.recovery_s), " after the decision; slowest: ",
      el("b", { class: "slowest-name" }, PHASES.find(([key]) => key === r.slowest)[1])),
    bar, el("ul", { class: "legend" }, ...legend));
}

function when(ms) {
  return ms === null ? "-" : new Date(ms).toLocaleString(undefined, { timeZoneName: "short" });
}

function table(headers, rows) {
  const head = el("tr", {}, ...headers.map((h) => el("th", {}, h)));
  const body = rows.map((r) => el("tr", { class: r.class || "" },
    ...r.cells.map((c) => el("td", typeof c === "number" ? { class: "num" } : {}, c))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

async function get(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const response = await fetch(path, { headers: token ? { Authorization: "Bearer " + token } : {}, cache: "no-store" });
  const body = await response.json().catch(() => ({ error: response.status + " " + response.statusText }));
  login.hidden = response.status !== 401 && response.status !== 403;
  if (!response.ok) throw new Error(body.error);
  return body;
}

function jobsView(doc) {
  where.textContent = "replica " + doc.replica;
  document.title = "Muster: jobs";
  const rows = doc.jobs.map((j) => ({
    cells: [el("a", { href: "/jobs/" + encodeURIComponent(j.name) }, j.name), j.run,
      el("span", { class: "outcome-" + j.outcome }, j.outcome), j.generation, j.world_size, j.step,
      j.steps_per_second === null ? null : j.steps_per_second.toFixed(1), j.leader,
      when(j.started_unix_ms), when(j.ended_unix_ms), j.reason],
  }));
  return [el("h1", {}, "Jobs"), doc.jobs.length
    ? table(["job", "run", "outcome", "generation", "world size", "step", "steps/s", "leader", "started", "ended",
      "reason"], rows)
    : el("p", { class: "note" }, "No jobs.")];
}

function jobView(doc) {
  const j = doc.status.jobs[0];
  where.textContent = "answered by " + doc.status.replica;
  document.title = "Muster: " + j.name;
  const step = j.ranks.reduce((most, r) => Math.max(most, r.step), 0);
  const now = Date.now();
  const same = previous && previous.job === j.name && previous.run === j.run && now > previous.time;
  const rate = same ? ((step - previous.step) * 1000) / (now - previous.time) : null;
  previous = { job: j.name, run: j.run, step: step, time: now };
  const out = [el("h1", {}, "Job ", j.name), el("p", { class: "facts" },
    el("span", {}, "run ", j.run), el("span", { class: "outcome-" + j.outcome, id: "outcome" }, j.outcome),
    el("span", {}, "phase ", j.phase), el("span", { id: "generation" }, "generation ", j.generation),
    el("span", {}, "world size ", j.world_size), el("span", {}, "step ", step),
    el("span", {}, "steps/s ", rate === null ? null : rate.toFixed(1)),
    el("span", {}, "leader ", j.leader, " (term ", j.term, ")"))];
  if (j.outcome !== "running") out.push(el("p", {}, "Ended ", when(j.ended_unix_ms), ": ", j.outcome_reason));
  if (!j.live && j.outcome === "running") {
    out.push(el("p", { class: "note" }, j.leader
      ? "As etcd holds it: the leader, " + j.leader + ", did not answer this replica (its ranks and steps are live there)."
      : "As etcd holds it: the job has no leader now."));
  }
  if (j.health) {
    const h = j.health;
    out.push(el("h2", {}, "Health"), el("p", { class: "facts" },
      el("span", {}, "live ranks ", h.live_ranks), el("span", {}, "frames/s ", h.frames_per_second.toFixed(1)),
      el("span", {}, "evictions ", h.evictions),
      el("span", {}, "last failure detected in ", h.last_detection_s.toFixed(3), " s"),
      el("span", {}, "last recovery took ", h.last_recovery_s.toFixed(3), " s")));
    if (h.history.length > 1) {
      out.push(el("h2", {}, "Over time"), el("div", { class: "charts" },
        chart("world size", h.history, (s) => s.world_size, "chart-world-size"),
        chart("steps/s", h.history, (s) => s.steps_per_second, "chart-steps"),
        chart("restarts", h.history, (s) => s.restarts, "chart-restarts")));
    }
    if (h.recent_recoveries.length) {
      out.push(el("h2", {}, "Recent recoveries (newest first)"), table(
        ["generation", "decided", "failure detected in", "recovered in", "slowest phase", "state from", "step",
          "steps lost"],
        h.recent_recoveries.slice().reverse().map((r) => ({
          cells: [r.generation, when(r.decided_unix_ms),
            r.planned ? "planned" : r.detection_s.toFixed(3) + " s",
            r.superseded_by ? "superseded by g" + r.superseded_by + " after " + r.recovery_s.toFixed(3) + " s"
              : r.recovery_s.toFixed(3) + " s", r.slowest,
            r.tier === null ? "-" : TIERS[r.tier] || r.tier, r.tier === null ? "-" : r.step,
            r.tier === null ? "-" : r.steps_lost],
        }))), ...h.recent_recoveries.slice().reverse().map(timeline));
    }
  }
  out.push(el("h2", {}, "Ranks"), table(
    ["rank", "local", "node", "node rank", "host", "pid", "state", "step", "step time", "compute", "compute share",
      "straggler", "restarts", "snapshots", "phase"],
    j.ranks.map((r) => ({
      class: (r.straggler_factor ? "straggler " : "") + r.state,
      cells: [r.rank, r.local_rank, r.node, r.node_rank, r.host, r.pid, r.state, r.step,
        r.step_time_us === null ? null : (r.step_time_us / 1000).toFixed(1) + " ms",
        r.compute_us === null ? null : (r.compute_us / 1000).toFixed(1) + " ms",
        // the rest of a step is the wait for the others in the gradients' all-reduce
        r.compute_us === null || r.step_time_us === null ? null : Math.round((100 * r.compute_us) / r.step_time_us) + "%",
        r.straggler_factor === null ? null : "straggler " + r.straggler_factor.toFixed(2) + "x", r.restarts,
        // peer snapshots: the period, and the host memory they take on the rank
        r.snapshot_every === null ? null : "every " + r.snapshot_every + " steps, " +
          ((r.snapshot_bytes || 0) / 1048576).toFixed(1) + " MiB", r.phase],
    }))));
  if (j.next_page_token !== null) out.push(el("p", { class: "note" }, "The first ", j.ranks.length, " ranks of ", j.world_size, "."));
  out.push(el("p", {}, "Nodes: ", j.nodes.join(", ") || null, ". Spares: ", j.spares.join(", ") || null, "."));
  const events = doc.events.events.slice().reverse();
  out.push(el("h2", {}, "Events (newest first)"), table(["time", "generation", "kind", "nodes", "world size", "reason"],
    events.map((e, i) => ({
      // a line under the first event of each generation (the list is newest first)
      class: i + 1 < events.length && events[i + 1].generation !== e.generation ? "generation" : "",
      cells: [when(e.time_unix_ms), e.generation, e.kind, e.nodes.join(", "), e.world_size || null, e.reason],
    }))));
  return out;
}

async function refresh() {
  const job = location.pathname.startsWith("/jobs/") ? decodeURIComponent(location.pathname.slice(6)) : null;
  try {
    const doc = await get(job === null ? "/api/jobs" : "/api/jobs/" + encodeURIComponent(job));
    main.replaceChildren(...(job === null ? jobsView(doc) : jobView(doc)));
  } catch (error) {
    main.replaceChildren(el("p", { class: "error" }, error.message));
  }
  setTimeout(refresh, REFRESH_MS);
}

login.addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, tokenInput.value);
  tokenInput.value = "";
  login.hidden = true; // the next refresh asks with it
});

refresh();
