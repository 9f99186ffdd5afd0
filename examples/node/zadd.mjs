// Enqueue order timeouts for orderdelay with a raw ZADD (node-redis).
//
//   node zadd.mjs SERIAL DEADLINE [SERIAL DEADLINE ...]
//
// DEADLINE is the order's payment deadline as an RFC 3339 time with a zone,
// for example 2026-12-01T10:00:00.123456Z: the expires_at your checkout
// stored with the order. Settings come from the environment:
//
//   ORDERDELAY_REDIS_URL   default redis://127.0.0.1:6379/0
//   ORDERDELAY_QUEUE_KEY   default orderdelay-demo:order (the demo's queue)
//
// Exit status: 0 every order queued, 1 Redis failed, 2 bad arguments.
import { createClient } from 'redis';

const RFC3339 = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.(\d+))?(Z|[+-]\d\d:\d\d)$/i;

// deadlineMillis is the ZADD score: the deadline in integer Unix
// milliseconds, rounded up. Rounding down would make the order due before its
// deadline; a score in seconds or a fractional one is dead-lettered by
// orderdelay, never closed. Date keeps milliseconds only, so a finer fraction
// (…:00.123456Z) is rounded up here.
export function deadlineMillis(text) {
  const m = RFC3339.exec(text);
  const ms = m ? Date.parse(text) : NaN;
  if (Number.isNaN(ms)) {
    throw new Error(`deadline ${JSON.stringify(text)}: want an RFC 3339 time such as 2026-12-01T10:00:00Z`);
  }
  const finer = (m[2] ?? '').slice(3);
  return /[1-9]/.test(finer) ? ms + 1 : ms;
}

// enqueue queues the order's timeout; call it after the order row has
// committed. NX: a retry never moves the deadline. Resolves to true if the
// entry is new, false if the order was already queued.
export async function enqueue(client, queueKey, serial, deadlineMs) {
  const added = await client.zAdd(queueKey, { score: deadlineMs, value: serial }, { condition: 'NX' });
  return added === 1;
}

async function main(args) {
  if (args.length === 0 || args.length % 2 !== 0) {
    console.error('usage: node zadd.mjs SERIAL DEADLINE [SERIAL DEADLINE ...]');
    return 2;
  }
  const orders = [];
  for (let i = 0; i < args.length; i += 2) {
    try {
      orders.push([args[i], deadlineMillis(args[i + 1])]);
    } catch (e) {
      console.error(`${args[i]}: ${e.message}`);
      return 2;
    }
  }
  const queueKey = process.env.ORDERDELAY_QUEUE_KEY || 'orderdelay-demo:order';
  const client = createClient({
    url: process.env.ORDERDELAY_REDIS_URL || 'redis://127.0.0.1:6379/0',
    // A command-line tool gives up after a few tries; a long-running checkout
    // would rather keep node-redis's default of reconnecting for ever.
    socket: { connectTimeout: 5_000, reconnectStrategy: (n, err) => (n < 3 ? 100 * 2 ** n : err) },
  });
  // Without a listener an 'error' event (a lost connection) ends the process.
  client.on('error', () => {});
  try {
    await client.connect();
    for (const [serial, ms] of orders) {
      const added = await enqueue(client, queueKey, serial, ms);
      console.log(`${serial}: ZADD ${queueKey} NX ${ms} -> ${added ? 'queued' : 'already queued, deadline kept'}`);
    }
  } catch (e) {
    console.error(`redis: ${e.message}`);
    return 1;
  } finally {
    if (client.isOpen) await client.close();
  }
  return 0;
}

process.exitCode = await main(process.argv.slice(2));
