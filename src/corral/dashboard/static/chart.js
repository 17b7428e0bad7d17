// Line charts drawn as inline SVG: a few dozen lines instead of a charting library.
import { h, s } from "./dom.js";

const W = 400;
const H = 170;
const PAD = { left: 60, right: 10, top: 10, bottom: 24 };

function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

// series: [{label, cls, points: [[t, value|null]], step}]; t0..t1 the time axis (seconds).
export function lineChart({ title, series, t0, t1, format, floor }) {
  const values = series.flatMap((one) => one.points.map((p) => p[1])).filter((v) => v !== null);
  const top = niceMax(Math.max(floor || 0, ...values));
  const x = (t) => PAD.left + ((t - t0) / (t1 - t0)) * (W - PAD.left - PAD.right);
  const y = (v) => H - PAD.bottom - (v / top) * (H - PAD.top - PAD.bottom);
  const grid = [0, 0.5, 1].map((f) =>
    s("g", { class: "grid" },
      s("line", { x1: PAD.left, x2: W - PAD.right, y1: y(top * f), y2: y(top * f) }),
      s("text", { x: PAD.left - 6, y: y(top * f) + 4, "text-anchor": "end", text: format(top * f) }),
    ),
  );
  const ticks = [[t0, "−60 min"], [(t0 + t1) / 2, "−30 min"], [t1, "now"]].map(([t, label], i) =>
    s("text", { x: x(t), y: H - 6, "text-anchor": ["start", "middle", "end"][i], text: label }),
  );
  const lines = series.map((one) => {
    let d = "";
    let last = null;
    for (const [t, v] of one.points) {
      if (v === null || t < t0) {
        last = null;
        continue;
      }
      if (last === null) d += `M${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      else if (one.step) d += `H${x(t).toFixed(1)}V${y(v).toFixed(1)}`;
      else d += `L${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      last = v;
    }
    return s("path", { d: d || "M0,0", class: `series ${one.cls}`, fill: "none" });
  });
  const latest = series
    .map((one) => {
      const known = one.points.filter((p) => p[1] !== null);
      return `${one.label} ${known.length ? format(known[known.length - 1][1]) : "no data"}`;
    })
    .join(", ");
  const svg = s("svg", {
    viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${title} over the last hour; now: ${latest}`,
  }, s("title", { text: `${title}: ${latest}` }), ...grid, s("g", { class: "axis" }, ...ticks), ...lines);
  const legend = h("ul", { class: "legend" },
    ...series.map((one) => h("li", {}, h("span", { class: `key ${one.cls}`, "aria-hidden": "true" }), one.label)),
  );
  return h("figure", { class: "chart" }, h("figcaption", { text: title }), svg, legend);
}
