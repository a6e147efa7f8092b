// The supervisor's REST API from the page: the session cookie goes along (same origin),
// every request carries the CSRF header, a 401 asks for the token again (saying why: a
// revoked or expired token ends its sessions).

const ROOT = new URL("../", document.baseURI); // the page is /ui/: the API is at /v1/...
const UI = new URL("./", document.baseURI);
const HEADERS = { "X-Phalanx-CSRF": "1" };

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function call(url, init = {}) {
  let resp;
  try {
    resp = await fetch(url, {
      credentials: "same-origin",
      ...init,
      headers: { ...HEADERS, ...(init.headers || {}) },
    });
  } catch (err) {
    const message = `the supervisor cannot be reached: ${err.message}`;
    window.dispatchEvent(new CustomEvent("phalanx:status", { detail: { ok: false, message } }));
    throw new ApiError(0, message);
  }
  window.dispatchEvent(new CustomEvent("phalanx:status", { detail: { ok: true } }));
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body && body.error) message = body.error;
    } catch {
      /* not JSON: the status says it */
    }
    if (resp.status === 401) {
      window.dispatchEvent(new CustomEvent("phalanx:login", { detail: { message } }));
    }
    throw new ApiError(resp.status, message);
  }
  return resp;
}

/** GET a JSON document of the API, e.g. get("v1/nodes"). */
export async function get(path) {
  const resp = await call(new URL(path, ROOT));
  return resp.json();
}

/** GET a page of a paged list (GET /v1/jobs?limit=N&before=C): the items, the next
 * page's cursor (null: the last page) and the items on every page. */
export async function getPage(path) {
  const resp = await call(new URL(path, ROOT));
  const total = resp.headers.get("X-Phalanx-Total");
  return { items: await resp.json(), next: resp.headers.get("X-Phalanx-Next"), total: total === null ? null : Number(total) };
}

/** GET raw text and the response's headers (a rank's log). */
export async function getText(path) {
  const resp = await call(new URL(path, ROOT));
  return { text: await resp.text(), headers: resp.headers };
}

/** POST a JSON body to the API. */
export async function post(path, body = {}) {
  const resp = await call(new URL(path, ROOT), {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  return resp.json();
}

export async function login(token) {
  const resp = await call(new URL("login", UI), {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token }),
  });
  return resp.json();
}

export async function logout() {
  await call(new URL("logout", UI), { method: "POST" });
}
