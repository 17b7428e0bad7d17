// A service's replicas: one row each (kept across updates), their CPU and memory read on
// demand, their engine figures when they are LLM servers, and a button to replace one.
import { KeyedRows, fmt, h, setAttr, setText, tone } from "./dom.js";

export const LLM_COLUMNS = [
  ["ttft", "TTFT p50 / p99"], ["waiting", "Queue"], ["running", "Running"],
  ["kv", "KV cache"], ["hit", "Cache hit rate"], ["tps", "Tokens/s"],
];

const COLUMNS = [
  ["id", "Replica"], ["status", "Status"], ["version", "Version"], ["age", "Age"],
  ["endpoint", "Endpoint"], ["cpu", "CPU"], ["memory", "Memory"], ["devices", "Devices"],
  ["pid", "PID"], ["inflight", "In flight"], ["served", "Served"], ...LLM_COLUMNS,
  ["failure", "Failure"], ["do", "Actions"],
];
const LLM_KEYS = new Set(LLM_COLUMNS.map(([key]) => key));
const REPLACEABLE = new Set(["PENDING", "PROVISIONING", "STARTING", "READY", "NOT_READY"]);

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)} ${units[i]}`;
}

// What a replica holds on this machine (the daemon's claim), in words.
export function devicesText(devices) {
  if (!devices) return "";
  if (typeof devices !== "object") return String(devices);
  if (Array.isArray(devices)) return devices.join(", ");
  const parts = (devices.gpus || []).map((g) =>
    `GPU ${g.index ?? g.uuid ?? "?"}${g.name ? ` (${g.name})` : ""}${g.share && g.share < 1 ? ` ×${g.share}` : ""}`);
  if (devices.cpus) parts.push(`${devices.cpus} CPU${devices.cpus === 1 ? "" : "s"}`);
  if (devices.memory) parts.push(`${devices.memory} memory`);
  return parts.join(", ");
}

export function llmCells(llm) {
  if (!llm) return {};
  const value = (v, f) => (v === null || v === undefined ? "—" : f(v));
  return {
    ttft: `${fmt.ms(llm.ttft_p50_seconds)} / ${fmt.ms(llm.ttft_p99_seconds)}`,
    waiting: value(llm.waiting ?? llm.queue, (v) => fmt.count(v)),
    running: value(llm.running, (v) => fmt.count(v)),
    kv: value(llm.kv_cache_usage, fmt.pct),
    hit: value(llm.prefix_hit_rate, fmt.pct),
    tps: value(llm.tokens_per_second, (v) => fmt.qps(v)),
  };
}

export class ReplicaTable {
  constructor(service, onReplace) {
    this.service = service;
    this.onReplace = onReplace;
    this.usage = {};
    this.body = h("tbody");
    this.rows = new KeyedRows(this.body, (r) => this.make(r), (row, r) => this.fill(row, r));
    this.table = h("table", { class: "grid-table replicas no-llm" },
      h("caption", { class: "sr-only", text: `Replicas of ${service}` }),
      h("thead", {}, h("tr", {}, ...COLUMNS.map(([key, label]) => h("th", { scope: "col", class: `c-${key}`, text: label })))),
      this.body);
    this.el = h("div", { class: "scroll" }, this.table);
  }

  make(r) {
    const row = h("tr", { "data-replica": r.id });
    row.cells_ = {};
    for (const [key, label] of COLUMNS) {
      const cell = key === "id" ? h("th", { scope: "row", "data-label": label }) : h("td", { "data-label": label });
      cell.className = `c-${key}`;
      row.cells_[key] = cell;
      row.append(cell);
    }
    row.cells_.id.append(h("a", { href: `/ui/services/${this.service}/replicas/${r.id}`, "data-nav": true, text: `#${r.id}` }));
    row.cells_.status.append(h("span", { class: "badge" }));
    row.link_ = h("a", { target: "_blank", rel: "noopener noreferrer" });
    row.replace_ = h("button", { type: "button", class: "quiet small", text: "Replace…", "aria-label": `Replace replica ${r.id}` });
    row.replace_.addEventListener("click", () => this.onReplace(row.replica_));
    row.cells_.do.append(row.replace_);
    return row;
  }

  fill(row, r) {
    const c = row.cells_;
    const look = tone(r.status);
    row.replica_ = r;
    setAttr(row, "data-status", r.status);
    setAttr(row, "class", `tone-${look}`);
    setText(c.status.firstChild, r.status);
    setAttr(c.status.firstChild, "class", `badge ${look}`);
    setText(c.version, `v${r.version}`);
    setText(c.age, fmt.age(r.age_seconds));
    if (r.endpoint) {
      setAttr(row.link_, "href", r.endpoint);
      setText(row.link_, r.endpoint);
      if (!row.link_.isConnected) c.endpoint.replaceChildren(row.link_);
    } else if (c.endpoint.firstChild) c.endpoint.replaceChildren();
    const used = this.usage[String(r.id)];
    const local = r.pid && REPLACEABLE.has(r.status);
    setText(c.cpu, !local ? "" : used && used.cpu_percent !== null ? `${used.cpu_percent.toFixed(1)}%` : "…");
    setText(c.memory, !local ? "" : used ? bytes(used.rss_bytes) : "…");
    setText(c.devices, devicesText(r.devices));
    setText(c.pid, r.pid || "");
    setText(c.inflight, r.traffic ? fmt.count(r.traffic.in_flight) : "");
    setText(c.served, r.traffic ? fmt.count(r.traffic.served) : "");
    const llm = llmCells(r.llm);
    for (const key of LLM_KEYS) setText(c[key], llm[key] || "");
    setText(c.failure, r.failure || "");
    row.replace_.hidden = !REPLACEABLE.has(r.status);
  }

  sync(replicas) {
    this.replicas = replicas;
    // Columns nobody has a value for take no room (the table stays within narrow windows).
    const none = (has) => !replicas.some(has);
    this.table.classList.toggle("no-llm", none((r) => r.llm));
    this.table.classList.toggle("no-tps", none((r) => r.llm && r.llm.tokens_per_second != null));
    this.table.classList.toggle("no-devices", none((r) => devicesText(r.devices)));
    this.table.classList.toggle("no-failure", none((r) => r.failure));
    this.rows.sync(replicas, (r) => r.id);
  }

  setUsage(usage) {
    this.usage = usage || {};
    if (this.replicas) this.rows.sync(this.replicas, (r) => r.id);
  }
}
