// One replica: its facts, and its output and launch log followed live, with a search box.
import { badge, fmt, h, setText } from "./dom.js";

const MAX_LINES = 5000;

// One followed log: lines kept (bounded), drawn into a <pre>, filtered by the search text.
export class LogPane {
  constructor(url, title, id) {
    this.url = url;
    this.lines = [];
    this.partial = "";
    this.query = "";
    this.follow = true;
    this.pre = h("pre", { class: "log", id, tabindex: "0", "aria-label": title });
    this.count = h("span", { class: "count", "aria-live": "polite" });
    this.el = h("section", { class: "log-pane" }, h("h2", {}, title, " ", this.count), this.pre);
    this.source = new EventSource(url);
    this.source.addEventListener("log", (event) => this.add(JSON.parse(event.data)));
    this.source.addEventListener("rotated", () => this.add("\n[log rotated: following the new file]\n"));
  }

  add(text) {
    if (!text) return;
    const parts = (this.partial + text).split("\n");
    this.partial = parts.pop();
    if (!parts.length) return this.redrawTail();
    const start = this.lines.length;
    this.lines.push(...parts);
    if (this.lines.length > MAX_LINES + 500) {
      this.lines = this.lines.slice(-MAX_LINES);
      return this.redraw();
    }
    this.append(this.lines.slice(start));
  }

  matches(line) {
    return !this.query || line.toLowerCase().includes(this.query);
  }

  lineNode(line) {
    if (!this.query) return document.createTextNode(`${line}\n`);
    const span = h("span", { class: "hit" });
    const lower = line.toLowerCase();
    let at = 0;
    for (let i = lower.indexOf(this.query); i >= 0; i = lower.indexOf(this.query, at)) {
      span.append(line.slice(at, i), h("mark", { text: line.slice(i, i + this.query.length) }));
      at = i + this.query.length;
    }
    span.append(`${line.slice(at)}\n`);
    return span;
  }

  append(lines) {
    const tail = this.tailNode;
    const frag = document.createDocumentFragment();
    for (const line of lines) if (this.matches(line)) frag.append(this.lineNode(line));
    if (tail) this.pre.insertBefore(frag, tail);
    else this.pre.append(frag);
    this.redrawTail();
  }

  redrawTail() {
    if (this.tailNode) this.tailNode.remove();
    this.tailNode = null;
    if (this.partial && this.matches(this.partial)) {
      this.tailNode = this.lineNode(this.partial);
      this.pre.append(this.tailNode);
    }
    this.afterDraw();
  }

  redraw() {
    this.pre.replaceChildren();
    this.tailNode = null;
    this.append(this.lines);
  }

  afterDraw() {
    const shown = this.lines.filter((line) => this.matches(line)).length;
    setText(this.count, this.query ? `(${shown} of ${this.lines.length} lines match)` : `(${this.lines.length} lines)`);
    if (this.follow) this.pre.scrollTop = this.pre.scrollHeight;
  }

  search(query) {
    this.query = query.toLowerCase();
    this.redraw();
  }

  close() {
    this.source.close();
  }
}

export class ReplicaView {
  constructor(service, id) {
    this.service = service;
    this.id = id;
    this.title = `${service} · replica ${id}`;
    this.crumbs = [["Services", "/ui/"], [service, `/ui/services/${service}`], [`replica ${id}`, null]];
    const base = `/ui/api/services/${service}/replicas/${id}/log`;
    this.output = new LogPane(`${base}?kind=replica`, "Output", "log-replica");
    this.launch = new LogPane(`${base}?kind=launch`, "Launch log", "log-launch");
    this.badgeSlot = h("span");
    this.facts = h("p", { class: "facts-line", id: "replica-facts" });
    const searchBox = h("input", { id: "log-search", type: "search", placeholder: "text to find", autocomplete: "off" });
    searchBox.addEventListener("input", () => {
      this.output.search(searchBox.value);
      this.launch.search(searchBox.value);
    });
    const followBox = h("input", { id: "log-follow", type: "checkbox", checked: true });
    followBox.addEventListener("change", () => {
      this.output.follow = this.launch.follow = followBox.checked;
    });
    this.el = h("section", { "aria-labelledby": "replica-title" },
      h("div", { class: "title-row" }, h("h1", { id: "replica-title", text: `Replica ${id} of ${service}` }), this.badgeSlot),
      this.facts,
      h("div", { class: "log-tools" },
        h("label", { for: "log-search", text: "Search the logs" }), searchBox,
        h("label", { class: "check" }, followBox, " Keep scrolled to the end")),
      h("div", { class: "logs" }, this.output.el, this.launch.el));
  }

  update(state) {
    const service = state.services.find((one) => one.name === this.service);
    const replica = service && service.replicas.find((r) => r.id === this.id);
    if (!replica) {
      setText(this.facts, service ? "This replica is gone (its logs stay until the service is taken down)." : "The service is gone.");
      this.badgeSlot.replaceChildren();
      return;
    }
    if (this.badgeSlot.textContent !== replica.status) this.badgeSlot.replaceChildren(badge(replica.status));
    const bits = [`version v${replica.version}`, `age ${fmt.age(replica.age_seconds)}`,
      replica.endpoint ? `endpoint ${replica.endpoint}` : null, replica.pid ? `pid ${replica.pid}` : null,
      replica.failure ? `failure: ${replica.failure}` : null].filter(Boolean);
    setText(this.facts, bits.join(" · "));
  }

  close() {
    this.output.close();
    this.launch.close();
  }
}
