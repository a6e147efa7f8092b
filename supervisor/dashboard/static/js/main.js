// The dashboard's page app: hash routes, the login form, the status line.
//   #/fleet  #/jobs  #/jobs/ID  #/sweeps  #/sweeps/ID  #/compare?jobs=A,B&metric=loss
//   #/events?node=N&job=J

import * as api from "./api.js";
import { fill, fmtClock, h } from "./dom.js";
import * as fleet from "./fleet.js";
import * as jobs from "./jobs.js";
import * as job from "./job.js";
import * as compare from "./compare.js";
import * as sweeps from "./sweeps.js";
import * as events from "./events.js";

const view = document.getElementById("view");
const nav = document.getElementById("nav");
const status = document.getElementById("status");
const logoutButton = document.getElementById("logout");
const who = document.getElementById("who");

// What the tests (and a curious operator's console) can read: the charts' data.
window.phalanx = { page: null, charts: {}, metrics: {} };

let current = null; // the mounted page: {unmount()}
let loggingIn = false;

function route() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path] = hash.split("?");
  const parts = path.split("/").filter(Boolean);
  if (parts[0] === "jobs" && parts[1]) return { page: "job", mod: job, arg: decodeURIComponent(parts[1]) };
  if (parts[0] === "sweeps" && parts[1]) return { page: "sweep", mod: sweeps, arg: decodeURIComponent(parts[1]) };
  const pages = { fleet, jobs, sweeps, compare, events };
  const name = pages[parts[0]] ? parts[0] : "fleet";
  return { page: name, mod: pages[name], arg: null };
}

function show() {
  if (loggingIn) return;
  if (current) current.unmount();
  window.phalanx.charts = {};
  window.phalanx.metrics = {};
  const { page, mod, arg } = route();
  window.phalanx.page = page;
  for (const a of nav.querySelectorAll("a")) {
    a.classList.toggle("active", a.dataset.page === ({ job: "jobs", sweep: "sweeps" }[page] || page));
  }
  document.body.dataset.page = page;
  fill(view);
  current = mod.mount(view, arg) || { unmount() {} };
}

// The session's token in the header: "alice (member of team nlp)".
function showWho(token) {
  if (!token) {
    fill(who);
    return;
  }
  const role = token.team ? `${token.role} of team ${token.team}` : token.role;
  fill(who, `${token.name} (${role})`);
}

function showLogin(message) {
  showWho(null);
  if (current) current.unmount();
  current = null;
  loggingIn = true;
  window.phalanx.page = "login";
  document.body.dataset.page = "login";
  nav.hidden = true;
  logoutButton.hidden = true;
  const input = h("input", {
    type: "password",
    id: "token",
    name: "token",
    autocomplete: "current-password",
    placeholder: "PHALANX_TOKEN",
    required: true,
  });
  const error = h("p", { class: "error", id: "login-error" }, message || "");
  const form = h(
    "form",
    { class: "login card", id: "login" },
    h("h2", {}, "Log in to the supervisor"),
    h("p", { class: "muted" }, "An API token (what PHALANX_TOKEN holds); its role decides what this page may do. It is sent once; the browser keeps a session cookie."),
    input,
    h("button", { type: "submit", id: "login-submit" }, "Log in"),
    error,
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    fill(error);
    let answer;
    try {
      answer = await api.login(input.value);
    } catch (err) {
      fill(error, err.status === 401 && err.message === "wrong token" ? "Wrong token." : err.message);
      return;
    }
    showWho(answer.token);
    loggingIn = false;
    nav.hidden = false;
    logoutButton.hidden = false;
    show();
  });
  fill(view, form);
  input.focus();
}

window.addEventListener("phalanx:login", (ev) => {
  const why = ev.detail && ev.detail.message;
  const ended = why && why.startsWith("the dashboard's session ended: ") ? why : null;
  if (!loggingIn) showLogin(ended ? `${ended}; log in.` : "Your session ended or was never started: log in.");
});

window.addEventListener("phalanx:status", (ev) => {
  const { ok, message } = ev.detail;
  status.classList.toggle("down", !ok);
  fill(status, ok ? `live · ${fmtClock(Date.now() / 1000)}` : "supervisor unreachable");
  status.title = ok ? "" : message;
});

logoutButton.addEventListener("click", async () => {
  try {
    await api.logout();
  } finally {
    showLogin("Logged out.");
  }
});

window.addEventListener("hashchange", show);

// The first look: is there a session? (a 401 shows the login form)
api
  .get("v1/whoami")
  .then((token) => {
    showWho(token);
    logoutButton.hidden = false;
    show();
  })
  .catch((err) => {
    if (err.status !== 401) fill(view, h("p", { class: "error" }, err.message));
  });
