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
//	orderdelay unbatch                   batch leases to per-member leases (before a rollback)
//	orderdelay demo [--duration 1m]      the daemon plus a simulated checkout, on its own database and keys
//	orderdelay version
//
// Every setting is an environment variable and a flag (see the README or
// `orderdelay run -h`, which lists them by group). Exit status: 0 done, 1
// failed (the command was right but could not be done), 2 bad usage or
// configuration; `orderdelay COMMAND -h` says which failures each command
// has.
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
	"slices"
	"strings"
	"syscall"
)

// Set by the build: -ldflags "-X main.version=... -X main.revision=...".
var (
	version  = "dev"
	revision = "unknown"
)

func main() {
	ctx, stop := context.Background(), func() {}
	if len(os.Args) < 2 || !isDaemon(os.Args[1]) {
		// The daemon catches SIGTERM and SIGINT itself, as one of its
		// actors (see actors); every other command stops on them.
		ctx, stop = signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	}
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.LookupEnv)
	stop()
	os.Exit(code)
}

// isDaemon reports whether the command runs the daemon.
func isDaemon(cmd string) bool { return cmd == "run" || cmd == "demo" }

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
  orderdelay task pause QUEUE [--reason TEXT]
  orderdelay task resume QUEUE

Operator tools (see docs/operations.md):
  orderdelay pause [--reason TEXT]       stop closing on every replica; enqueues continue
  orderdelay resume                      close again
  orderdelay extend --within 1h --by 15m give orders due in the window more time (queue and rows)
  orderdelay resync [--rate N]           load pending orders from PostgreSQL into the queue (NX)
  orderdelay purge --dead --older-than D remove old dead letters (or --keep N)
  orderdelay unbatch [--json]            turn batch leases into per-member leases (rollback)
  orderdelay demo [--duration D]         the daemon plus a simulated checkout (own database and keys)
  orderdelay version

Every setting is an environment variable and a flag, grouped in
"orderdelay run -h"; the full table is README.md#configuration.
Run "orderdelay COMMAND -h" (or "orderdelay help COMMAND") for a command's
flags and settings.

` + exitStatusHelp

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
	case "unbatch":
		err = cmdUnbatch(ctx, rest, stdout, stderr, getenv)
	case "task":
		err = cmdTask(ctx, rest, stdout, stderr, getenv)
	case "demo":
		err = cmdDemo(ctx, rest, stderr, getenv)
	case "version", "--version", "-version":
		err = cmdVersion(rest, stdout)
	case "-h", "--help", "-help":
		fmt.Fprint(stdout, usage)
	case "help":
		if len(rest) == 0 || strings.HasPrefix(rest[0], "-") {
			fmt.Fprint(stdout, usage)
			return 0
		}
		return run(ctx, append(slices.Clone(rest), "-h"), stdout, stderr, getenv) // help COMMAND [VERB]
	default:
		fmt.Fprintf(stderr, "orderdelay: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	return exitStatus(err, args, stdout, stderr)
}

// exitStatus reports err and maps it to the exit status: 0 done (or help
// asked for, printed on stdout), 2 a usageError (bad usage or
// configuration), 1 anything else (the command could not be done).
func exitStatus(err error, args []string, stdout, stderr io.Writer) int {
	var help helpRequested
	switch {
	case err == nil:
		return 0
	case errors.As(err, &help):
		fmt.Fprint(stdout, help.text)
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	}
	fmt.Fprintf(stderr, "orderdelay: %v\n", err)
	var ue usageError
	if !errors.As(err, &ue) {
		return 1
	}
	name := args[0]
	if name == "task" && len(args) > 1 && isTaskVerb(args[1]) {
		name += " " + args[1]
	}
	fmt.Fprintf(stderr, "Run \"orderdelay %s -h\" for its usage, flags and settings.\n", name)
	return 2
}

// cmdVersion is `orderdelay version`.
func cmdVersion(args []string, stdout io.Writer) error {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help") {
		return helpRequested{"Usage:\n" + strings.Join(synopsis("version"), "\n") + "\n\n" + exitStatusHelp}
	}
	if len(args) > 0 {
		return usagef("version takes no arguments, got %q", args)
	}
	fmt.Fprintf(stdout, "orderdelay %s (revision %s, %s)\n", version, revision, runtime.Version())
	return nil
}
