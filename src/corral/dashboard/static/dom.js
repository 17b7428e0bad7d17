// Small DOM helpers shared by the views: element builders, formatting, status colours.

const SVG_NS = "http://www.w3.org/2000/svg";

function fill(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") el.textContent = value;
    else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function h(tag, attrs, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

export function s(tag, attrs, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

export function setText(el, text) {
  const value = text === null || text === undefined ? "" : String(text);
  if (el.textContent !== value) el.textContent = value;
}

export function setAttr(el, name, value) {
  const text = value === null || value === undefined ? null : String(value);
  if (text === null) el.removeAttribute(name);
  else if (el.getAttribute(name) !== text) el.setAttribute(name, text);
}

// Status -> one of four looks; the text is always shown too, colour is never the only cue.
export function tone(status) {
  if (!status) return "off";
  if (status === "READY") return "ok";
  if (status.startsWith("FAILED") || status === "NOT_READY" || status === "CONTROLLER_FAILED" ||
      status === "PREEMPTED" || status === "NO_REPLICA") return "bad";
  if (status === "SHUTTING_DOWN") return "off";
  return "wait";
}

export function badge(status) {
  return h("span", { class: `badge ${tone(status)}`, text: status || "—" });
}

export const fmt = {
  qps(v) {
    if (v === null || v === undefined) return "—";
    return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2);
  },
  ms(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    const ms = seconds * 1000;
    // From 10 s, seconds: "50000 ms" did not fit a chart's axis margin and read "0000 ms".
    if (ms >= 10000) return `${seconds >= 100 ? seconds.toFixed(0) : seconds.toFixed(1)} s`;
    return ms >= 100 ? `${ms.toFixed(0)} ms` : ms >= 10 ? `${ms.toFixed(1)} ms` : `${ms.toFixed(2)} ms`;
  },
  pct(v) {
    if (v === null || v === undefined) return "—";
    return `${(v * 100).toFixed(v >= 0.1 ? 0 : 1)}%`;
  },
  age(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    if (seconds < 120) return `${Math.round(seconds)}s`;
    if (seconds < 7200) return `${Math.round(seconds / 60)}m`;
    if (seconds < 172800) return `${(seconds / 3600).toFixed(1)}h`;
    return `${Math.round(seconds / 86400)}d`;
  },
  clock(t) {
    return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  },
  count(n) {
    return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US");
  },
};

// Rows kept by key, so a row (and a focused link in it) survives every update.
export class KeyedRows {
  constructor(tbody, make, update) {
    this.tbody = tbody;
    this.make = make;
    this.update = update;
    this.rows = new Map();
  }

  sync(items, keyOf) {
    const seen = new Set();
    let previous = null;
    for (const item of items) {
      const key = String(keyOf(item));
      seen.add(key);
      let row = this.rows.get(key);
      if (!row) {
        row = this.make(item);
        this.rows.set(key, row);
      }
      this.update(row, item);
      const next = previous ? previous.nextSibling : this.tbody.firstChild;
      if (next !== row) this.tbody.insertBefore(row, next);
      previous = row;
    }
    for (const [key, row] of this.rows) {
      if (!seen.has(key)) {
        row.remove();
        this.rows.delete(key);
      }
    }
  }
}

// The page's one confirmation dialog: resolves true when the person confirms.
export function confirmAction(title, text, okLabel) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = okLabel;
  dialog.returnValue = "cancel";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
  });
}

// An action: POSTed with the header that tells the daemon it comes from this page.
export async function act(path, body) {
  const answer = await fetch(path, {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Corral-UI": "1" },
    body: JSON.stringify(body || {}),
  });
  let data = {};
  try {
    data = await answer.json();
  } catch (_) {
    data = {};
  }
  if (!answer.ok) throw new Error(data.error || `${answer.status} ${answer.statusText}`);
  return data;
}
