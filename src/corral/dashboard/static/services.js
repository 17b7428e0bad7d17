// All services at a glance: one row each, kept across updates.
import { KeyedRows, fmt, h, setAttr, setText, tone } from "./dom.js";

const COLUMNS = [
  ["name", "Service"],
  ["status", "Status"],
  ["endpoint", "Endpoint"],
  ["serving", "Serving version"],
  ["ready", "Ready / target"],
  ["qps", "QPS (10 s)"],
  ["latency", "p50 / p99 (10 s)"],
  ["errors", "5xx (10 s)"],
  ["requests", "Requests"],
  ["decision", "Autoscaler"],
];

// The autoscaler's sentence quotes the QPS over its own window (60 s by default) when it last
// decided, not the 10 s of the QPS column: said so, so two different numbers never look alike.
export function decisionText(service, window) {
  const scaler = service.autoscaler;
  if (!scaler) return "no decision yet";
  const over = `${window ? `${+window.toFixed(1)} s` : "its"} window, as of its last decision`;
  return scaler.reason.replace(/\bQPS ([0-9][0-9.]*)/, `QPS $1 (${over})`);
}

// The endpoint as a link that opens in a new tab (or a dash without one).
export function endpointLink(cell, url) {
  const link = cell.firstElementChild;
  if (!url) return setText(cell, "—");
  if (link && link.getAttribute("href") === url) return;
  cell.replaceChildren(h("a", { href: url, target: "_blank", rel: "noopener noreferrer", text: url }));
}

export function servingText(service) {
  const versions = service.serving_versions || [];
  return versions.length ? versions.map((v) => `v${v}`).join(" + ") : "none";
}

export class ServicesView {
  constructor() {
    this.title = "Services";
    this.crumbs = [["Services", null]];
    this.body = h("tbody");
    this.empty = h("p", { class: "empty", hidden: true },
      "No services yet. Start one with ", h("code", { text: "corral up svc.yaml" }), ".");
    this.rows = new KeyedRows(this.body, (service) => this.makeRow(service), (row, service) => this.fill(row, service));
    this.el = h("section", { "aria-labelledby": "services-title" },
      h("h1", { id: "services-title", text: "Services" }),
      this.empty,
      h("div", { class: "scroll" },
        h("table", { class: "grid-table services" },
          h("caption", { class: "sr-only", text: "Services, their status and traffic over the last 10 seconds" }),
          h("thead", {}, h("tr", {}, ...COLUMNS.map(([key, label]) => h("th", { scope: "col", class: `c-${key}`, text: label })))),
          this.body)));
  }

  makeRow(service) {
    const row = h("tr", { "data-service": service.name });
    row.cells_ = {};
    for (const [key, label] of COLUMNS) {
      const cell = key === "name" ? h("th", { scope: "row", "data-label": label }) : h("td", { "data-label": label });
      cell.className = `c-${key}`;
      row.cells_[key] = cell;
      row.append(cell);
    }
    row.cells_.name.append(h("a", { href: `/ui/services/${service.name}`, "data-nav": true, text: service.name }));
    row.cells_.status.append(h("span", { class: "badge" }));
    return row;
  }

  fill(row, service) {
    const c = row.cells_;
    const live = service.live || {};
    const statusBadge = c.status.firstChild;
    setText(statusBadge, service.status);
    setAttr(statusBadge, "class", `badge ${tone(service.status)}`);
    setAttr(row, "data-status", service.status);
    endpointLink(c.endpoint, service.endpoint);
    setText(c.serving, servingText(service));
    setText(c.ready, `${service.ready} / ${service.target ?? "—"}`);
    setText(c.qps, fmt.qps(live.qps));
    setText(c.latency, `${fmt.ms(live.p50)} / ${fmt.ms(live.p99)}`);
    setText(c.errors, fmt.pct(live.error_rate));
    setText(c.requests, fmt.count(live.answered_total ?? 0));
    setText(c.decision, decisionText(service, this.qpsWindow));
  }

  update(state) {
    this.qpsWindow = state.qps_window;
    this.empty.hidden = state.services.length > 0;
    this.rows.sync(state.services, (service) => service.name);
  }
}
