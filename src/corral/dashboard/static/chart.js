// Line charts drawn as inline SVG (no charting library), over a chosen time range, with the
// time and every series' value under the pointer shown while it hovers (or a finger touches).
import { fmt, h, s } from "./dom.js";

const W = 400;
const H = 170;
const PAD = { left: 60, right: 10, top: 10, bottom: 24 };

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

// "−5 min", "−1 h", "−90 s": how long before `t1` the time `t` is.
export function ago(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 120) return `−${Math.round(seconds)} s`;
  if (seconds < 7200) return `−${Math.round(seconds / 60)} min`;
  return `−${+(seconds / 3600).toFixed(1)} h`;
}

// The point of `points` ([[t, v], …], sorted by t) nearest to `t`, or null.
function nearest(points, t) {
  let lo = 0;
  let hi = points.length - 1;
  if (hi < 0) return null;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < t) lo = mid;
    else hi = mid;
  }
  return Math.abs(points[lo][0] - t) <= Math.abs(points[hi][0] - t) ? points[lo] : points[hi];
}

// One chart, redrawn in place: series [{label, cls, points: [[t, value|null]], step}].
export class Chart {
  constructor(title, format, floor) {
    this.title = title;
    this.format = format;
    this.floor = floor || 0;
    this.hoverT = null;
    this.svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    this.tip = h("div", { class: "chart-tip", role: "status", hidden: true });
    this.legend = h("ul", { class: "legend" });
    this.el = h("figure", { class: "chart" }, h("figcaption", { text: title }),
      h("div", { class: "chart-area" }, this.svg, this.tip), this.legend);
    const move = (event) => {
      const box = this.svg.getBoundingClientRect();
      const x = ((event.clientX - box.left) / box.width) * W;
      if (x < PAD.left || x > W - PAD.right) return this.leave();
      this.hoverT = this.t0 + ((x - PAD.left) / (W - PAD.left - PAD.right)) * (this.t1 - this.t0);
      this.showHover();
    };
    this.svg.addEventListener("pointermove", move);
    this.svg.addEventListener("pointerdown", move);
    this.svg.addEventListener("pointerleave", () => this.leave());
  }

  x(t) {
    return PAD.left + ((t - this.t0) / (this.t1 - this.t0)) * (W - PAD.left - PAD.right);
  }

  y(v) {
    return H - PAD.bottom - (v / this.top) * (H - PAD.top - PAD.bottom);
  }

  draw(series, t0, t1) {
    Object.assign(this, { series, t0, t1 });
    const shown = series.map((one) => ({ ...one, points: one.points.filter((p) => p[0] >= t0 && p[0] <= t1) }));
    this.shown = shown;
    const values = shown.flatMap((one) => one.points.map((p) => p[1])).filter((v) => v !== null);
    this.top = niceMax(Math.max(this.floor, ...values));
    const grid = [0, 0.5, 1].map((f) => s("g", { class: "grid" },
      s("line", { x1: PAD.left, x2: W - PAD.right, y1: this.y(this.top * f), y2: this.y(this.top * f) }),
      s("text", { x: PAD.left - 6, y: this.y(this.top * f) + 4, "text-anchor": "end", text: this.format(this.top * f) })));
    const ticks = [t0, (t0 + t1) / 2, t1].map((t, i) => s("text", {
      x: this.x(t), y: H - 6, "text-anchor": ["start", "middle", "end"][i], text: ago(t1 - t) }));
    const lines = shown.map((one) => s("path", { d: this.path(one), class: `series ${one.cls}`, fill: "none" }));
    const latest = shown.map((one) => {
      const known = one.points.filter((p) => p[1] !== null);
      return `${one.label} ${known.length ? this.format(known[known.length - 1][1]) : "no data"}`;
    }).join(", ");
    this.cursor = s("line", { class: "cursor", y1: PAD.top, y2: H - PAD.bottom, visibility: "hidden" });
    this.svg.setAttribute("aria-label", `${this.title}, from ${ago(t1 - t0)} to now; now: ${latest}`);
    this.svg.replaceChildren(s("title", { text: `${this.title}: ${latest}` }), ...grid,
      s("g", { class: "axis" }, ...ticks), ...lines, this.cursor);
    this.legend.replaceChildren(...series.map((one) =>
      h("li", {}, h("span", { class: `key ${one.cls}`, "aria-hidden": "true" }), one.label)));
    if (this.hoverT !== null) this.showHover();
  }

  path(one) {
    let d = "";
    let last = null;
    for (const [t, v] of one.points) {
      if (v === null) {
        last = null;
        continue;
      }
      const x = this.x(t).toFixed(1);
      const y = this.y(v).toFixed(1);
      if (last === null) d += `M${x},${y}`;
      else d += one.step ? `H${x}V${y}` : `L${x},${y}`;
      last = v;
    }
    // A lone point would draw nothing: a dot-length stroke makes it visible.
    if (d && !/[LHV]/.test(d)) d += "h0.01";
    return d || "M0,0";
  }

  showHover() {
    // Every series of a chart has its points at the same times (one sample each).
    const base = this.shown.find((one) => one.points.length);
    const hit = base ? nearest(base.points, this.hoverT) : null;
    if (!hit) return this.leave(true);
    const t = hit[0];
    const rows = this.shown.map((one) => {
      const p = nearest(one.points, t);
      const value = p && Math.abs(p[0] - t) < 1 && p[1] !== null ? this.format(p[1]) : "—";
      return h("span", { class: "tip-row" }, h("span", { class: `key ${one.cls}`, "aria-hidden": "true" }), `${one.label} ${value}`);
    });
    this.tip.replaceChildren(h("time", { text: fmt.clock(t) }), ...rows);
    this.tip.hidden = false;
    const x = this.x(t);
    this.tip.style.left = `${(x / W) * 100}%`;
    this.tip.classList.toggle("flip", x > W * 0.6);
    this.cursor.setAttribute("x1", x);
    this.cursor.setAttribute("x2", x);
    this.cursor.setAttribute("visibility", "visible");
  }

  leave(keep) {
    if (!keep) this.hoverT = null;
    this.tip.hidden = true;
    if (this.cursor) this.cursor.setAttribute("visibility", "hidden");
  }
}
