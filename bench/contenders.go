package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/lifecycle"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// The SQL of the comparison contenders. Both are conditional on
// status = 'pending', as the reference measurements were, so the
// comparison is about round trips and batching, not about a weaker guard.
const (
	// ceilingSQL is the PostgreSQL batched-UPDATE ceiling: 1,000 serials per
	// statement, the shape the daemon's close statement has.
	ceilingSQL = `UPDATE orders SET status = 'closed', closed_at = now(), close_reason = 'timeout'
WHERE serial_no = ANY($1) AND status = 'pending' RETURNING serial_no`
	// singleCloseSQL is the single-row conditional UPDATE of the naive
	// design and of the asynq handler.
	singleCloseSQL = `UPDATE orders SET status = 'closed', closed_at = now(), close_reason = 'timeout'
WHERE serial_no = $1 AND status = 'pending'`
	// naiveSelectSQL is the naive design's payment check.
	naiveSelectSQL = `SELECT status FROM orders WHERE serial_no = $1`

	ceilingBatch = 1000
	// orderdelayLimit bounds an orderdelay drain; it has to finish.
	orderdelayLimit = 5 * time.Minute
	ceilingConns    = 4
)

const (
	benchKey    = "bench:order" // the queue key of every orderdelay and naive run
	stagingKey  = "bench:staging"
	asynqTask   = "order:close"
	naiveScan   = 5 * time.Second
	naiveKeyFmt = "bench:naive"
)

// openPool opens a pool of exactly n connections, all established before
// the clock starts (database/sql keeps only 2 idle by default; the pool
// would otherwise reconnect on every burst).
func openPool(ctx context.Context, dsn string, n int) (*sql.DB, error) {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(n)
	db.SetMaxIdleConns(n)
	conns := make([]*sql.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range n {
		c, err := db.Conn(ctx)
		if err != nil {
			db.Close()
			return nil, err
		}
		if err := c.PingContext(ctx); err != nil {
			db.Close()
			return nil, err
		}
		conns = append(conns, c)
	}
	return db, nil
}

// drainCtx is what every drain contender is given: a fresh database holding
// the orders, and the harness.
type drainCtx struct {
	e       *env
	dbName  string
	dsn     string
	set     *orderSet
	timebox time.Duration
}

// drainOut is what a contender measured.
type drainOut struct {
	handled  int // orders taken care of (closed or found settled)
	reported int // closes the contender's statements reported
	elapsed  time.Duration
	cpu      CPU
	timedOut bool
	extra    func(*DrainResult)
}

// --- PostgreSQL batched-UPDATE ceiling ---

func drainCeiling(ctx context.Context, dc drainCtx) (drainOut, error) {
	pool, err := openPool(ctx, dc.dsn, ceilingConns)
	if err != nil {
		return drainOut{}, err
	}
	defer pool.Close()
	jobs := make(chan []string)
	var closed atomic.Int64
	var firstErr error
	var once sync.Once
	meter := startCPU(dc.e.redis.Pid, 0)
	start := time.Now()
	var wg sync.WaitGroup
	for range ceilingConns {
		wg.Go(func() {
			for chunk := range jobs {
				n, err := countRows(ctx, pool, ceilingSQL, pq.Array(chunk))
				if err != nil {
					once.Do(func() { firstErr = err })
					continue
				}
				closed.Add(int64(n))
			}
		})
	}
	for i := 0; i < dc.set.Len(); i += ceilingBatch {
		jobs <- dc.set.Serials[i:min(i+ceilingBatch, dc.set.Len())]
	}
	close(jobs)
	wg.Wait()
	out := drainOut{handled: dc.set.Len(), reported: int(closed.Load()), elapsed: time.Since(start)}
	out.cpu = meter.stop(dc.e.pg.pgPidsOf(ctx, dc.dbName))
	return out, firstErr
}

func countRows(ctx context.Context, db *sql.DB, q string, args ...any) (int, error) {
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Err()
}

// --- the naive design (seed 003, ported literally) ---

// naive is the articles' loop: every scan interval, ZRANGEBYSCORE 0..now
// takes every due serial; a pool of goroutines does, per serial, a SELECT of
// the order, an UPDATE when it is unpaid, and a ZREM. The next scan starts
// after the pool finished the previous one.
type naive struct {
	rdb      *redis.Client
	db       *sql.DB
	key      string
	workers  int
	interval time.Duration
	handled  atomic.Int64
	closed   atomic.Int64
	errs     atomic.Int64
}

// run loops until ctx ends; with scanFirst it scans at once (a drain),
// otherwise it sleeps first, as the article's thread does.
func (n *naive) run(ctx context.Context, scanFirst bool) {
	if !scanFirst && !lifecycle.Sleep(ctx, n.interval) {
		return
	}
	for ctx.Err() == nil {
		now := strconv.FormatInt(time.Now().UnixMilli(), 10)
		due, err := n.rdb.ZRangeByScore(ctx, n.key, &redis.ZRangeBy{Min: "0", Max: now}).Result()
		if err != nil {
			n.errs.Add(1)
		}
		jobs := make(chan string)
		var wg sync.WaitGroup
		for range n.workers {
			wg.Go(func() {
				for s := range jobs {
					n.one(ctx, s)
				}
			})
		}
	feed:
		for _, s := range due {
			select {
			case jobs <- s:
			case <-ctx.Done():
				break feed
			}
		}
		close(jobs)
		wg.Wait()
		if !lifecycle.Sleep(ctx, n.interval) {
			return
		}
	}
}

func (n *naive) one(ctx context.Context, s string) {
	// An order already started is finished even when the time box ends,
	// so the closes it reports match the table.
	ctx = context.WithoutCancel(ctx)
	var status string
	if err := n.db.QueryRowContext(ctx, naiveSelectSQL, s).Scan(&status); err != nil {
		n.errs.Add(1)
		return
	}
	if status == "pending" {
		res, err := n.db.ExecContext(ctx, singleCloseSQL, s)
		if err != nil {
			n.errs.Add(1)
			return
		}
		k, _ := res.RowsAffected()
		n.closed.Add(k)
	}
	if err := n.rdb.ZRem(ctx, n.key, s).Err(); err != nil {
		n.errs.Add(1)
		return
	}
	n.handled.Add(1)
}

func drainNaive(workers int) func(context.Context, drainCtx) (drainOut, error) {
	return func(ctx context.Context, dc drainCtx) (drainOut, error) {
		e := dc.e
		if err := zaddAll(ctx, e.rdb, naiveKeyFmt, dc.set, 0, dc.set.Len()); err != nil {
			return drainOut{}, err
		}
		pool, err := openPool(ctx, dc.dsn, workers)
		if err != nil {
			return drainOut{}, err
		}
		defer pool.Close()
		n := &naive{rdb: e.rdb, db: pool, key: naiveKeyFmt, workers: workers, interval: naiveScan}
		runCtx, cancel := context.WithTimeout(ctx, dc.timebox)
		defer cancel()
		meter := startCPU(e.redis.Pid, 0)
		start := time.Now()
		done := make(chan struct{})
		go func() { defer close(done); n.run(runCtx, true) }()
		var elapsed time.Duration
		timedOut := false
		for {
			if int(n.handled.Load()) >= dc.set.Len() {
				elapsed = time.Since(start)
				break
			}
			if runCtx.Err() != nil {
				elapsed, timedOut = dc.timebox, true
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
		handled := int(n.handled.Load())
		cancel()
		<-done
		out := drainOut{handled: handled, elapsed: elapsed, timedOut: timedOut}
		out.cpu = meter.stop(e.pg.pgPidsOf(ctx, dc.dbName))
		out.reported = int(n.closed.Load())
		if k := n.errs.Load(); k > 0 {
			return out, fmt.Errorf("naive: %d errors", k)
		}
		return out, nil
	}
}

// --- asynq v0.26 scheduled tasks ---

// asynqServer runs an asynq server with concurrency 16 whose handler does
// the single-row conditional UPDATE.
type asynqServer struct {
	srv     *asynq.Server
	handled atomic.Int64
	closed  atomic.Int64
	errs    atomic.Int64
	target  int64
	done    chan struct{}
	once    sync.Once
}

type quietLogger struct{}

func (quietLogger) Debug(...any) {}
func (quietLogger) Info(...any)  {}
func (quietLogger) Warn(...any)  {}
func (quietLogger) Error(...any) {}
func (quietLogger) Fatal(...any) {}

func startAsynq(addr string, db *sql.DB, target int) *asynqServer {
	a := &asynqServer{target: int64(target), done: make(chan struct{})}
	a.srv = asynq.NewServer(asynq.RedisClientOpt{Addr: addr}, asynq.Config{
		Concurrency: 16,
		Logger:      quietLogger{},
		LogLevel:    asynq.ErrorLevel,
	})
	mux := asynq.NewServeMux()
	mux.HandleFunc(asynqTask, func(ctx context.Context, t *asynq.Task) error {
		res, err := db.ExecContext(context.WithoutCancel(ctx), singleCloseSQL, string(t.Payload()))
		if err != nil {
			a.errs.Add(1)
			return err
		}
		k, _ := res.RowsAffected()
		a.closed.Add(k)
		if a.handled.Add(1) == a.target {
			a.once.Do(func() { close(a.done) })
		}
		return nil
	})
	if err := a.srv.Start(mux); err != nil {
		a.errs.Add(1)
	}
	return a
}

func (a *asynqServer) stop() { a.srv.Shutdown() }

// asynqEnqueue schedules every order of s in [from, to) at its deadline,
// from 16 goroutines (asynq's client writes one task per call).
func asynqEnqueue(ctx context.Context, cl *asynq.Client, s *orderSet, from, to int) error {
	var wg sync.WaitGroup
	var first atomic.Value
	next := atomic.Int64{}
	next.Store(int64(from))
	for range 16 {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= to {
					return
				}
				_, err := cl.EnqueueContext(ctx, asynq.NewTask(asynqTask, []byte(s.Serials[i])),
					asynq.ProcessAt(time.UnixMilli(s.Deadline[i])))
				if err != nil {
					first.CompareAndSwap(nil, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err, ok := first.Load().(error); ok {
		return err
	}
	return nil
}

func drainAsynq(ctx context.Context, dc drainCtx) (drainOut, error) {
	e := dc.e
	cl := asynq.NewClient(asynq.RedisClientOpt{Addr: e.redis.Addr})
	defer cl.Close()
	// Deadlines in the past: asynq puts the tasks straight into "pending".
	if err := asynqEnqueue(ctx, cl, dc.set, 0, dc.set.Len()); err != nil {
		return drainOut{}, fmt.Errorf("asynq enqueue: %w", err)
	}
	pool, err := openPool(ctx, dc.dsn, 16)
	if err != nil {
		return drainOut{}, err
	}
	defer pool.Close()
	meter := startCPU(e.redis.Pid, 0)
	start := time.Now()
	a := startAsynq(e.redis.Addr, pool, dc.set.Len())
	out := drainOut{}
	select {
	case <-a.done:
		out.elapsed = time.Since(start)
	case <-time.After(dc.timebox):
		out.elapsed, out.timedOut = dc.timebox, true
	}
	out.handled = int(a.handled.Load())
	pids := e.pg.pgPidsOf(ctx, dc.dbName)
	out.cpu = meter.stop(pids)
	a.stop()
	out.reported = int(a.closed.Load())
	if k := a.errs.Load(); k > 0 {
		return out, fmt.Errorf("asynq: %d errors", k)
	}
	return out, nil
}

// --- orderdelay, the real binary ---

func drainOrderdelay(s Settings, profileDir string) func(context.Context, drainCtx) (drainOut, error) {
	return func(ctx context.Context, dc drainCtx) (drainOut, error) {
		e := dc.e
		keys := queue.NewKeys(benchKey)
		// Load a staging key, start the daemon on an empty queue, then
		// RENAME the backlog into place and publish its head: the clock
		// measures closing, not loading or start-up.
		if err := zaddAll(ctx, e.rdb, stagingKey, dc.set, 0, dc.set.Len()); err != nil {
			return drainOut{}, err
		}
		d, err := e.startDaemon(ctx, dc.dbName, benchKey, s, profileDir != "")
		if err != nil {
			return drainOut{}, err
		}
		defer d.kill()
		before, err := d.metrics(ctx, "go_memstats_alloc_bytes_total", "go_memstats_mallocs_total")
		if err != nil {
			return drainOut{}, err
		}
		if err := traceCommands(ctx, e.rdb, true); err != nil {
			return drainOut{}, err
		}
		defer traceCommands(context.WithoutCancel(ctx), e.rdb, false) //nolint:errcheck // next run resets it too
		probe := startProbe(d.HTTPAddr, 50*time.Millisecond)
		var profErr chan error
		if profileDir != "" {
			profErr = make(chan error, 1)
			// Long enough for the whole drain: idle time adds no samples.
			rate := e.expectRate
			if rate <= 0 {
				rate = 50_000
			}
			secs := max(1, int(1.2*float64(dc.set.Len())/rate+1))
			go func() {
				profErr <- fetch(ctx, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", d.PprofAddr, secs),
					filepath.Join(profileDir, "cpu-drain.pprof"))
			}()
		}
		meter := startCPU(e.redis.Pid, d.Pid)
		start := time.Now()
		_, err = e.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
			p.Rename(ctx, stagingKey, keys.Queue)
			p.Publish(ctx, keys.Wake, dc.set.Deadline[0])
			return nil
		})
		if err != nil {
			probe.stop()
			return drainOut{}, err
		}
		out := drainOut{}
		for {
			c, err := e.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				p.ZCard(ctx, keys.Queue)
				p.ZCard(ctx, keys.Inflight)
				p.ZCard(ctx, keys.Leases) // batch leases: one entry per claim
				return nil
			})
			if err != nil {
				probe.stop()
				return out, err
			}
			left := int(c[0].(*redis.IntCmd).Val() + c[1].(*redis.IntCmd).Val() + c[2].(*redis.IntCmd).Val())
			if left == 0 {
				out.elapsed = time.Since(start)
				out.handled = dc.set.Len()
				break
			}
			// orderdelay is never time-boxed: it must finish, and a drain
			// that takes this long fails the run.
			if time.Since(start) > orderdelayLimit {
				out.elapsed, out.timedOut = time.Since(start), true
				out.handled = dc.set.Len() - left
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
		out.cpu = meter.stop(e.pg.pgPidsOf(ctx, dc.dbName))
		probe.stop()
		slow := slowlog(ctx, e.rdb)
		rss := procStatusKB(d.Pid, "VmHWM")
		if profErr != nil {
			if err := <-profErr; err != nil {
				return out, fmt.Errorf("cpu profile: %w", err)
			}
			if err := fetch(ctx, "http://"+d.PprofAddr+"/debug/pprof/allocs", filepath.Join(profileDir, "allocs-drain.pprof")); err != nil {
				return out, fmt.Errorf("alloc profile: %w", err)
			}
		}
		after, err := d.metrics(ctx, "go_memstats_alloc_bytes_total", "go_memstats_mallocs_total",
			"orderdelay_orders_closed_total", "orderdelay_orders_reconciled_total", "orderdelay_dead_lettered_total",
			"orderdelay_errors_total")
		if err != nil {
			return out, err
		}
		out.reported = int(after["orderdelay_orders_closed_total"])
		n := float64(dc.set.Len())
		out.extra = func(r *DrainResult) {
			r.RSSKB = rss
			r.APIMaxMs, r.APICalls, r.APIFailures = probe.MaxMs, probe.Calls, probe.Failure
			r.SlowMaxMicros, r.SlowOver10ms, r.SlowestCmd = slow.MaxMicros, slow.Over10ms, slow.Slowest
			r.RedisMicrosPerOrder = map[string]float64{}
			for k, us := range slow.Micros {
				r.RedisMicrosPerOrder[k] = float64(us) / n
			}
			r.RedisCalls = slow.Calls
			if slow.Truncated {
				r.RedisMicrosPerOrder["(log truncated)"] = 0
			}
			r.AllocBytesPerOrder = (after["go_memstats_alloc_bytes_total"] - before["go_memstats_alloc_bytes_total"]) / n
			r.MallocsPerOrder = (after["go_memstats_mallocs_total"] - before["go_memstats_mallocs_total"]) / n
			if k := after["orderdelay_orders_reconciled_total"]; k > 0 {
				r.Verdict.Violations = append(r.Verdict.Violations, fmt.Sprintf("reconciler closed %v orders (fast path lost them)", k))
			}
			if k := after["orderdelay_dead_lettered_total"]; k > 0 {
				r.Verdict.Violations = append(r.Verdict.Violations, fmt.Sprintf("%v orders dead-lettered", k))
			}
			if k := after["orderdelay_errors_total"]; k > 0 {
				r.Verdict.Violations = append(r.Verdict.Violations, fmt.Sprintf("%v errors counted by the daemon", k))
			}
		}
		if err := d.stop(); err != nil {
			return out, err
		}
		return out, nil
	}
}

var errViolation = errors.New("correctness violation")
