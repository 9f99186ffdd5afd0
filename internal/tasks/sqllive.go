package tasks

import (
	"context"
	"errors"

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/consumer"
)

// liveFunc reports which of ids may still run: a task cancelled or
// rescheduled since its batch began must not be run by a later statement
// of the batch.
type liveFunc func(ctx context.Context, ids []string) (map[string]bool, error)

type liveKey struct{}

// withLive gives an action's later statements (a sql action isolating a
// failing task) a check of which tasks may still run.
func withLive(ctx context.Context, f liveFunc) context.Context {
	return context.WithValue(ctx, liveKey{}, f)
}

// errNotHeld is the outcome of a task that an isolation statement did not
// run because the batch no longer held it.
var errNotHeld = errors.New("not run: deleted, cancelled or moved during its batch, or taken by another claim")

// stillLive keeps, of the tasks at idx, those that may still run (all of
// them when no check was given). Those that may not are not run, and not
// done either: someone else now owns them (a producer's change, another
// claim), so they spend no attempt and leave everything as it is
// (consumer.Later: the consumer's compare-and-set retry finds no lease of
// this batch's; the durable executor leaves the row alone, where "done"
// would mark a row another replica holds EXECUTED). A failing check gives
// the tasks back without an attempt.
//
// Two checks: the consumer's (consumer.Held: the batch's lease records
// still carry its token, so a task deleted or moved by a producer, or
// taken by another claim after an expired lease, is not run), and a
// durable queue's executor's (withLive).
func (r *sqlRun) stillLive(ctx context.Context, idx []int) []int {
	ids := make([]string, len(idx))
	for j, i := range idx {
		ids[j] = r.ids[i]
	}
	held, ok, err := consumer.Held(ctx, ids)
	if err == nil && !ok {
		held = nil // no batch to check: all held
	}
	var live map[string]bool
	if f, _ := ctx.Value(liveKey{}).(liveFunc); f != nil && err == nil {
		live, err = f(ctx, ids)
	}
	if err != nil {
		r.down = err
		r.set(idx, consumer.Unavailable(err))
		return nil
	}
	var keep []int
	for _, i := range idx {
		id := r.ids[i]
		if (held == nil || held[id]) && (live == nil || live[id]) {
			keep = append(keep, i)
		} else {
			r.errs[i] = consumer.Later(errNotHeld)
		}
	}
	return keep
}

// scheduled is a durable queue's liveFunc: tasks whose rows are still
// SCHEDULED at the version the executor read.
func (d *Durable) scheduled(version map[string]int64) liveFunc {
	return func(ctx context.Context, ids []string) (map[string]bool, error) {
		vers := make([]int64, len(ids))
		for i, id := range ids {
			vers[i] = version[id]
		}
		var got []string
		err := d.DB.SelectContext(ctx, &got, `SELECT t.id FROM orderdelay_tasks t
			JOIN unnest($2::text[], $3::bigint[]) AS v(id, version) ON t.id = v.id AND t.version = v.version
			WHERE t.queue = $1 AND t.state = 'SCHEDULED'`, d.Queue, pq.Array(ids), pq.Array(vers))
		if err != nil {
			return nil, err
		}
		live := make(map[string]bool, len(got))
		for _, id := range got {
			live[id] = true
		}
		return live, nil
	}
}
