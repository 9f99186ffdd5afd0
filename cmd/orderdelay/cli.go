package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
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

// withProducer runs f with a producer on the configured queue.
func withProducer(ctx context.Context, cfg config.Config, f func(ctx context.Context, p *producer.Producer) error) error {
	rdb, err := newRedis(cfg)
	if err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer rdb.Close()
	cl, err := client.New(rdb, cfg.QueueKey)
	if err != nil {
		return usageError{err}
	}
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	return redactErr(f(ctx, producer.New(cl, nil, nil)), cfg)
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
	Queue                string  `json:"queue"`
	Depth                int64   `json:"depth"`
	Overdue              int64   `json:"overdue"`
	OldestOverdueSeconds float64 `json:"oldest_overdue_seconds"`
	NextDeadline         *string `json:"next_deadline"`
	DeadLetters          int64   `json:"dead_letters"`
}

func cmdInspect(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	var asJSON bool
	cfg, pos, err := parse("inspect", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print JSON")
	})
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("inspect takes no arguments, got %q", pos)
	}
	rdb, err := newRedis(cfg)
	if err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	s, err := consumer.ReadStats(ctx, rdb, queue.NewKeys(cfg.QueueKey))
	if err != nil {
		return redactErr(err, cfg)
	}
	out := inspectJSON{Queue: cfg.QueueKey, Depth: s.Depth, Overdue: s.Overdue,
		OldestOverdueSeconds: s.OldestDue.Seconds(), DeadLetters: s.DeadLetters}
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
	return nil
}
