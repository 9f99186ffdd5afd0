// Package durabletier is the one way into a durable queue's Redis keys.
//
// Package client refuses to write a durable queue (its put and delete
// scripts read the queue's meta hash, see queue.MetaDurable): a task put
// there past PostgreSQL would have no row and never run, a task deleted
// there would be loaded again from its row. The daemon's durable tier
// (internal/tasks.Durable) writes the row first and then Redis, so it must
// get past that check. It does so through Writer, which lives in an
// internal package so that no user of the public client can reach it by
// accident.
package durabletier

// Writer returns a copy of c, a *client.Client, whose task writes are
// allowed on a durable queue (they still obey the queue's max_pending).
// Package client sets it when it is initialised; callers type-assert the
// result back to *client.Client.
var Writer func(c any) any
