package tasks

import (
	"os"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// PostgreSQL hangs (its connections open, its answers held: a stuck
// primary, a partition without RST) while a sql task's statement runs,
// and the daemon is stopped. The stop must still end within its bound
// (deploy/README.md: with the drain timeout, the Redis calls' read
// timeouts, the HTTP shutdown and the pools' 2 s each, inside
// terminationGracePeriodSeconds), leaving the batch to its lease as a
// crash would: lib/pq cannot cut a read (the drain's cancel only sends a
// cancel request, whose answer is held too), so a stop that waits for the
// batch waits for as long as PostgreSQL does, and the kubelet kills the
// pod at the grace period with its other queues' hand-backs undone.
//
// The consumer's part of the bound, with a 300 ms drain: the scan loop's
// Redis call in flight, the drain, the batch's call in flight and the
// hand-back, about 15 s at go-redis's 5 s read timeout; the test allows
// 20 s, then lets PostgreSQL answer so the stop can end.
func TestAdvShutdownWithPostgresHangingEndsWithinItsBound(t *testing.T) {
	if os.Getenv("ORDERDELAY_ADV_REPRO") != "1" {
		t.Skip("fails as the daemon stands: Consumer.Run (and the lifecycle's stop of the work stage) waits for a batch " +
			"stuck in a PostgreSQL read without a bound; ORDERDELAY_ADV_REPRO=1 runs it")
	}
	t.Parallel()
	direct, via, _, px := testenv.PostgresViaProxy(t)
	if _, err := direct.Exec(`CREATE TABLE shut_done (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	s := newShutdownEnv(t, `lease: 1m, action: {type: sql, statement: "INSERT INTO shut_done SELECT x FROM unnest($1::text[]) x, pg_sleep(30) RETURNING id"}`, via)
	due := time.Now().Add(-time.Second).Truncate(time.Millisecond)
	s.put("p", 2, due)
	stop := s.run(300 * time.Millisecond)
	eventually(t, "the batch's statement running", func() bool {
		var n int
		if err := direct.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%pg_sleep(30)%' AND pid <> pg_backend_pid()`); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	px.Stall(time.Hour) // every answer PostgreSQL sends from now on is held
	t.Cleanup(func() { px.Stall(0) })
	stopped := make(chan struct{})
	began := time.Now()
	go func() { defer close(stopped); stop() }()
	const bound = 20 * time.Second
	select {
	case <-stopped:
		return
	case <-time.After(bound):
	}
	px.Stall(0)
	<-stopped
	t.Errorf("with PostgreSQL's answers held, the stop did not end within %v; it ended %v after it began, once PostgreSQL answered",
		bound, time.Since(began).Round(time.Millisecond))
}
