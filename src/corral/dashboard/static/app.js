// The dashboard's entry: one state stream for the whole tab, a tiny router, the header.
import { act, h } from "./dom.js";
import { ReplicaView } from "./replica.js";
import { ServiceView } from "./service.js";
import { ServicesView } from "./services.js";

const main = document.getElementById("main");
const crumbs = document.getElementById("crumbs");
const conn = document.getElementById("conn");
let view = null;
let state = null;

function viewFor(path) {
  let m = path.match(/^\/ui\/services\/([a-z0-9-]+)\/replicas\/(\d+)\/?$/);
  if (m) return new ReplicaView(m[1], Number(m[2]));
  m = path.match(/^\/ui\/services\/([a-z0-9-]+)\/?$/);
  if (m) return new ServiceView(m[1]);
  return new ServicesView();
}

function showCrumbs(parts) {
  crumbs.replaceChildren(
    ...parts.map(([label, href], i) =>
      h("span", {}, i ? " / " : "", href ? h("a", { href, "data-nav": true, text: label }) : label),
    ),
  );
}

function show() {
  if (view && view.close) view.close();
  view = viewFor(location.pathname);
  main.replaceChildren(view.el);
  document.title = `${view.title} · corral`;
  showCrumbs(view.crumbs);
  if (state) view.update(state);
}

function navigate(href) {
  history.pushState(null, "", href);
  show();
  main.focus();
}

document.addEventListener("click", (event) => {
  const link = event.target.closest("a[data-nav]");
  if (!link || event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey) return;
  event.preventDefault();
  navigate(link.getAttribute("href"));
});
window.addEventListener("popstate", show);

document.getElementById("logout").addEventListener("click", async () => {
  try {
    await act("/ui/api/logout");
  } finally {
    location.assign("/ui/login");
  }
});

// The daemon pushes a state every second while this tab listens; the browser reconnects by
// itself after a network blip. A closed stream (signed out, daemon gone) is retried slowly.
function listen() {
  const source = new EventSource("/ui/api/feed");
  source.addEventListener("state", (event) => {
    state = JSON.parse(event.data);
    conn.textContent = "live";
    conn.className = "conn ok";
    if (view) view.update(state);
  });
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) {
      conn.replaceChildren("disconnected · ", h("a", { href: "/ui/login", text: "sign in" }));
      conn.className = "conn bad";
      setTimeout(listen, 3000);
    } else {
      conn.textContent = "reconnecting…";
      conn.className = "conn wait";
    }
  });
}

show();
listen();
