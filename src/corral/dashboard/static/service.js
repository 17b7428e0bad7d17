// One service: its numbers, its replicas, its rollout, charts, its events and its logs.
import { Chart } from "./chart.js";
import { act, confirmAction, fmt, h, setAttr, setText, tone } from "./dom.js";
import { LogPane } from "./replica.js";
import { ReplicaTable, llmCells } from "./replicas.js";
import { decisionText, endpointLink, servingText } from "./services.js";

const LIVE = new Set(["PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY"]);
const KEEP = 6 * 3600;
const RANGES = [[300, "5 min"], [900, "15 min"], [3600, "1 h"], [KEEP, "6 h"]];
const USAGE_SECONDS = 2000;
const LLM_FACTS = [["ttft", "TTFT p50 / p99"], ["waiting", "Queue (engines)"], ["running", "Running"],
  ["hit", "Cache hit rate"], ["tps", "Tokens/s"], ["held", "Held in balancer"]];

// The data's own span (20 s at least, in whole minutes past two): a new service's points fill
// its charts instead of a spike against "now".
export function fitRange(points, now) {
  const span = points.length ? now - points[0].t : 0;
  if (span <= 20) return 20;
  return Math.min(KEEP, span <= 120 ? Math.ceil(span / 10) * 10 : Math.ceil(span / 60) * 60);
}

export function spanText(seconds) {
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${+(seconds / 3600).toFixed(1)} h`;
}

// Live replicas by version, oldest first: more than one means an update or rollback runs.
export function rollout(service) {
  const byVersion = new Map();
  for (const r of service.replicas) {
    if (!LIVE.has(r.status)) continue;
    if (!byVersion.has(r.version)) byVersion.set(r.version, { version: r.version, ready: 0, starting: 0 });
    byVersion.get(r.version)[r.status === "READY" ? "ready" : "starting"] += 1;
  }
  const versions = [...byVersion.values()].sort((a, b) => a.version - b.version);
  const current = versions.find((v) => v.version === service.version);
  const inProgress = versions.length > 1 || (current && current.ready < (service.target ?? 0) &&
    versions.some((v) => v.version !== service.version));
  return { versions, inProgress };
}

export class ServiceView {
  constructor(name) {
    this.name = name;
    this.title = name;
    this.crumbs = [["Services", "/ui/"], [name, null]];
    this.points = [];
    this.chartsAt = 0;
    this.range = null; // null: fit the data's own span
    this.eventsKey = "";
    this.badge = h("span", { class: "badge", id: "service-status" });
    this.failure = h("p", { class: "notice bad", role: "alert", hidden: true });
    this.facts = {};
    const dl = h("dl", { class: "facts" });
    for (const [key, label] of [
      ["endpoint", "Endpoint"], ["version", "Current version"], ["serving", "Serving version"],
      ["ready", "Ready / target"], ["qps", "QPS (last 10 s)"], ["p50", "p50 (10 s)"], ["p99", "p99 (10 s)"],
      ["errors", "5xx rate (10 s)"], ["requests", "Requests"], ["decision", "Autoscaler"],
    ]) {
      this.facts[key] = h("dd", { id: `fact-${key}` });
      dl.append(h("div", { class: `fact-${key}` }, h("dt", { text: label }), this.facts[key]));
    }
    this.llm = h("section", { class: "llm", "aria-labelledby": "llm-title", hidden: true },
      h("h2", { id: "llm-title", text: "Engines (LLM)" }), this.makeLlmFacts());
    this.rollout = h("section", { class: "rollout", "aria-label": "Update in progress", hidden: true });
    this.replicas = new ReplicaTable(name, (r) => this.replace(r));
    this.rangeButtons = h("div", { class: "ranges", role: "group", "aria-label": "Time range" },
      ...[[null, "Fit"], ...RANGES].map(([seconds, label]) => {
        const button = h("button", { type: "button", class: "quiet small", "data-range": seconds ?? "fit", text: label });
        button.addEventListener("click", () => { this.range = seconds; this.drawCharts(this.now); });
        return button;
      }));
    this.charts = [
      new Chart("Requests per second", (v) => fmt.qps(v)),
      new Chart("Latency", (v) => fmt.ms(v)),
      new Chart("Replicas", (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)), 1),
    ];
    this.chartBox = h("div", { class: "charts" }, ...this.charts.map((c) => c.el));
    // An LLM service's signals over time (shown with its "Engines (LLM)" figures): time to
    // first token and hit rate over each 5 s, the queue and tokens/s at each sample.
    this.llmCharts = [
      new Chart("Time to first token", (v) => fmt.ms(v)),
      new Chart("Queue", (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)), 1),
      new Chart("Tokens per second", (v) => fmt.qps(v)),
      new Chart("Prefix-cache hit rate", (v) => fmt.pct(v), 1),
    ];
    this.llmChartBox = h("div", { class: "charts llm-charts", hidden: true }, ...this.llmCharts.map((c) => c.el));
    this.events = h("ol", { class: "events" });
    this.actions = this.makeActions();
    this.logs = this.makeLogs();
    this.el = h("section", { "aria-labelledby": "service-title" },
      h("div", { class: "title-row" }, h("h1", { id: "service-title", text: name }), this.badge),
      this.failure, dl, this.llm, this.rollout, this.actions,
      h("h2", { text: "Replicas" }), this.replicas.el,
      h("div", { class: "title-row" }, h("h2", { id: "charts-title", text: "Traffic" }), this.rangeButtons),
      this.chartBox, this.llmChartBox,
      h("h2", { text: "Events" }), this.events,
      this.logs);
    this.loadHistory();
    this.readUsage();
    this.usageTimer = setInterval(() => this.readUsage(), USAGE_SECONDS);
  }

  close() {
    clearInterval(this.usageTimer);
    for (const pane of Object.values(this.panes)) pane.close();
    this.panes = {};
  }

  makeLlmFacts() {
    this.llmFacts = {};
    const dl = h("dl", { class: "facts" });
    for (const [key, label] of LLM_FACTS) {
      this.llmFacts[key] = h("dd", { id: `llm-${key}` });
      dl.append(h("div", {}, h("dt", { text: label }), this.llmFacts[key]));
    }
    return dl;
  }

  makeLogs() {
    this.panes = {};
    this.logBox = h("div", { class: "logs" });
    const tabs = h("div", { class: "ranges", role: "group", "aria-label": "Which log" });
    const show = (kind, title) => {
      for (const button of tabs.children) setAttr(button, "aria-pressed", button.dataset.kind === kind ? "true" : "false");
      if (!this.panes[kind]) this.panes[kind] = new LogPane(`/ui/api/services/${this.name}/log?kind=${kind}`, title, `log-${kind}`);
      this.logBox.replaceChildren(this.panes[kind].el);
    };
    for (const [kind, title] of [["controller", "Controller log"], ["load_balancer", "Load balancer log"]]) {
      const button = h("button", { type: "button", class: "quiet small", "data-kind": kind, text: title });
      button.addEventListener("click", () => show(kind, title));
      tabs.append(button);
    }
    show("controller", "Controller log");
    return h("section", { class: "service-logs", "aria-labelledby": "logs-title" },
      h("div", { class: "title-row" }, h("h2", { id: "logs-title", text: "Logs" }), tabs), this.logBox);
  }

  async loadHistory() {
    try {
      const answer = await fetch(`/ui/api/services/${this.name}/history`, { credentials: "same-origin" });
      if (!answer.ok) return;
      const data = await answer.json();
      const known = new Set(this.points.map((p) => p.t));
      this.points = [...data.points.filter((p) => !known.has(p.t)), ...this.points].sort((a, b) => a.t - b.t);
      if (this.service) this.drawCharts(this.now);
    } catch (_) {
      /* the stream keeps the charts going from now on */
    }
  }

  async readUsage() {
    if (this.now && !this.service) return; // not in the last state: gone, or never was
    try {
      const answer = await fetch(`/ui/api/services/${this.name}/resources`, { credentials: "same-origin" });
      if (answer.ok) this.replicas.setUsage((await answer.json()).replicas);
    } catch (_) {
      /* the next reading */
    }
  }

  makeActions() {
    this.scaleInput = h("input", { id: "scale-count", type: "number", min: 0, max: 10000, step: 1, inputmode: "numeric" });
    this.scaleBox = h("form", { class: "action", id: "scale-form" },
      h("label", { for: "scale-count", text: "Replicas" }), this.scaleInput,
      h("button", { type: "submit", id: "scale-button", text: "Scale" }));
    this.scaleBox.addEventListener("submit", (event) => { event.preventDefault(); this.scale(); });
    this.scaleNote = h("p", { class: "hint", hidden: true });
    this.versionSelect = h("select", { id: "rollback-version" });
    this.rollbackBox = h("form", { class: "action", id: "rollback-form" },
      h("label", { for: "rollback-version", text: "Roll back to" }), this.versionSelect,
      h("button", { type: "submit", id: "rollback-button", text: "Roll back" }));
    this.rollbackBox.addEventListener("submit", (event) => { event.preventDefault(); this.rollback(); });
    this.downButton = h("button", { type: "button", class: "danger", id: "down-button", text: "Take down…" });
    this.downButton.addEventListener("click", () => this.down());
    this.result = h("p", { class: "result", role: "status", "aria-live": "polite", id: "action-result" });
    return h("section", { class: "actions", "aria-label": "Actions" },
      this.scaleBox, this.scaleNote, this.rollbackBox, h("div", { class: "action" }, this.downButton), this.result);
  }

  async run(title, text, ok, path, body, done) {
    if (!(await confirmAction(title, text, ok))) return;
    this.result.className = "result";
    this.result.textContent = "Sending…";
    try {
      const service = await act(path, body);
      this.result.className = "result ok";
      this.result.textContent = done(service);
    } catch (error) {
      this.result.className = "result bad";
      this.result.textContent = error.message;
    }
  }

  scale() {
    const count = Number(this.scaleInput.value);
    if (!Number.isInteger(count) || count < 0) {
      this.result.className = "result bad";
      this.result.textContent = "Replicas must be a whole number, 0 or more.";
      return;
    }
    this.run(`Scale ${this.name}?`, `${this.name} will run ${count} replica(s). This stores a new version of its spec with only the count changed; running replicas are kept.`,
      `Scale to ${count}`, `/ui/api/services/${this.name}/scale`, { replicas: count },
      (s) => `Version ${s.version} stored: scaling to ${count}.`);
  }

  rollback() {
    const version = Number(this.versionSelect.value);
    if (!version) return;
    this.run(`Roll ${this.name} back?`, `Version ${version}'s spec is deployed again as a new version (rolling: old replicas serve until new ones are READY).`,
      `Roll back to v${version}`, `/ui/api/services/${this.name}/rollback`, { version },
      (s) => `Version ${s.version} (the spec of v${version}) is rolling out.`);
  }

  down() {
    this.run(`Take ${this.name} down?`, `Every replica of ${this.name} is drained and stopped, its endpoint closes and the service is forgotten. This cannot be undone from here.`,
      "Take down", `/ui/api/services/${this.name}/down`, {},
      () => {
        // Its replicas' usage is not read again: once it is gone the read is a 404, and the
        // stream that says it is gone can come after a read has gone out.
        clearInterval(this.usageTimer);
        return `${this.name} is shutting down.`;
      });
  }

  update(state) {
    const service = state.services.find((one) => one.name === this.name);
    this.now = state.t;
    if (!service) {
      // Gone (taken down): nothing of it to ask the daemon for any more.
      if (this.service) this.close();
      this.service = null;
      this.failure.hidden = false;
      this.failure.textContent = `There is no service named ${this.name} (any more).`;
      this.actions.hidden = true;
      return;
    }
    this.service = service;
    this.actions.hidden = false;
    setText(this.badge, service.status);
    setAttr(this.badge, "class", `badge ${tone(service.status)}`);
    const problems = [service.failure, ...(service.balancer_errors || [])].filter(Boolean);
    this.failure.hidden = problems.length === 0;
    setText(this.failure, problems.join(" · "));
    const live = service.live || {};
    const f = this.facts;
    endpointLink(f.endpoint, service.endpoint);
    setText(f.version, `v${service.version}`);
    setText(f.serving, servingText(service));
    setText(f.ready, `${service.ready} / ${service.target ?? "—"}`);
    setText(f.qps, fmt.qps(live.qps));
    setText(f.p50, fmt.ms(live.p50));
    setText(f.p99, fmt.ms(live.p99));
    setText(f.errors, fmt.pct(live.error_rate));
    setText(f.requests, fmt.count(live.answered_total ?? 0));
    setText(f.decision, decisionText(service, state.qps_window));
    this.replicas.sync(service.replicas);
    this.showLlm(service.llm, service.replicas);
    this.showRollout(service);
    this.showActions(service);
    this.showEvents(service.events || []);
    const point = service.point;
    const last = this.points[this.points.length - 1];
    if (point && (!last || point.t > last.t)) this.points.push(point);
    this.points = this.points.filter((p) => p.t >= state.t - KEEP);
    if (state.t - this.chartsAt >= 5) this.drawCharts(state.t);
  }

  showRollout(service) {
    const { versions, inProgress } = rollout(service);
    this.rollout.hidden = !inProgress;
    if (!inProgress) return;
    const parts = versions.map((v) => h("li", { class: v.version === service.version ? "new" : "old" },
      h("strong", { text: `v${v.version} ${v.version === service.version ? "(new)" : "(old)"}` }),
      `: ${v.ready} ready`, v.starting ? `, ${v.starting} starting` : ""));
    const held = service.traffic_held_for_version;
    this.rollout.replaceChildren(
      h("h2", { text: "Update in progress" }),
      h("ol", { class: "versions" }, ...parts),
      h("p", { class: "hint", text: held ? `Traffic stays on the old version until v${held} has enough ready replicas (blue-green).`
        : `Target ${service.target ?? "—"} replicas of v${service.version}; old replicas leave as new ones become ready.` }));
  }

  showActions(service) {
    const policy = service.policy || {};
    const autoscaled = policy.target_qps_per_replica !== null && policy.target_qps_per_replica !== undefined &&
      policy.max_replicas > policy.min_replicas;
    this.scaleBox.hidden = autoscaled;
    this.scaleNote.hidden = !autoscaled;
    if (autoscaled) this.scaleNote.textContent = `Autoscaled between ${policy.min_replicas} and ${policy.max_replicas} replicas: change its replica_policy with corral update.`;
    if (document.activeElement !== this.scaleInput && this.scaleInput.value === "") this.scaleInput.value = policy.min_replicas ?? "";
    const versions = (service.versions || []).map((v) => v.version).filter((v) => v !== service.version).reverse();
    const key = versions.join(",");
    if (this.versionSelect.dataset.key !== key) {
      this.versionSelect.dataset.key = key;
      this.versionSelect.replaceChildren(...versions.map((v) => h("option", { value: v, text: `v${v}` })));
    }
    this.rollbackBox.hidden = versions.length === 0;
  }

  showEvents(events) {
    const key = events.length ? `${events[events.length - 1].id}:${events.length}` : "";
    if (key === this.eventsKey) return;
    this.eventsKey = key;
    this.events.replaceChildren(...[...events].reverse().map((e) => h("li", { class: `event ${/fail|error|hung|bind/.test(e.action) ? "bad" : ""}` },
      h("time", { datetime: new Date(e.ts * 1000).toISOString(), text: fmt.clock(e.ts) }),
      h("span", { class: "action", text: e.action }),
      e.replica_id !== null && e.replica_id !== undefined ? h("span", { class: "replica", text: `#${e.replica_id}` }) : null,
      e.reason ? h("span", { class: "reason", text: e.reason }) : null)));
    if (!events.length) this.events.replaceChildren(h("li", { class: "empty", text: "No events yet." }));
  }

  drawCharts(now) {
    if (!now) return;
    this.chartsAt = now;
    const range = this.range ?? fitRange(this.points, now);
    for (const button of this.rangeButtons.children) {
      const mine = button.dataset.range === String(this.range ?? "fit");
      setAttr(button, "aria-pressed", mine ? "true" : "false");
      if (button.dataset.range === "fit") setText(button, `Fit (${spanText(this.range ? fitRange(this.points, now) : range)})`);
    }
    const t0 = now - range;
    const pts = this.points;
    const [qps, latency, replicas] = this.charts;
    qps.draw([{ label: "QPS", cls: "s1", points: pts.map((p) => [p.t, p.qps]) }], t0, now);
    latency.draw([
      { label: "p50", cls: "s1", points: pts.map((p) => [p.t, p.p50]) },
      { label: "p99", cls: "s2", points: pts.map((p) => [p.t, p.p99]) }], t0, now);
    replicas.draw([
      { label: "ready", cls: "s1", step: true, points: pts.map((p) => [p.t, p.ready]) },
      { label: "target", cls: "s3", step: true, points: pts.map((p) => [p.t, p.target]) }], t0, now);
    if (this.llmChartBox.hidden) return;
    const [ttft, queue, tokens, hits] = this.llmCharts;
    const at = (key) => pts.map((p) => [p.t, p[key] ?? null]);
    ttft.draw([{ label: "p50", cls: "s1", points: at("ttft_p50") }, { label: "p99", cls: "s2", points: at("ttft_p99") }], t0, now);
    queue.draw([
      { label: "waiting", cls: "s1", points: at("waiting") },
      { label: "running", cls: "s2", points: at("running") },
      { label: "held", cls: "s3", points: at("held") }], t0, now);
    tokens.draw([{ label: "tokens/s", cls: "s1", points: at("tps") }], t0, now);
    hits.draw([{ label: "hit rate", cls: "s1", points: at("hit_rate") }], t0, now);
  }

  showLlm(llm, replicas) {
    this.llm.hidden = !llm;
    if (this.llmChartBox.hidden !== !llm) {
      this.llmChartBox.hidden = !llm;
      if (llm) this.drawCharts(this.now);
    }
    if (!llm) return;
    // Tokens/s: the service's own figure, else its replicas' summed; unknown: not shown.
    const rates = replicas.map((r) => r.llm && r.llm.tokens_per_second).filter((v) => typeof v === "number");
    const tps = llm.tokens_per_second ?? (rates.length ? rates.reduce((a, b) => a + b, 0) : undefined);
    const cells = llmCells({ ...llm, tokens_per_second: tps });
    for (const [key] of LLM_FACTS) {
      const text = key === "held" ? `${fmt.count(llm.held ?? 0)}${llm.held_expired ? ` (${fmt.count(llm.held_expired)} expired)` : ""}` : cells[key];
      setText(this.llmFacts[key], text ?? "—");
      this.llmFacts[key].parentElement.hidden = key === "tps" && tps === undefined;
    }
  }

  replace(r) {
    this.run(`Replace replica ${r.id} of ${this.name}?`, `Replica ${r.id} is drained (requests in flight finish) and stopped; the service keeps its target, so a new replica starts in its place.`,
      `Replace replica ${r.id}`, `/ui/api/services/${this.name}/replicas/${r.id}/replace`, {},
      (answer) => answer.message);
  }
}
