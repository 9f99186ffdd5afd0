package consumer

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Scripts do bounded work: the stats and claim scripts read batch members'
// lease records one by one, and a batch's member list names every member
// it was given, not only those it still holds. These tests count, with
// MONITOR on a private Redis, how many lease records one call reads.

// privateEnv is an env on a private Redis (MONITOR sees every command of
// the server), and the server's address.
func privateEnv(t *testing.T) (*env, string) {
	t.Helper()
	rdb, addr := testenv.PrivateRedis(t)
	keys := queue.NewKeys("advbound:order")
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return &env{Env: testenv.Env{T: t, RDB: rdb, Keys: keys}, m: metrics.New(prometheus.NewRegistry(), "test", "test"), cl: cl}, addr
}

// recordsRead runs fn and returns how many fields of key scripts read with
// HMGET meanwhile (MONITOR's "[0 lua]" lines). A PING sent after fn marks
// the end of its commands in the stream.
func recordsRead(t *testing.T, addr, key string, fn func()) int {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rd := bufio.NewReaderSize(conn, 1<<20)
	if _, err := conn.Write([]byte("MONITOR\r\n")); err != nil {
		t.Fatal(err)
	}
	if l, err := rd.ReadString('\n'); err != nil || !strings.HasPrefix(l, "+OK") {
		t.Fatalf("MONITOR: %q, %v", l, err)
	}
	fn()
	marker := fmt.Sprintf("end-of-%d", time.Now().UnixNano())
	other := redis.NewClient(&redis.Options{Addr: addr})
	defer other.Close()
	if err := other.Echo(context.Background(), marker).Err(); err != nil {
		t.Fatal(err)
	}
	n := 0
	prefix := `"HMGET" "` + key + `" `
	for {
		l, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(l, marker) {
			return n
		}
		if i := strings.Index(l, prefix); i >= 0 && strings.Contains(l, " lua] ") {
			n += strings.Count(l[i+len(prefix):], `" "`) + 1
		}
	}
}

// leaseBatches claims batches batches of size due members each, and
// finishes all but left members of each.
func (e *env) leaseBatches(batches, size, left int) {
	e.T.Helper()
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	for b := range batches {
		ss := make([]string, size)
		for i := range ss {
			ss[i] = fmt.Sprintf("bound-%03d-%04d", b, i)
		}
		e.Enqueue(ss, past)
		c := e.consumer(Config{BatchSize: size})
		res, err := c.claimBatch(ctx)
		if err != nil || len(res.items) != size {
			e.T.Fatalf("claim: %v, %d items", err, len(res.items))
		}
		c.finish(res.items[:size-left])
	}
}

// Three replicas of four workers hold twelve batches of 500, each partly
// settled (isolating a locked row order by order settles a batch one
// member at a time): they hold 1,800, but their lists name 6,000. The
// gauges read at most 2,000 records.
func TestAdvLeaseStatsReadBoundedRecordsOfPartlySettledBatches(t *testing.T) {
	t.Parallel()
	e, addr := privateEnv(t)
	e.leaseBatches(12, 500, 150)
	var st queue.Stats
	n := recordsRead(t, addr, e.Keys.Lease, func() {
		var err error
		if st, err = queue.ReadStats(context.Background(), e.RDB, e.Keys); err != nil {
			t.Fatal(err)
		}
	})
	if st.Held != 1800 || st.Overdue != 1800 {
		t.Errorf("stats %+v, want 1800 held and overdue", st)
	}
	if n > 2000 {
		t.Errorf("the stats script read %d lease records, want at most 2000", n)
	}
}

// Twenty expired batches each count one member they no longer hold (an
// older client moved it during the lease: it dropped the record without
// counting it off the batch) and nothing else: a claim of 500 reads at
// most twice its limit in records, and later claims drop the rest.
func TestAdvLeaseClaimReadsBoundedRecordsOfExpiredBatches(t *testing.T) {
	t.Parallel()
	e, addr := privateEnv(t)
	ctx := context.Background()
	e.leaseBatches(20, 500, 1)
	later := float64(queue.DeadlineMillis(e.RedisNow().Add(time.Hour)))
	for b := range 20 {
		s := fmt.Sprintf("bound-%03d-%04d", b, 499)
		e.RDB.HDel(ctx, e.Keys.Lease, s)
		e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: later, Member: s})
	}
	toks, err := e.RDB.ZRange(ctx, e.Keys.Leases, 0, -1).Result()
	if err != nil || len(toks) != 20 {
		t.Fatalf("%d batch leases (%v), want 20", len(toks), err)
	}
	for _, tok := range toks {
		e.RDB.ZAdd(ctx, e.Keys.Leases, redis.Z{Score: 1, Member: tok})
	}
	c := e.consumer(Config{BatchSize: 500})
	var res claimResult
	n := recordsRead(t, addr, e.Keys.Lease, func() {
		if res, err = c.claimBatch(ctx); err != nil {
			t.Fatal(err)
		}
	})
	if len(res.items) != 0 {
		t.Fatalf("claimed %d, want nothing", len(res.items))
	}
	if n > 1000 {
		t.Errorf("one claim read %d lease records, want at most 1000 (twice its limit)", n)
	}
	for range 20 {
		if e.card(e.Keys.Leases) == 0 {
			break
		}
		if _, err := c.claimBatch(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if k := e.card(e.Keys.Leases); k != 0 {
		t.Errorf("%d expired batch leases left after 20 claims, want 0", k)
	}
	if k, _ := e.RDB.HLen(ctx, e.Keys.LeaseBatch).Result(); k != 0 {
		t.Errorf("%d batch fields left, want 0", k)
	}
}
