package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// cliTimeout bounds every CLI command's work.
const cliTimeout = 30 * time.Second

func cmdMigrate(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	cfg, pos, err := parse("migrate", args, stderr, getenv, nil)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("migrate takes no arguments, got %q", pos)
	}
	v, err := orders.Migrate(cfg.DatabaseURL)
	if err != nil {
		return redactErr(err, cfg)
	}
	fmt.Fprintf(stdout, "schema at version %d\n", v)
	return nil
}

// withProducer runs f with a producer on the configured queue, writing
// reminders like the daemon's API when ORDERDELAY_REMINDER_QUEUE is set.
func withProducer(ctx context.Context, cfg config.Config, f func(ctx context.Context, p *producer.Producer) error) error {
	var queuesFile tasks.File
	if cfg.ReminderQueue != "" {
		var err error
		if queuesFile, err = loadQueues(cfg); err != nil {
			return err
		}
	}
	reminders, withReminders, err := reminderQueue(cfg, queuesFile)
	if err != nil {
		return err
	}
	rdb, err := newRedis(cfg)
	if err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer rdb.Close()
	cl, err := client.New(rdb, cfg.QueueKey, shardOpts(cfg)...)
	if err != nil {
		return usageError{err}
	}
	p := producer.New(cl, nil, nil)
	if withReminders {
		rc, err := client.New(rdb, reminders.Key)
		if err != nil {
			return usageError{err}
		}
		p.WithReminders(rc, cfg.ReminderBefore)
	}
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	return redactErr(f(ctx, p), cfg)
}

func cmdEnqueue(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var after time.Duration
	var at string
	var req producer.Request
	cfg, pos, err := parse("enqueue", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.DurationVar(&after, "after", 0, "deadline = now + this duration (e.g. 30m)")
		fs.StringVar(&at, "at", "", "absolute deadline, RFC 3339 (e.g. 2026-01-02T15:04:05Z)")
		fs.BoolVar(&req.Reschedule, "reschedule", false, "move the deadline if the order is already queued")
		fs.BoolVar(&req.OnlyLater, "only-later", false, "move the deadline only if the new one is later")
	})
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("enqueue takes one serial, got %d arguments", len(pos))
	}
	req.Serial, req.After = pos[0], after
	if at != "" {
		if req.At, err = time.Parse(time.RFC3339Nano, at); err != nil {
			return usagef("--at: want an RFC 3339 time: %v", err)
		}
	}
	return withProducer(ctx, cfg, func(ctx context.Context, p *producer.Producer) error {
		res, deadline, err := p.Put(ctx, req)
		if errors.Is(err, producer.ErrBadRequest) {
			return usageError{err}
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s %s deadline %s\n", req.Serial, res, deadline.UTC().Format(time.RFC3339Nano))
		return nil
	})
}

func cmdCancel(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	cfg, pos, err := parse("cancel", args, stderr, getenv, nil)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("cancel takes one serial, got %d arguments", len(pos))
	}
	return withProducer(ctx, cfg, func(ctx context.Context, p *producer.Producer) error {
		err := p.Cancel(ctx, pos[0])
		switch {
		case errors.Is(err, producer.ErrBadRequest):
			return usageError{err}
		case errors.Is(err, client.ErrNotFound):
			return fmt.Errorf("%s: no timeout queued", pos[0])
		case err != nil:
			return err
		}
		fmt.Fprintf(stdout, "%s cancelled\n", pos[0])
		return nil
	})
}

// inspectJSON is `inspect --json` output.
type inspectJSON struct {
	Queue                string           `json:"queue"`
	Depth                int64            `json:"depth"`
	Overdue              int64            `json:"overdue"`
	OldestOverdueSeconds float64          `json:"oldest_overdue_seconds"`
	NextDeadline         *string          `json:"next_deadline"`
	DeadLetters          int64            `json:"dead_letters"`
	Paused               admin.PauseState `json:"pause"`
	// Shards lists each key of a sharded queue (ORDERDELAY_QUEUE_SHARDS >
	// 1), the queue key first; the figures above are their sums.
	Shards []shardJSON `json:"shards,omitempty"`
}

func cmdInspect(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var asJSON, dead bool
	var limit int64
	cfg, pos, err := parse("inspect", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print JSON")
		fs.BoolVar(&dead, "dead", false, "list dead-lettered entries with reason, attempts and last error")
		fs.Int64Var(&limit, "limit", 100, "with --dead: most entries to list, oldest first")
	})
	if err != nil {
		return err
	}
	if len(pos) > 1 {
		return usagef("inspect takes at most one serial, got %q", pos)
	}
	if len(pos) == 1 {
		if dead {
			return usagef("inspect --dead lists the dead letters and takes no serial, got %q; for one order: inspect SERIAL", pos[0])
		}
		return inspectOrder(ctx, stdout, cfg, pos[0], asJSON)
	}
	rdb, err := newRedis(cfg)
	if err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	if dead {
		return printDead(ctx, stdout, rdb, cfg, limit, asJSON)
	}
	s, shards, err := readQueueStats(ctx, rdb, cfg)
	if err != nil {
		return redactErr(err, cfg)
	}
	tools, err := admin.New(rdb, cfg.QueueKey, nil, shardOpts(cfg)...)
	if err != nil {
		return usageError{err}
	}
	pause, err := tools.PauseState(ctx)
	if err != nil {
		return redactErr(err, cfg)
	}
	out := inspectJSON{Queue: cfg.QueueKey, Depth: s.Depth, Overdue: s.Overdue,
		OldestOverdueSeconds: s.OldestDue.Seconds(), DeadLetters: s.DeadLetters, Paused: pause, Shards: shards}
	next := "none"
	if !s.NextDeadline.IsZero() {
		next = s.NextDeadline.UTC().Format(time.RFC3339Nano)
		out.NextDeadline = &next
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	fmt.Fprintf(stdout, "queue           %s\ndepth           %d\noverdue         %d\noldest overdue  %s\nnext deadline   %s\ndead letters    %d\n",
		out.Queue, out.Depth, out.Overdue, s.OldestDue.Round(time.Millisecond), next, out.DeadLetters)
	if pause.Paused {
		fmt.Fprintf(stdout, "PAUSED          since %s: %s\n", pause.Since.UTC().Format(time.RFC3339), pause.Reason)
	}
	if len(shards) > 0 {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "\nSHARD\tKEY\tSLOT\tDEPTH\tOVERDUE\tOLDEST\tDEAD")
		for _, sh := range shards {
			name := strconv.Itoa(sh.Shard)
			if sh.Shard < 0 {
				name = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%s\t%d\n", name, sh.Key, sh.Slot, sh.Depth, sh.Overdue,
				time.Duration(sh.OldestOverdueSeconds*float64(time.Second)).Round(time.Millisecond), sh.DeadLetters)
		}
		return tw.Flush()
	}
	return nil
}

func printDead(ctx context.Context, stdout io.Writer, rdb redis.UniversalClient, cfg config.Config, limit int64, asJSON bool) error {
	if limit < 1 {
		return usagef("--limit: want at least 1, got %d", limit)
	}
	tools, err := admin.New(rdb, cfg.QueueKey, nil, shardOpts(cfg)...)
	if err != nil {
		return usageError{err}
	}
	entries, err := tools.Dead(ctx, limit)
	if err != nil {
		return redactErr(err, cfg)
	}
	if asJSON {
		if entries == nil {
			entries = []queue.DeadEntry{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	if len(entries) == 0 {
		fmt.Fprintln(stdout, "no dead letters")
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERIAL\tREASON\tATTEMPTS\tDEADLINE\tDEAD SINCE\tLAST ERROR")
	for _, e := range entries {
		fmt.Fprintf(tw, "%q\t%s\t%d\t%s\t%s\t%s\n", e.Serial, e.Reason, e.Attempts, e.Deadline,
			e.At.UTC().Format(time.RFC3339), e.LastError)
	}
	return tw.Flush()
}

func cmdRequeue(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var all bool
	cfg, pos, err := parse("requeue", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.BoolVar(&all, "all", false, "put every dead-lettered entry back")
	})
	if err != nil {
		return err
	}
	if all == (len(pos) > 0) {
		return usagef("requeue takes serials or --all (one of the two)")
	}
	rdb, err := newRedis(cfg)
	if err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	tools, err := admin.New(rdb, cfg.QueueKey, nil, shardOpts(cfg)...)
	if err != nil {
		return usageError{err}
	}
	var n int
	if all {
		n, err = tools.RequeueAll(ctx)
	} else {
		n, err = tools.Requeue(ctx, pos...)
	}
	if err != nil {
		return redactErr(err, cfg)
	}
	fmt.Fprintf(stdout, "requeued %d entries, due now\n", n)
	return nil
}
