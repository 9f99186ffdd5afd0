package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// withTools runs f with the operator's tools; withDB opens the database too.
func withTools(ctx context.Context, cfg config.Config, withDB bool, timeout time.Duration, f func(ctx context.Context, t *admin.Tools) error) error {
	rdb, err := newRedis(cfg)
	if err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer rdb.Close()
	var tools *admin.Tools
	if withDB {
		db, err := openDB(cfg, orders.PoolOptions{MaxConns: 2})
		if err != nil {
			return usageError{err}
		}
		defer db.Close()
		tools, err = admin.New(rdb, cfg.QueueKey, db, shardOpts(cfg)...)
		if err != nil {
			return usageError{err}
		}
	} else if tools, err = admin.New(rdb, cfg.QueueKey, nil, shardOpts(cfg)...); err != nil {
		return usageError{err}
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	return redactErr(f(ctx, tools), cfg)
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func noArgs(name string, pos []string) error {
	if len(pos) > 0 {
		return usagef("%s takes no arguments, got %q", name, pos)
	}
	return nil
}

func cmdPause(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var reason string
	cfg, pos, err := parse("pause", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.StringVar(&reason, "reason", "", "why (shown by inspect and the admin API)")
	})
	if err != nil {
		return err
	}
	if err := noArgs("pause", pos); err != nil {
		return err
	}
	return withTools(ctx, cfg, false, cliTimeout, func(ctx context.Context, t *admin.Tools) error {
		st, err := t.Pause(ctx, reason)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "closing paused since %s (%s); every replica stops claiming within one scan interval; enqueues continue\n",
			st.Since.UTC().Format(time.RFC3339), st.Reason)
		return nil
	})
}

func cmdResume(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	cfg, pos, err := parse("resume", args, stderr, getenv, nil)
	if err != nil {
		return err
	}
	if err := noArgs("resume", pos); err != nil {
		return err
	}
	return withTools(ctx, cfg, false, cliTimeout, func(ctx context.Context, t *admin.Tools) error {
		if err := t.Resume(ctx); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "closing resumed; the backlog closes at the replicas' pace (ORDERDELAY_MAX_CLOSE_RATE bounds it)")
		return nil
	})
}

func cmdExtend(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var within, by time.Duration
	var moveRows bool
	var explicit func() bool
	cfg, pos, err := parse("extend", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.DurationVar(&within, "within", 0, "extend entries due within this window from now, overdue ones included (e.g. 1h)")
		fs.DurationVar(&by, "by", 0, "by this much (e.g. 15m)")
		fs.BoolVar(&moveRows, "move-rows", true, "also move expires_at of pending rows in the reference schema (default: only when ORDERDELAY_CLOSE_SQL is not set)")
		explicit = func() bool {
			set := false
			fs.Visit(func(f *flag.Flag) { set = set || f.Name == "move-rows" })
			return set
		}
	})
	if err != nil {
		return err
	}
	if err := noArgs("extend", pos); err != nil {
		return err
	}
	if within <= 0 || by <= 0 {
		return usagef("extend needs --within and --by, both positive (e.g. --within 1h --by 15m)")
	}
	if err := admin.CheckExtend(within, by); err != nil {
		return usageError{err}
	}
	if !explicit() && cfg.CloseSQL != "" {
		moveRows = false // a shop's own schema: its expires_at is not ours to move
	}
	return withTools(ctx, cfg, moveRows, 0, func(ctx context.Context, t *admin.Tools) error {
		res, err := t.Extend(ctx, within, by, moveRows)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "moved %d queue entries %s later (%d rows' expires_at in step) in %d bounded steps\n",
			res.Moved, by, res.RowsMoved, res.BatchCalls)
		return nil
	})
}

func cmdResync(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var page int
	var perSecond float64
	cfg, pos, err := parse("resync", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.IntVar(&page, "page", admin.DefaultResyncPage, "pending orders read per query")
		fs.Float64Var(&perSecond, "rate", 5000, "most orders loaded per second (0: unlimited)")
	})
	if err != nil {
		return err
	}
	if err := noArgs("resync", pos); err != nil {
		return err
	}
	if page < 1 || page > 10000 || perSecond < 0 {
		return usagef("--page must be 1..10000 and --rate >= 0")
	}
	return withTools(ctx, cfg, true, 0, func(ctx context.Context, t *admin.Tools) error {
		res, err := t.Resync(ctx, page, perSecond)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "scanned %d pending orders: added %d missing entries, %d already queued, %d skipped as invalid\n",
			res.Scanned, res.Added, res.Scanned-res.Added-res.Invalid, res.Invalid)
		return nil
	})
}

func cmdPurge(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var dead bool
	var older time.Duration
	var keep int
	cfg, pos, err := parse("purge", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.BoolVar(&dead, "dead", false, "purge dead letters (required: the only thing purge removes)")
		fs.DurationVar(&older, "older-than", 0, "dead-lettered longer ago than this (e.g. 168h)")
		fs.IntVar(&keep, "keep", 0, "keep at most this many, the newest (0: no cap)")
	})
	if err != nil {
		return err
	}
	if err := noArgs("purge", pos); err != nil {
		return err
	}
	if !dead || older < 0 || keep < 0 || (older == 0 && keep == 0) {
		return usagef("purge needs --dead and --older-than D and/or --keep N")
	}
	return withTools(ctx, cfg, false, 0, func(ctx context.Context, t *admin.Tools) error {
		n, err := t.PurgeDead(ctx, older, keep)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "purged %d dead letters\n", n)
		return nil
	})
}

// inspectOrder is `orderdelay inspect SERIAL`. A row it cannot read
// (PostgreSQL unreachable, say) fails the command, exit 1, once what Redis
// holds is printed: half an answer is not a done one.
func inspectOrder(ctx context.Context, stdout io.Writer, cfg config.Config, serial string, asJSON bool) error {
	if err := queue.ValidateSerial(serial); err != nil {
		return usageError{err}
	}
	return withTools(ctx, cfg, true, cliTimeout, func(ctx context.Context, t *admin.Tools) error {
		rep, err := t.Order(ctx, serial)
		if err != nil {
			return err
		}
		if err := printOrder(stdout, serial, rep, asJSON); err != nil {
			return err
		}
		if rep.RowError != "" {
			return fmt.Errorf("PostgreSQL: cannot read the row of order %q: %s", serial, rep.RowError)
		}
		return nil
	})
}

// printOrder prints inspect SERIAL's report.
func printOrder(stdout io.Writer, serial string, rep admin.OrderReport, asJSON bool) error {
	if asJSON {
		return printJSON(stdout, rep)
	}
	fmt.Fprintf(stdout, "serial    %s\n", serial)
	if q := rep.Queue; q == nil {
		fmt.Fprintln(stdout, "redis     not in the queue")
	} else {
		fmt.Fprintf(stdout, "redis     %s, deadline %s, %d attempts\n", q.State, q.Deadline.UTC().Format(time.RFC3339Nano), q.Attempts)
		if !q.Until.IsZero() {
			fmt.Fprintf(stdout, "          until %s", q.Until.UTC().Format(time.RFC3339Nano))
			if q.Owner != "" {
				fmt.Fprintf(stdout, ", leased by %s", q.Owner)
			}
			fmt.Fprintln(stdout)
		}
		if q.Reason != "" || q.LastError != "" {
			fmt.Fprintf(stdout, "          reason %q, last error %q\n", q.Reason, q.LastError)
		}
	}
	switch r := rep.Row; {
	case rep.RowError != "":
		fmt.Fprintf(stdout, "postgres  cannot read the row: %s\n", rep.RowError)
	case r == nil:
		fmt.Fprintln(stdout, "postgres  no row in orders")
	default:
		fmt.Fprintf(stdout, "postgres  %s, expires %s", r.Status, r.ExpiresAt.UTC().Format(time.RFC3339Nano))
		if r.ClosedAt != nil {
			fmt.Fprintf(stdout, ", closed %s", r.ClosedAt.UTC().Format(time.RFC3339Nano))
		}
		if r.CloseReason != nil {
			fmt.Fprintf(stdout, " (%s)", *r.CloseReason)
		}
		if r.ClosedBy != nil {
			fmt.Fprintf(stdout, " by %s", *r.ClosedBy)
		}
		if r.PaidAt != nil {
			fmt.Fprintf(stdout, ", paid %s", r.PaidAt.UTC().Format(time.RFC3339Nano))
		}
		fmt.Fprintln(stdout)
	}
	return nil
}

// cmdUnbatch is `orderdelay unbatch`: batch leases back to per-member
// leases, for a rollback to a release before batch leases. Exit 1 when
// batch leases are left: damaged ones (reported) or ones made since by a
// daemon that still leases per batch.
func cmdUnbatch(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var perCall int
	var asJSON bool
	cfg, pos, err := parse("unbatch", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.IntVar(&perCall, "per-call", queue.UnbatchPerCall, "batch leases converted per script call (1..1000; each call reads at most 2000 member names besides its first batch)")
		fs.BoolVar(&asJSON, "json", false, "print the result per key as JSON")
	})
	if err != nil {
		return err
	}
	if err := noArgs("unbatch", pos); err != nil {
		return err
	}
	if perCall < 1 || perCall > 1000 {
		return usagef("--per-call must be 1..1000, got %d", perCall)
	}
	return withTools(ctx, cfg, false, 0, func(ctx context.Context, t *admin.Tools) error {
		res, err := t.Unbatch(ctx, perCall)
		if err != nil {
			return err
		}
		if asJSON {
			if err := printJSON(stdout, res); err != nil {
				return err
			}
		}
		var left, damaged int64
		for _, r := range res {
			if !asJSON {
				fmt.Fprintf(stdout, "%s: batch leases converted: %d; orders given a per-member lease: %d; listed orders that had left their batch: %d; batch leases left: %d (%d bounded steps)\n",
					r.Key, r.Batches, r.Members, r.Departed, r.Remaining, r.Calls)
				for _, p := range r.Problems {
					if p.Serial == "" {
						fmt.Fprintf(stdout, "%s: batch %q left as it is: %s\n", r.Key, p.Token, p.Reason)
					} else {
						fmt.Fprintf(stdout, "%s: order %q left in batch %q: %s\n", r.Key, p.Serial, p.Token, p.Reason)
					}
				}
			}
			left += r.Remaining
			seen := map[string]bool{}
			for _, p := range r.Problems {
				if !seen[p.Token] {
					seen[p.Token] = true
					damaged++
				}
			}
		}
		if left > 0 {
			return fmt.Errorf("batch leases left: %d; damaged: %d (listed; see docs/operations.md#upgrade-and-rollback); made since this run began by a daemon that still leases per batch: %d (run unbatch again once none runs)",
				left, damaged, max(left-damaged, 0))
		}
		return nil
	})
}
