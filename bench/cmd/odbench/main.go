// Command odbench runs orderdelay's side-by-side benchmark (issue 4): the
// PostgreSQL batched-UPDATE ceiling, the naive design with 1 and 16
// goroutines, asynq v0.26 and orderdelay (defaults and tuned), interleaved
// over rounds, against the local PostgreSQL (databases of its own, dropped
// afterwards) and a private redis-server it starts on a free port. It prints
// the tables (also written to results/report.md with results.json, plots
// and profiles) and exits 1 if any run broke correctness.
//
//	cd bench && go run ./cmd/odbench            # default: 100,000 orders, 3 rounds (~10 min)
//	cd bench && go run ./cmd/odbench -quick     # CI size, seconds
//	cd bench && go run ./cmd/odbench -full      # 1,000,000 orders
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/orderdelay/orderdelay/bench"
)

func main() {
	os.Exit(run())
}

func run() int {
	quick := flag.Bool("quick", false, "CI size: 2,000 orders, 1 round, 1.5 s of steady arrival")
	full := flag.Bool("full", false, "1,000,000 orders per drain and enqueue")
	mode := "default"
	for _, a := range os.Args[1:] {
		switch strings.TrimLeft(a, "-") {
		case "quick", "quick=true":
			mode = "quick"
		case "full", "full=true":
			mode = "full"
		}
	}
	o := bench.Defaults(mode)
	flag.IntVar(&o.N, "n", o.N, "expired orders per drain")
	flag.IntVar(&o.Rounds, "rounds", o.Rounds, "rounds (contenders interleaved)")
	flag.IntVar(&o.SlowCap, "slow-cap", o.SlowCap, "most orders given to the naive and asynq contenders")
	flag.DurationVar(&o.TimeBox, "timebox", o.TimeBox, "longest drain of a slow contender; its rate is taken then")
	flag.DurationVar(&o.SteadyFor, "steady", o.SteadyFor, "how long orders arrive in steady arrival")
	flag.IntVar(&o.SteadyRate, "rate", o.SteadyRate, "orders per second in steady arrival")
	flag.IntVar(&o.BigN, "big", o.BigN, "orders of the big drain (RSS, SLOWLOG, API, profiles); 0 skips it")
	flag.DurationVar(&o.IdleFor, "idle", o.IdleFor, "how long idle Redis traffic is counted")
	flag.IntVar(&o.Tuned.Workers, "tuned-workers", o.Tuned.Workers, "ORDERDELAY_WORKERS of orderdelay-tuned")
	flag.IntVar(&o.Tuned.BatchSize, "tuned-batch", o.Tuned.BatchSize, "ORDERDELAY_BATCH_SIZE of orderdelay-tuned")
	flag.Func("tuned-env", "another setting of orderdelay-tuned, NAME=value (repeatable): an A/B of one setting in one run", func(v string) error {
		name, _, ok := strings.Cut(v, "=")
		if !ok || !strings.HasPrefix(name, "ORDERDELAY_") {
			return fmt.Errorf("want ORDERDELAY_NAME=value, got %q", v)
		}
		o.Tuned.Env = append(o.Tuned.Env, v)
		return nil
	})
	noSweep := flag.Bool("no-sweep", false, "skip the batch size / workers sweep")
	flag.BoolVar(&o.Profile, "profile", o.Profile, "CPU and allocation profiles of the big drain")
	flag.StringVar(&o.OutDir, "out", o.OutDir, "results directory")
	flag.StringVar(&o.AdminURL, "database-url", o.AdminURL, "PostgreSQL role that may CREATE DATABASE (env ORDERDELAY_TEST_DATABASE_URL)")
	flag.StringVar(&o.RedisServer, "redis-server", o.RedisServer, "redis-server binary for the private server")
	flag.StringVar(&o.Binary, "bin", o.Binary, "prebuilt orderdelay binary (default: go build ../cmd/orderdelay)")
	flag.StringVar(&o.RepoRoot, "repo", o.RepoRoot, "orderdelay repository to build (default: the replaced module)")
	only := flag.String("only", "", "comma-separated steps to run: drain,sweep,big,steady,enqueue,idle (default all)")
	flag.Parse()
	if *only != "" {
		o.Only = strings.Split(*only, ",")
	}
	if *quick && *full {
		fmt.Fprintln(os.Stderr, "odbench: -quick and -full exclude each other")
		return 2
	}
	if *noSweep {
		o.Sweep = nil
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	rep, err := bench.Run(ctx, o)
	if rep != nil {
		fmt.Println(rep.Markdown())
		fmt.Printf("(%s; results in %s/)\n", time.Since(start).Round(time.Second), o.OutDir)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "odbench:", err)
		return 1
	}
	return 0
}
