// Enqueue order timeouts through orderdelay's HTTP API (Node's own fetch).
//
//   node api.mjs SERIAL DEADLINE [SERIAL DEADLINE ...]
//
// DEADLINE is the order's payment deadline as an RFC 3339 time with a zone,
// for example 2026-12-01T10:00:00.123456Z: the expires_at your checkout
// stored with the order. Settings come from the environment:
//
//   ORDERDELAY_API_URL     default http://127.0.0.1:8080
//   ORDERDELAY_API_TOKEN   sent as "Authorization: Bearer ..." when set
//
// Exit status: 0 every order queued, 1 the API refused or failed, 2 bad arguments.

// enqueue sends PUT /v1/timeouts/{serial} {"at": deadline}: 201 queued, 200
// already queued. Without "reschedule" the call is idempotent (a retry never
// moves the deadline), so retrying on a network error or a 503 is safe. Any
// other status (400 bad input, 401 token) throws.
export async function enqueue(apiUrl, token, serial, deadline) {
  const headers = { 'Content-Type': 'application/json' };
  if (token) headers.Authorization = `Bearer ${token}`;
  const res = await fetch(`${apiUrl.replace(/\/+$/, '')}/v1/timeouts/${encodeURIComponent(serial)}`, {
    method: 'PUT',
    headers,
    body: JSON.stringify({ at: deadline }),
    signal: AbortSignal.timeout(10_000),
  });
  const text = await res.text();
  if (res.status !== 200 && res.status !== 201) {
    throw new Error(`PUT -> ${res.status}: ${text.trim()}`);
  }
  return { status: res.status, entry: JSON.parse(text) };
}

async function main(args) {
  if (args.length === 0 || args.length % 2 !== 0) {
    console.error('usage: node api.mjs SERIAL DEADLINE [SERIAL DEADLINE ...]');
    return 2;
  }
  const apiUrl = process.env.ORDERDELAY_API_URL || 'http://127.0.0.1:8080';
  const token = process.env.ORDERDELAY_API_TOKEN || '';
  for (let i = 0; i < args.length; i += 2) {
    const serial = args[i];
    try {
      const { status, entry } = await enqueue(apiUrl, token, serial, args[i + 1]);
      console.log(`${serial}: PUT /v1/timeouts -> ${status} ${entry.result}, deadline ${entry.deadline} (${entry.deadline_ms} ms)`);
    } catch (e) {
      console.error(`${serial}: ${e.cause?.message ?? e.message}`);
      return 1;
    }
  }
  return 0;
}

process.exitCode = await main(process.argv.slice(2));
