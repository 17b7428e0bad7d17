// One service: its numbers, its replicas, its rollout, charts of the last hour, its events.
import { lineChart } from "./chart.js";
import { KeyedRows, act, confirmAction, fmt, h, setAttr, setText, tone } from "./dom.js";
import { decisionText, servingText } from "./services.js";

const LIVE = new Set(["PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY"]);
const HOUR = 3600;

const REPLICA_COLUMNS = [
  ["id", "Replica"], ["status", "Status"], ["version", "Version"], ["age", "Age"],
  ["endpoint", "Endpoint"], ["devices", "Devices"], ["pid", "PID"], ["inflight", "In flight"],
  ["served", "Served"], ["failure", "Failure"],
];

function devicesText(replica) {
  const devices = replica.devices;
  if (devices === null || devices === undefined || devices === "") return "";
  if (Array.isArray(devices)) return devices.join(", ");
  if (typeof devices === "object") return Object.entries(devices).map(([k, v]) => `${k}: ${v}`).join(", ");
  return String(devices);
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
    this.eventsKey = "";
    this.badge = h("span", { class: "badge", id: "service-status" });
    this.failure = h("p", { class: "notice bad", role: "alert", hidden: true });
    this.facts = {};
    const dl = h("dl", { class: "facts" });
    for (const [key, label] of [
      ["endpoint", "Endpoint"], ["version", "Current version"], ["serving", "Serving version"],
      ["ready", "Ready / target"], ["qps", "QPS (10 s)"], ["p50", "p50"], ["p99", "p99"],
      ["errors", "5xx rate"], ["requests", "Requests"], ["decision", "Autoscaler"],
    ]) {
      this.facts[key] = h("dd", { id: `fact-${key}` });
      dl.append(h("div", {}, h("dt", { text: label }), this.facts[key]));
    }
    this.rollout = h("section", { class: "rollout", "aria-label": "Update in progress", hidden: true });
    this.replicaBody = h("tbody");
    this.replicaRows = new KeyedRows(this.replicaBody, (r) => this.makeReplica(r), (row, r) => this.fillReplica(row, r));
    this.charts = h("div", { class: "charts" }, h("p", { class: "empty", text: "Loading the last hour…" }));
    this.events = h("ol", { class: "events" });
    this.actions = this.makeActions();
    this.el = h("section", { "aria-labelledby": "service-title" },
      h("div", { class: "title-row" }, h("h1", { id: "service-title", text: name }), this.badge),
      this.failure, dl, this.rollout, this.actions,
      h("h2", { text: "Replicas" }),
      h("div", { class: "scroll" }, h("table", { class: "grid-table replicas" },
        h("caption", { class: "sr-only", text: `Replicas of ${name}` }),
        h("thead", {}, h("tr", {}, ...REPLICA_COLUMNS.map(([key, label]) => h("th", { scope: "col", class: `c-${key}`, text: label })))),
        this.replicaBody)),
      h("h2", { text: "Last hour" }), this.charts,
      h("h2", { text: "Events" }), this.events);
    this.loadHistory();
  }

  async loadHistory() {
    try {
      const answer = await fetch(`/ui/api/services/${this.name}/history`, { credentials: "same-origin" });
      if (!answer.ok) return;
      const data = await answer.json();
      const known = new Set(this.points.map((p) => p.t));
      this.points = [...data.points.filter((p) => !known.has(p.t)), ...this.points].sort((a, b) => a.t - b.t);
      this.chartsAt = 0;
      if (this.service) this.drawCharts(this.now);
    } catch (_) {
      /* the stream keeps the charts going from now on */
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
      () => `${this.name} is shutting down.`);
  }

  makeReplica(r) {
    const row = h("tr", { "data-replica": r.id });
    row.cells_ = {};
    for (const [key, label] of REPLICA_COLUMNS) {
      const cell = key === "id" ? h("th", { scope: "row", "data-label": label }) : h("td", { "data-label": label });
      cell.className = `c-${key}`;
      row.cells_[key] = cell;
      row.append(cell);
    }
    row.cells_.id.append(h("a", { href: `/ui/services/${this.name}/replicas/${r.id}`, "data-nav": true, text: `#${r.id}` }));
    row.cells_.status.append(h("span", { class: "badge" }));
    return row;
  }

  fillReplica(row, r) {
    const c = row.cells_;
    const look = tone(r.status);
    setAttr(row, "data-status", r.status);
    setAttr(row, "class", `tone-${look}`);
    setText(c.status.firstChild, r.status);
    setAttr(c.status.firstChild, "class", `badge ${look}`);
    setText(c.version, `v${r.version}`);
    setText(c.age, fmt.age(r.age_seconds));
    setText(c.endpoint, r.endpoint || "");
    setText(c.devices, devicesText(r));
    setText(c.pid, r.pid || "");
    setText(c.inflight, r.traffic ? r.traffic.in_flight : "");
    setText(c.served, r.traffic ? fmt.count(r.traffic.served) : "");
    setText(c.failure, r.failure || "");
  }

  update(state) {
    const service = state.services.find((one) => one.name === this.name);
    this.now = state.t;
    if (!service) {
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
    setText(f.endpoint, service.endpoint || "—");
    setText(f.version, `v${service.version}`);
    setText(f.serving, servingText(service));
    setText(f.ready, `${service.ready} / ${service.target ?? "—"}`);
    setText(f.qps, fmt.qps(live.qps));
    setText(f.p50, fmt.ms(live.p50));
    setText(f.p99, fmt.ms(live.p99));
    setText(f.errors, fmt.pct(live.error_rate));
    setText(f.requests, fmt.count(live.answered_total ?? 0));
    setText(f.decision, decisionText(service));
    this.replicaRows.sync(service.replicas, (r) => r.id);
    this.showRollout(service);
    this.showActions(service);
    this.showEvents(service.events || []);
    const point = service.point;
    const last = this.points[this.points.length - 1];
    if (point && (!last || point.t > last.t)) this.points.push(point);
    this.points = this.points.filter((p) => p.t >= state.t - HOUR);
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
    const t0 = now - HOUR;
    const pts = this.points;
    this.charts.replaceChildren(
      lineChart({ title: "Requests per second", t0, t1: now, format: (v) => fmt.qps(v),
        series: [{ label: "QPS", cls: "s1", points: pts.map((p) => [p.t, p.qps]) }] }),
      lineChart({ title: "Latency", t0, t1: now, format: (v) => fmt.ms(v),
        series: [
          { label: "p50", cls: "s1", points: pts.map((p) => [p.t, p.p50]) },
          { label: "p99", cls: "s2", points: pts.map((p) => [p.t, p.p99]) }] }),
      lineChart({ title: "Replicas", t0, t1: now, floor: 1, format: (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)),
        series: [
          { label: "ready", cls: "s1", step: true, points: pts.map((p) => [p.t, p.ready]) },
          { label: "target", cls: "s3", step: true, points: pts.map((p) => [p.t, p.target]) }] }));
  }
}
