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
	"github.com/orderdelay/orderdelay/internal/producer"
)

// cmdTask is `orderdelay task put|get|delete QUEUE ID...` for the queues of
// the queues file.
func cmdTask(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) error {
	if len(args) == 0 {
		return usagef("task needs put, get, delete, list, dead, requeue, purge, stats, pause or resume")
	}
	verb := args[0]
	if done, err := taskHelpOrBadVerb(verb, stdout); done { // tasks_help.go
		return err
	}
	if taskOpsVerbs[verb] {
		return cmdTaskOps(ctx, verb, args[1:], stdout, stderr, getenv) // tasks_ops.go
	}
	var after time.Duration
	var at, payload string
	var req producer.Request
	cfg, pos, err := parse("task "+verb, args[1:], stderr, getenv, func(fs *flag.FlagSet) {
		if verb == "put" {
			fs.DurationVar(&after, "after", 0, "due after this long (e.g. 5m)")
			fs.StringVar(&at, "at", "", "due at this RFC 3339 time")
			fs.StringVar(&payload, "payload", "null", "the task's JSON payload")
			fs.BoolVar(&req.Reschedule, "reschedule", false, "move the task (and replace its payload) if it exists")
			fs.BoolVar(&req.OnlyLater, "only-later", false, "move it only if the new time is later")
		}
	})
	if err != nil {
		return err
	}
	if len(pos) < 2 {
		return usagef("task %s needs a queue name and a task id", verb)
	}
	cl, closeFn, err := taskClient(cfg, pos[0], stderr)
	if err != nil {
		return err
	}
	defer closeFn()
	ctx, cancel := context.WithTimeout(ctx, cliTimeout)
	defer cancel()
	switch verb {
	case "put":
		if len(pos) != 2 {
			return usagef("task put takes one id")
		}
		req.Serial, req.After = pos[1], after
		if at != "" {
			if req.At, err = time.Parse(time.RFC3339Nano, at); err != nil {
				return usagef("--at: want an RFC 3339 time: %v", err)
			}
		}
		deadline, err := req.Deadline(time.Now())
		if err != nil {
			return usageError{err}
		}
		mode, err := req.Mode()
		if err != nil {
			return usageError{err}
		}
		res, when, err := cl.put(ctx, req.Serial, json.RawMessage(payload), deadline, mode)
		if errors.Is(err, client.ErrInvalidPayload) || errors.Is(err, client.ErrInvalidSerial) || errors.Is(err, client.ErrInvalidDeadline) {
			return usageError{err}
		}
		if err != nil {
			return redactErr(err, cfg)
		}
		fmt.Fprintf(stdout, "%s %s due %s\n", req.Serial, res, when.UTC().Format(time.RFC3339Nano))
	case "get":
		t, err := cl.get(ctx, pos[1])
		if errors.Is(err, client.ErrInvalidSerial) {
			return usageError{err}
		}
		if err != nil {
			return redactErr(err, cfg)
		}
		return printJSON(stdout, t)
	case "delete":
		n, err := cl.delete(ctx, pos[1:])
		if errors.Is(err, client.ErrInvalidSerial) {
			return usageError{err}
		}
		if err != nil {
			return redactErr(err, cfg)
		}
		fmt.Fprintf(stdout, "deleted %d of %d tasks\n", n, len(pos)-1)
	default:
		return usagef("task: unknown verb %q (want put, get, delete, list, dead, requeue, purge, stats, pause or resume)", verb)
	}
	return nil
}

// taskClient returns the named queue of the queues file: its public
// client, and for a durable queue its durable tier too.
func taskClient(cfg config.Config, name string, stderr io.Writer) (taskTarget, func(), error) {
	f, err := loadQueues(cfg)
	if err != nil {
		return taskTarget{}, nil, err
	}
	for _, q := range f.Queues {
		if q.Name != name {
			continue
		}
		rdb, err := newRedis(cfg)
		if err != nil {
			return taskTarget{}, nil, usageError{redactErr(err, cfg)}
		}
		cl, err := client.New(rdb, q.Key)
		if err != nil {
			rdb.Close()
			return taskTarget{}, nil, usageError{err}
		}
		t := taskTarget{cl: cl}
		if !q.Durable {
			return t, func() { rdb.Close() }, nil
		}
		d, closeDB, err := durableTier(cfg, q, rdb, stderr)
		if err != nil {
			rdb.Close()
			return taskTarget{}, nil, err
		}
		t.durable = d
		return t, func() { closeDB(); rdb.Close() }, nil
	}
	return taskTarget{}, nil, usagef("no queue %q in ORDERDELAY_QUEUES_FILE (%q)", name, cfg.QueuesFile)
}
