package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// taskOpsVerbs are the `orderdelay task` verbs that operate a queue rather
// than one task; they do what the HTTP API's /v1/queues/{q}/... does.
var taskOpsVerbs = map[string]bool{
	"list": true, "dead": true, "requeue": true, "purge": true, "stats": true, "pause": true, "resume": true,
}

// cmdTaskOps runs `orderdelay task list|dead|requeue|purge|stats|pause|resume`.
func cmdTaskOps(ctx context.Context, verb string, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var (
		state, after, reason string
		limit                int
		withPayload, all     bool
		olderThan            time.Duration
	)
	cfg, pos, err := parse("task "+verb, args, stderr, getenv, func(fs *flag.FlagSet) {
		switch verb {
		case "list", "dead":
			if verb == "list" {
				fs.StringVar(&state, "state", tasks.ListPending, "pending, inflight or dead")
			}
			fs.IntVar(&limit, "limit", 100, "tasks per page, 1 to 1000")
			fs.StringVar(&after, "after", "", `the "next" cursor of the previous page`)
			fs.BoolVar(&withPayload, "payload", false, "include each task's payload")
		case "requeue":
			fs.BoolVar(&all, "all", false, "requeue the oldest dead letters, at most 1000")
		case "purge":
			fs.BoolVar(&all, "all", false, "purge every dead letter")
			fs.DurationVar(&olderThan, "older-than", 0, "purge dead letters dead-lettered longer ago than this (e.g. 168h)")
		case "pause":
			fs.StringVar(&reason, "reason", "", "why (shown by stats)")
		}
	})
	if err != nil {
		return err
	}
	if verb == "dead" {
		state = tasks.ListDead
	}
	// Check everything that needs no connection first.
	if len(pos) == 0 && verb != "stats" {
		return usagef("task %s needs a queue name", verb)
	}
	var ids []string
	if len(pos) > 0 {
		ids = pos[1:]
	}
	switch verb {
	case "list", "dead":
		if len(ids) > 0 {
			return usagef("task %s takes one queue name, got %q", verb, pos)
		}
		if limit < 1 || limit > tasks.MaxList {
			return usagef("--limit: want 1..%d, got %d", tasks.MaxList, limit)
		}
		if state != tasks.ListPending && state != tasks.ListInflight && state != tasks.ListDead {
			return usagef("--state: want pending, inflight or dead, got %q", state)
		}
		if after != "" {
			if _, err := queue.ParseCursor(after); err != nil {
				return usagef("--after: %v", err)
			}
		}
	case "requeue":
		if all == (len(ids) > 0) {
			return usagef("task requeue needs task ids or --all, not both")
		}
	case "purge":
		given := 0
		for _, g := range []bool{len(ids) > 0, all, olderThan != 0} {
			if g {
				given++
			}
		}
		if given != 1 {
			return usagef("task purge needs one of: task ids, --all, --older-than D")
		}
		if olderThan < 0 {
			return usagef("--older-than: want a positive duration, got %s", olderThan)
		}
	case "stats":
		if len(pos) > 1 {
			return usagef("task stats takes at most one queue name, got %q", pos)
		}
	case "pause", "resume":
		if len(ids) > 0 {
			return usagef("task %s takes one queue name, got %q", verb, pos)
		}
	}
	if len(ids) > tasks.MaxRequeue {
		return usagef("at most %d task ids at a time, got %d", tasks.MaxRequeue, len(ids))
	}
	for _, id := range ids {
		if err := queue.ValidateSerial(id); err != nil {
			return usageError{err}
		}
	}

	mgr, closeFn, err := taskManager(cfg)
	if err != nil {
		return err
	}
	defer closeFn()
	var q *tasks.Runtime
	if len(pos) > 0 {
		var ok bool
		if q, ok = mgr.Queue(pos[0]); !ok {
			return usagef("no queue %q in ORDERDELAY_QUEUES_FILE (%q)", pos[0], cfg.QueuesFile)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	err = func() error {
		switch verb {
		case "list", "dead":
			page, err := q.List(ctx, state, after, limit, withPayload)
			if err != nil {
				return err
			}
			return printJSON(stdout, page)
		case "requeue":
			var res tasks.RequeueResult
			var left int64
			if all {
				res, left, err = q.RequeueAll(ctx)
			} else {
				res, err = q.Requeue(ctx, ids)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "requeued %d\n", res.Requeued)
			for _, s := range res.Skipped {
				fmt.Fprintf(stdout, "skipped %s: %s\n", s.ID, s.Why)
			}
			if all && left > 0 {
				fmt.Fprintf(stdout, "%d dead letters left; run again for the next %d\n", left, tasks.MaxRequeue)
			}
			return nil
		case "purge":
			var n int
			if len(ids) > 0 {
				n, err = q.Purge(ctx, ids)
			} else {
				n, err = q.PurgeOlder(ctx, olderThan)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "purged %d dead letters\n", n)
			return nil
		case "stats":
			if q != nil {
				st, err := q.Stats(ctx)
				if err != nil {
					return err
				}
				return printJSON(stdout, st)
			}
			out := make([]tasks.Stats, 0, len(mgr.Names()))
			for _, name := range mgr.Names() {
				r, _ := mgr.Queue(name)
				st, err := r.Stats(ctx)
				if err != nil {
					return err
				}
				out = append(out, st)
			}
			return printJSON(stdout, out)
		case "pause":
			st, err := q.Pause(ctx, reason)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "queue %s paused since %s: %s\n", q.Config.Name, st.Since.UTC().Format(time.RFC3339), st.Reason)
			return nil
		default: // resume
			if err := q.Resume(ctx); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "queue %s resumed\n", q.Config.Name)
			return nil
		}
	}()
	if errors.Is(err, queue.ErrBadCursor) || errors.Is(err, tasks.ErrBadState) {
		return usageError{err}
	}
	return redactErr(err, cfg)
}

// taskManager builds the queues of the queues file for operating them (no
// consumer runs). A durable queue's tools need the database: a pool is
// opened (lazily) when the file has one.
func taskManager(cfg config.Config) (*tasks.Manager, func(), error) {
	f, err := loadQueues(cfg)
	if err != nil {
		return nil, nil, err
	}
	if len(f.Queues) == 0 {
		return nil, nil, usagef("no task queues: set ORDERDELAY_QUEUES_FILE")
	}
	rdb, err := newRedis(cfg)
	if err != nil {
		return nil, nil, usageError{redactErr(err, cfg)}
	}
	var db *sqlx.DB
	for _, q := range f.Queues {
		if q.Durable && db == nil {
			if db, err = openDB(cfg, orders.PoolOptions{MaxConns: 2}); err != nil {
				rdb.Close()
				return nil, nil, usageError{err}
			}
		}
	}
	closeAll := func() {
		rdb.Close()
		if db != nil {
			db.Close()
		}
	}
	reg := prometheus.NewRegistry()
	mgr, err := tasks.NewManager(f, rdb, db, metrics.NewTaskFamilies(reg, metrics.New(reg, "cli", "cli")), zap.NewNop(), "cli")
	if err != nil {
		closeAll()
		return nil, nil, usageError{err}
	}
	return mgr, closeAll, nil
}
