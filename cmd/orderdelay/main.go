// Command orderdelay closes unpaid orders when their payment deadline
// passes. Checkout services put order serials on a Redis sorted set scored
// by deadline; orderdelay claims the due ones under a lease, closes the
// still-unpaid orders in PostgreSQL in batches, and removes them from the
// queue only after the close committed.
//
// Usage:
//
//	orderdelay run [--migrate] [flags]   the daemon
//	orderdelay migrate [flags]           apply the reference schema
//	orderdelay enqueue SERIAL --after 30m | --at TIME [--reschedule | --only-later]
//	orderdelay cancel SERIAL
//	orderdelay inspect [--json]          queue depth, overdue, next deadline, dead letters
//	orderdelay inspect --dead            dead-lettered entries with reason, attempts, last error
//	orderdelay requeue SERIAL... | --all put dead-lettered entries back
//	orderdelay inspect SERIAL            one order in Redis and in PostgreSQL
//	orderdelay pause | resume            stop and restart closing on every replica
//	orderdelay extend --within D --by D  move deadlines of a window later
//	orderdelay resync                    load pending orders into the queue
//	orderdelay purge --dead --older-than D
//	orderdelay demo [--duration 1m]      the daemon plus a simulated checkout, on its own database and keys
//	orderdelay version
//
// Every setting is an environment variable and a flag (see the README or
// `orderdelay run -h`). Exit status: 0 done, 1 failure, 2 bad usage or
// configuration.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"syscall"
)

// Set by the build: -ldflags "-X main.version=... -X main.revision=...".
var (
	version  = "dev"
	revision = "unknown"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.LookupEnv)
	stop()
	os.Exit(code)
}

// usageError is a command-line or configuration mistake: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

const usage = `orderdelay closes unpaid orders when their payment deadline passes.

Usage:
  orderdelay run [--migrate] [flags]     run the daemon
  orderdelay migrate [flags]             apply the reference schema (idempotent)
  orderdelay enqueue SERIAL (--after D | --at TIME) [--reschedule | --only-later]
  orderdelay cancel SERIAL               remove an order's timeout
  orderdelay inspect [--json]            queue depth, overdue orders, next deadline, dead letters
  orderdelay inspect --dead [--limit N]  dead-lettered entries with reason, attempts and last error
  orderdelay requeue SERIAL... | --all   put dead-lettered entries back on the queue, due now
  orderdelay inspect SERIAL [--json]     one order: its queue entry (state, lease, attempts) and its row

Named task queues (ORDERDELAY_QUEUES_FILE, see docs/tasks.md):
  orderdelay task put QUEUE ID (--after D | --at TIME) [--payload JSON] [--reschedule | --only-later]
  orderdelay task get QUEUE ID
  orderdelay task delete QUEUE ID...
  orderdelay task list QUEUE [--state pending|inflight|dead] [--limit N] [--after CURSOR] [--payload]
  orderdelay task dead QUEUE [--limit N] [--after CURSOR] [--payload]   dead letters, oldest first
  orderdelay task requeue QUEUE (ID... | --all)                          dead letters back, due now
  orderdelay task purge QUEUE (ID... | --all | --older-than D)           remove dead letters
  orderdelay task stats [QUEUE]          pending, due, inflight, dead, oldest overdue, paused
  orderdelay task pause QUEUE [--reason TEXT] | task resume QUEUE

Operator tools (see docs/operations.md):
  orderdelay pause [--reason TEXT]       stop closing on every replica; enqueues continue
  orderdelay resume                      close again
  orderdelay extend --within 1h --by 15m give orders due in the window more time (queue and rows)
  orderdelay resync [--rate N]           load pending orders from PostgreSQL into the queue (NX)
  orderdelay purge --dead --older-than D remove old dead letters (or --keep N)
  orderdelay demo [--duration D]         the daemon plus a simulated checkout (own database and keys)
  orderdelay version

Run "orderdelay COMMAND -h" for the flags of a command.
`

// run is main without the process: it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) (string, bool)) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch cmd, rest := args[0], args[1:]; cmd {
	case "run":
		err = cmdRun(ctx, rest, stderr, getenv)
	case "migrate":
		err = cmdMigrate(ctx, rest, stdout, stderr, getenv)
	case "enqueue":
		err = cmdEnqueue(ctx, rest, stdout, stderr, getenv)
	case "cancel":
		err = cmdCancel(ctx, rest, stdout, stderr, getenv)
	case "inspect":
		err = cmdInspect(ctx, rest, stdout, stderr, getenv)
	case "requeue":
		err = cmdRequeue(ctx, rest, stdout, stderr, getenv)
	case "pause":
		err = cmdPause(ctx, rest, stdout, stderr, getenv)
	case "resume":
		err = cmdResume(ctx, rest, stdout, stderr, getenv)
	case "extend":
		err = cmdExtend(ctx, rest, stdout, stderr, getenv)
	case "resync":
		err = cmdResync(ctx, rest, stdout, stderr, getenv)
	case "purge":
		err = cmdPurge(ctx, rest, stdout, stderr, getenv)
	case "task":
		err = cmdTask(ctx, rest, stdout, stderr, getenv)
	case "demo":
		err = cmdDemo(ctx, rest, stderr, getenv)
	case "version", "--version", "-version":
		fmt.Fprintf(stdout, "orderdelay %s (revision %s, %s)\n", version, revision, runtime.Version())
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
	default:
		fmt.Fprintf(stderr, "orderdelay: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	if err == nil {
		return 0
	}
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	fmt.Fprintf(stderr, "orderdelay: %v\n", err)
	var ue usageError
	if errors.As(err, &ue) {
		return 2
	}
	return 1
}
