package main

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The read timeout the stop's bound counts with is the Redis client's:
// go-redis's 5 s unless the URL says otherwise, none when it says -1.
func TestRedisReadTimeoutIsTheClients(t *testing.T) {
	for _, tc := range []struct {
		mode, url string
		want      time.Duration
	}{
		{"", "redis://127.0.0.1:6379/0", 5 * time.Second},
		{"", "redis://127.0.0.1:6379/0?read_timeout=7s", 7 * time.Second},
		{"", "redis://127.0.0.1:6379/0?read_timeout=-1", 0},
		{"sentinel", "redis://127.0.0.1:26379/0?master_name=m&read_timeout=2s", 2 * time.Second},
		{"cluster", "redis://127.0.0.1:7000?addr=127.0.0.1:7001", 5 * time.Second},
	} {
		if got := readTimeoutOf(testRedis(t, config.Config{RedisMode: tc.mode, RedisURL: tc.url})); got != tc.want {
			t.Errorf("%s %s: read timeout %v, want %v", tc.mode, tc.url, got, tc.want)
		}
	}
}

// The work stage's stop bound is what README's shutdown adds up, less the
// HTTP shutdown and the pools: 35 s of the 44 s with the defaults.
func TestWorkStopBoundIsTheDocumentedStop(t *testing.T) {
	cfg := config.Config{RedisURL: "redis://127.0.0.1:6379/0", DrainTimeout: 20 * time.Second}
	if got := workStopBoundOf(t, cfg); got != 35*time.Second {
		t.Errorf("work stage bound %v with the defaults, want 35s (read 5 + drain 20 + read 5 + hand-back 5)", got)
	}
	cfg.RedisURL += "?read_timeout=-1"
	if got := workStopBoundOf(t, cfg); got != 0 {
		t.Errorf("work stage bound %v with no read timeout, want 0 (none: nothing bounds a Redis read)", got)
	}
}

// PostgreSQL holds its replies (a stuck primary, a partition without RST)
// while a batch's close runs, and the daemon is stopped: lib/pq cannot cut
// the read, nor is the cancel request it sends answered. The stop must
// still end, once the work stage's bound has passed, with the batch left
// to its lease (still leased in Redis), the stages before it stopped, and
// runDaemon returning no failure.
func TestDaemonStopEndsWhilePostgresHoldsItsReplies(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	direct, _, dsn, px := testenv.PostgresViaProxy(t)
	t.Cleanup(func() { px.Stall(0) }) // runs first: the database can then be dropped
	ctx := context.Background()
	due := time.Now().Add(-time.Second)
	if _, err := direct.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ('hang-1', $1)`, due); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, keys.Queue, redis.Z{Score: float64(queue.DeadlineMillis(due)), Member: "hang-1"}).Err(); err != nil {
		t.Fatal(err)
	}
	// The close waits on a lock the test holds, so the batch is in flight
	// when PostgreSQL stops answering.
	lock, err := direct.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock(778)"); err != nil {
		t.Fatal(err)
	}
	cfg := daemonConfig(t, keys, dsn, map[string]string{
		"ORDERDELAY_REDIS_URL": redisURLWithReadTimeout(time.Second), "ORDERDELAY_CLOSE_SQL": lockedCloseSQL,
		"ORDERDELAY_STATEMENT_TIMEOUT": "50s", "ORDERDELAY_DRAIN_TIMEOUT": "300ms",
		"ORDERDELAY_RECONCILE_INTERVAL": "0",
	})
	d, stoppedStages := startStageRecording(t, cfg)
	awaitCloseOnTheLock(t, direct, d)
	px.Stall(time.Hour) // every answer PostgreSQL sends from now on is held
	d.cancel()
	select {
	case <-d.done:
	case <-time.After(2 * time.Minute): // a guard against a hang, not a budget: the bound is 7.3 s
		px.Stall(0)
		<-d.done
		t.Fatal("with PostgreSQL holding its replies the stop ended only once PostgreSQL answered")
	}
	if d.err != nil {
		t.Errorf("runDaemon = %v, want nil: a stop whose work stage was abandoned is no failure", d.err)
	}
	got := stoppedStages()
	if strings.Contains(strings.Join(got, ","), "work") || !strings.Contains(strings.Join(got, ","), "http") {
		t.Errorf("stages stopped %q: want the stages before work stopped, and work abandoned", got)
	}
	if n, _ := rdb.ZCard(ctx, keys.Leases).Result(); n != 1 {
		t.Errorf("%d batch leases after the stop, want the abandoned batch's one (its lease brings hang-1 back)", n)
	}
}

// startStageRecording starts the daemon of cfg and returns it with the
// names of the stages it has stopped so far.
func startStageRecording(t *testing.T, cfg config.Config) (*daemonRun, func() []string) {
	t.Helper()
	var (
		mu      sync.Mutex
		stopped []string
	)
	d := startDaemon(t, cfg, daemonOptions{stopped: func(stage string) {
		mu.Lock()
		defer mu.Unlock()
		stopped = append(stopped, stage)
	}})
	return d, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), stopped...)
	}
}

// awaitCloseOnTheLock waits until a close of lockedCloseSQL waits on the
// advisory lock the test holds (db reaches the daemon's database
// directly): the batch is in flight.
func awaitCloseOnTheLock(t *testing.T, db *sqlx.DB, d *daemonRun) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		var n int
		if err := db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%pg_advisory_xact_lock(778)%'`); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if d.ended() || time.Now().After(deadline) {
			t.Fatalf("the batch's close never waited on the lock (ended %v: %v)", d.ended(), d.err)
		}
	}
}

// testRedis is the client newRedis makes of cfg (it connects to nothing
// until used), closed when the test ends.
func testRedis(t *testing.T, cfg config.Config) redis.UniversalClient {
	t.Helper()
	rdb, err := newRedis(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// workStopBoundOf is the work stage's stop bound of a daemon of cfg
// without task queues.
func workStopBoundOf(t *testing.T, cfg config.Config) time.Duration {
	t.Helper()
	return (&daemon{cfg: cfg, rdb: testRedis(t, cfg)}).workStopBound()
}

// redisURLWithReadTimeout is the test Redis's URL with go-redis's read
// timeout set to d, so a stall costs d per call rather than 5 s.
func redisURLWithReadTimeout(d time.Duration) string {
	url := testenv.RedisURL()
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "read_timeout=" + d.String()
}
