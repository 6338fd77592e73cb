// slime-server dashboard: polls the JSON API every 2 s and draws jobs, training curves, engines and
// recent sessions with their token view. Plain JS, no build step; charts are uPlot (vendored).
//
// Every data call carries "Authorization: Bearer <admin key>"; the key comes from ?key= (then kept in
// localStorage and removed from the address bar) or from the key box.
// Tests read window.dashboard (points per chart, engines, the token view) instead of scraping canvases.
(() => {
  "use strict";

  const POLL_MS = 2000;
  const KEY_STORAGE = "slime-server.dashboard.key";
  const MAX_TOKENS_SHOWN = 20000;
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

  // One chart per entry; a series is drawn only if the job reports that metric (missing ones are skipped).
  const CHARTS = [
    { id: "reward", title: "reward", series: [["reward_mean", "reward mean"], ["success_rate", "success rate"]] },
    { id: "eval", title: "eval success rate", evals: true },
    { id: "loss", title: "loss", series: [["loss", "loss"]] },
    { id: "kl", title: "KL", series: [["kl", "KL"]] },
    { id: "clip", title: "clip fraction", series: [["clip_fraction", "clip fraction"], ["clip_frac", "clip fraction"]] },
    { id: "staleness", title: "staleness (versions)", series: [["staleness_mean", "mean"], ["staleness_max", "max"]] },
    { id: "tokens_per_s", title: "tokens / s", series: [["tokens_per_s", "tokens/s"]] },
    { id: "version", title: "policy version", series: [["policy_version", "version"]] },
  ];

  const state = {
    key: null,
    jobs: [],
    jobId: null,          // the job whose curves are shown
    metrics: [],          // MetricsRow[] of that job, in step order
    evals: [],
    charts: {},           // id -> {plot, labels, el}
    points: {},           // id -> number of steps drawn (read by tests)
    engines: null,        // last EnginesView
    sessions: [],
    tokenView: null,      // {sessionId, trajectories, tokens, generated}
    lastError: null,
  };
  window.dashboard = state;

  const $ = (sel) => document.querySelector(sel);

  // ------------------------------------------------------------------ API
  async function api(path, options = {}) {
    const headers = { ...(options.headers || {}) };
    if (state.key) headers.Authorization = `Bearer ${state.key}`;
    if (options.body !== undefined) headers["Content-Type"] = "application/json";
    const r = await fetch(path, { ...options, headers, body: options.body && JSON.stringify(options.body) });
    if (!r.ok) {
      let message = r.statusText;
      try { message = (await r.json()).error.message; } catch (_) { /* not an OpenAI error body */ }
      const err = new Error(`${r.status}: ${message}`);
      err.status = r.status;
      throw err;
    }
    return r.json();
  }

  // ------------------------------------------------------------------ small DOM helpers
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
    return node;
  }
  const badge = (text, cls = text) => el("span", { class: `badge ${cls}` }, text);
  const fmt = (x, digits = 3) => (x === null || x === undefined ? "—" : Number(x).toFixed(digits).replace(/\.?0+$/, ""));
  const shortId = (id) => (id.length > 22 ? `${id.slice(0, 10)}…${id.slice(-8)}` : id);

  function ago(t) {
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    return new Date(t * 1000).toLocaleString();
  }

  function setStatus(text, isError = false) {
    const s = $("#status");
    s.textContent = text;
    s.classList.toggle("error", isError);
  }

  // ------------------------------------------------------------------ jobs
  const ACTIONS = { pause: ["running", "queued"], resume: ["paused"], cancel: ["running", "queued", "paused"] };

  async function refreshJobs() {
    try {
      state.jobs = (await api("/jobs")).data;
    } catch (e) {
      state.jobs = [];
      $("#jobs-note").textContent = e.status === 503 ? "this server runs without a trainer (no jobs)" : e.message;
      renderJobs();
      if (e.status !== 503) throw e;
      return;
    }
    $("#jobs-note").textContent = state.jobs.length ? "" : "no jobs yet: POST /jobs to start one";
    if (!state.jobs.some((j) => j.id === state.jobId)) {
      const active = state.jobs.filter((j) => ["running", "paused", "queued"].includes(j.status));
      const pick = active.at(-1) || state.jobs.at(-1);
      selectJob(pick ? pick.id : null);
    }
    renderJobs();
  }

  function renderJobs() {
    const body = $("#jobs tbody");
    body.replaceChildren(...state.jobs.slice().reverse().map((j) => {
      const controls = el("div", { class: "controls" }, ...Object.entries(ACTIONS).map(([action, from]) =>
        el("button", { type: "button", dataset: { action, job: j.id }, disabled: !from.includes(j.status),
                        onclick: (ev) => { ev.stopPropagation(); control(j.id, action); } }, action)));
      return el("tr", { class: `clickable${j.id === state.jobId ? " selected" : ""}`, dataset: { job: j.id, status: j.status },
                        onclick: () => { selectJob(j.id); renderJobs(); refreshMetrics().catch(report); } },
        el("td", { title: j.id }, j.name ? `${j.name} · ${shortId(j.id)}` : shortId(j.id)),
        el("td", { title: j.error || "" }, badge(j.status)),
        el("td", {}, j.spec.algorithm || ""),
        el("td", { class: "num" }, j.step),
        el("td", { class: "num" }, j.policy_version),
        el("td", { class: "num", title: "stale / zero-variance" }, `${j.dropped_stale} / ${j.dropped_zero_variance}`),
        el("td", { class: "num" }, j.restarts),
        el("td", {}, ago(j.created_at)),
        el("td", {}, controls));
    }));
  }

  async function control(jobId, action) {
    if (action === "cancel" && !window.confirm(`Cancel job ${jobId}? It cannot be resumed.`)) return;
    try {
      await api(`/jobs/${encodeURIComponent(jobId)}/${action}`, { method: "POST" });
      setStatus(`${action}: ${jobId}`);
    } catch (e) {
      report(e);
    }
    await refreshJobs().catch(report);
  }

  function selectJob(jobId) {
    if (jobId === state.jobId) return;
    state.jobId = jobId;
    state.metrics = [];
    state.evals = [];
    $("#chart-job").textContent = jobId || "";
  }

  // ------------------------------------------------------------------ charts
  async function refreshMetrics() {
    const jobId = state.jobId;
    if (!jobId) return drawCharts();
    const since = state.metrics.length ? state.metrics.at(-1).step : 0;
    const [rows, evals] = await Promise.all([
      api(`/jobs/${encodeURIComponent(jobId)}/metrics?since_step=${since}`),
      api(`/jobs/${encodeURIComponent(jobId)}/evals`).then((r) => r.data).catch(() => []),
    ]);
    if (jobId !== state.jobId) return;  // the selection changed while we waited
    state.metrics.push(...rows);
    state.evals = evals;
    drawCharts();
  }

  // [xs, ...ys] for a chart, and the labels of the series that have data.
  function chartData(def) {
    if (def.evals) {
      const names = [...new Set(state.evals.map((e) => e.name))];
      const steps = [...new Set(state.evals.map((e) => e.step))].sort((a, b) => a - b);
      const ys = names.map((n) => steps.map((s) => {
        const hit = state.evals.filter((e) => e.name === n && e.step === s).at(-1);
        return hit ? hit.success_rate : null;
      }));
      return { labels: names, data: [steps, ...ys] };
    }
    const xs = state.metrics.map((m) => m.step);
    const labels = [], ys = [];
    for (const [key, label] of def.series) {
      if (labels.includes(label) || !state.metrics.some((m) => key in m.metrics)) continue;
      labels.push(label);
      ys.push(state.metrics.map((m) => (key in m.metrics ? m.metrics[key] : null)));
    }
    return { labels, data: [xs, ...ys] };
  }

  function drawCharts() {
    const box = $("#charts");
    let shown = 0;
    for (const def of CHARTS) {
      const { labels, data } = chartData(def);
      const points = labels.length ? data[0].filter((_, i) => data.slice(1).some((y) => y[i] !== null)).length : 0;
      state.points[def.id] = points;
      let chart = state.charts[def.id];
      if (!points) {  // nothing to draw: no empty axes on the page
        if (chart) { chart.plot.destroy(); chart.el.remove(); delete state.charts[def.id]; }
        continue;
      }
      shown += 1;
      if (!chart || chart.labels.join("|") !== labels.join("|")) {
        if (chart) { chart.plot.destroy(); chart.el.remove(); }
        chart = makeChart(def, labels, box);
        state.charts[def.id] = chart;
      }
      chart.plot.setData(data);
      chart.el.dataset.points = String(points);
    }
    $("#charts-note").textContent = shown ? "" : (state.jobId ? "no metrics yet (the first step is on its way)" : "no job selected");
  }

  function makeChart(def, labels, box) {
    const holder = el("div", { class: "chart", dataset: { chart: def.id, points: "0" } }, el("h3", {}, def.title));
    const before = CHARTS.slice(CHARTS.indexOf(def) + 1).map((d) => state.charts[d.id]).find(Boolean);
    box.insertBefore(holder, before ? before.el : null);  // keep the order of CHARTS
    const opts = {
      width: chartWidth(holder), height: 170,
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [{ label: "step", size: 36, incrs: STEP_INCRS }, { size: 56 }],
      series: [{ label: "step" }, ...labels.map((label, i) => ({
        label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { size: 4 },
      }))],
    };
    const plot = new uPlot(opts, [[], ...labels.map(() => [])], holder);
    return { plot, labels, el: holder };
  }

  // A flat series (a KL of 0 throughout) gets a small band around its value, not uPlot's 0..100.
  function yRange(_u, min, max) {
    if (min === null || max === null) return [0, 1];
    if (min === max) { const pad = Math.abs(min) * 0.1 || 1; return [min - pad, max + pad]; }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  const chartWidth = (holder) => Math.max(280, holder.clientWidth || 340);
  window.addEventListener("resize", () => {
    for (const c of Object.values(state.charts)) c.plot.setSize({ width: chartWidth(c.el), height: 170 });
  });

  // ------------------------------------------------------------------ engines
  async function refreshEngines() {
    const v = await api("/dashboard/api/engines");
    state.engines = v;
    $("#router").textContent = v.router_reachable ? `router ${v.router_url}`
      : `router ${v.router_url} unreachable (${v.router_error || "?"})`;
    $("#router").classList.toggle("error", !v.router_reachable);
    $("#engines tbody").replaceChildren(...v.engines.map((e) => el("tr", { dataset: { engine: e.url, healthy: String(e.healthy) } },
      el("td", { title: e.error || "" }, e.url),
      el("td", {}, e.healthy ? badge("ok", "ok") : badge(e.error || "down", "bad")),
      el("td", { title: e.router_load === null ? "" : `router load ${e.router_load}` },
        e.router_healthy === null ? "—" : (e.router_healthy ? badge("healthy", "ok") : badge("unhealthy", "bad"))),
      el("td", { class: "num" }, e.running_reqs ?? "—"),
      el("td", { class: "num" }, e.waiting_reqs ?? "—"),
      el("td", { class: "num" }, e.weight_version ?? "—"))));
  }

  // ------------------------------------------------------------------ sessions and token view
  async function refreshSessions() {
    state.sessions = (await api("/dashboard/api/sessions?limit=15")).data;
    $("#sessions tbody").replaceChildren(...state.sessions.map((s) => el("tr", {
      class: `clickable${state.tokenView && state.tokenView.sessionId === s.id ? " selected" : ""}`,
      dataset: { session: s.id }, onclick: () => showTokens(s.id).catch(report),
    },
      el("td", { title: s.id }, shortId(s.id)),
      el("td", {}, badge(s.status)),
      el("td", { class: "num" }, s.num_trajectories),
      el("td", { class: "num" }, s.num_tokens),
      el("td", { class: "num" }, fmt(s.reward)),
      el("td", {}, ago(s.updated_at)))));
  }

  async function showTokens(sessionId) {
    const sid = encodeURIComponent(sessionId);
    const [trajectories, tools] = await Promise.all([
      api(`/v1/sessions/${sid}/trajectory`), api(`/dashboard/api/sessions/${sid}/tools`)]);
    const callsOf = new Map(tools.map((t) => [t.trajectory_id, t.turns.map((turn) => turn.tool_calls)]));
    let budget = MAX_TOKENS_SHOWN;  // over all trajectories of the session
    const shown = trajectories.map((t) => { const n = Math.min(t.tokens.length, budget); budget -= n; return n; });
    const ids = trajectories.flatMap((t, i) => t.tokens.slice(0, shown[i]));
    const pieces = ids.length ? (await api("/dashboard/api/detokenize", { method: "POST", body: { ids } })).pieces : [];
    let offset = 0;
    const view = $("#token-view");
    view.replaceChildren(...trajectories.map((t, i) => {
      const node = renderTrajectory(t, pieces.slice(offset, offset + shown[i]), callsOf.get(t.id) || []);
      offset += shown[i];
      return node;
    }));
    $("#token-session").textContent = sessionId;
    state.tokenView = {
      sessionId, trajectories: trajectories.length,
      tokens: view.querySelectorAll(".tok").length, generated: view.querySelectorAll(".tok.gen").length,
    };
    for (const row of document.querySelectorAll("#sessions tbody tr")) {
      row.classList.toggle("selected", row.dataset.session === sessionId);
    }
  }

  // Markers at each turn: what the turn added before generating (the prompt, tool results, a user
  // message), then what it generated (and the tools it called). Loss-mask-1 tokens are highlighted.
  function renderTrajectory(t, pieces, calls) {
    const starts = new Map();
    t.turns.forEach((turn, i) => {
      const called = calls[i] || [];
      const afterCall = i > 0 && (calls[i - 1] || []).length > 0;
      const contextKind = i === 0 ? "prompt" : (afterCall ? "tool result" : "user / context");
      if (turn.output_start > turn.prompt_start) {
        starts.set(turn.prompt_start, el("span", { class: `marker${afterCall ? " tool" : ""}` }, `turn ${i} · ${contextKind}`));
      }
      const names = called.map((c) => c.name).join(", ");
      starts.set(turn.output_start, el("span", { class: `marker ${called.length ? "tool" : "gen"}`,
                                                 title: called.map((c) => `${c.name}(${c.arguments})`).join("\n") },
        `turn ${i} · generated${called.length ? ` · tool call: ${names}` : ""}${turn.finish_reason ? ` (${turn.finish_reason})` : ""}`));
    });
    const tokens = el("div", { class: "tokens" });
    const frag = document.createDocumentFragment();
    pieces.forEach((piece, i) => {
      if (starts.has(i)) frag.append(starts.get(i));
      const gen = t.loss_mask[i] === 1;
      const tip = `#${i} id ${t.tokens[i]}` + (gen ? ` · logprob ${fmt(t.rollout_logprobs[i], 4)} · v${t.weight_versions[i]}` : "");
      frag.append(el("span", { class: gen ? "tok gen" : "tok", title: tip }, piece));
    });
    tokens.append(frag);
    const generated = t.loss_mask.reduce((a, b) => a + b, 0);
    const meta = el("div", { class: "meta" },
      `trajectory ${t.id} · segment ${t.segment}/${t.branch} · ${t.status} · ${t.turns.length} turn(s) · `,
      `${t.tokens.length} tokens, ${generated} generated · reward `, el("b", { class: "reward" }, fmt(t.reward)),
      pieces.length < t.tokens.length ? ` · first ${pieces.length} tokens shown` : "");
    return el("div", { class: "trajectory", dataset: { trajectory: t.id } }, meta, tokens);
  }

  // ------------------------------------------------------------------ polling
  function report(e) {
    state.lastError = e.message;
    const hint = e.status === 401 || e.status === 403 ? " — enter the admin key above" : "";
    setStatus(`${e.message}${hint}`, true);
  }

  async function tick() {
    const results = await Promise.allSettled([refreshJobs(), refreshEngines(), refreshSessions()]);
    results.push(...await Promise.allSettled([refreshMetrics()]));
    const failed = results.find((r) => r.status === "rejected");
    if (failed) report(failed.reason);
    else { state.lastError = null; setStatus(`updated ${new Date().toLocaleTimeString()}`); }
    setTimeout(tick, POLL_MS);
  }

  function init() {
    const params = new URLSearchParams(location.search);
    if (params.has("key")) {
      localStorage.setItem(KEY_STORAGE, params.get("key"));
      params.delete("key");  // keep the key out of the address bar and the history
      history.replaceState(null, "", location.pathname + (params.size ? `?${params}` : ""));
    }
    state.key = localStorage.getItem(KEY_STORAGE);
    $("#key").value = state.key || "";
    $("#key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      state.key = $("#key").value.trim() || null;
      if (state.key) localStorage.setItem(KEY_STORAGE, state.key);
      else localStorage.removeItem(KEY_STORAGE);
      setStatus("key saved");
    });
    tick();
  }

  init();
})();
