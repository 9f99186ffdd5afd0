package queue_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// BenchmarkDrainScripts measures what a backlog drain costs Redis per
// order, on a private redis-server (other load on a shared one does not
// count): each op claims a batch of 500 due orders (batch lease), fences
// them and finishes them, as the order handler does for a batch whose
// orders all closed (FenceBatch, FinishBatch: a batch no script changed
// is not read back). The queue holds 100,000 due orders (refilled, off the
// clock, when it runs low).
//
// The figures are Redis's own, from INFO commandstats: the microseconds
// each script spent in the server per order (claim-µs/order,
// fence-µs/order, finish-µs/order, redis-µs/order their sum), and the
// in-script commands' share (hmget-µs/order, …). held=3 keeps three more
// batches leased while each is claimed, fenced and finished (four workers
// draining: the lease hash is never empty); held=0 has none.
//
// listpack= is the server's hash-max-listpack-entries: 512 is Redis's
// default, 128 a server that keeps only small hashes compact. With one
// batch of 500 leased and nothing else (held=0), the lease hash has at most
// 500 fields: under the default it stays a listpack, where each field an
// HSET, HMGET or HDEL names is found by a scan of the whole hash, so a
// batch's claim, fence and finish cost about 500 × 250 comparisons each;
// under 128 it is a hash table from the claim's first write. held=3 has
// 2,000 fields: a hash table under either.
//
//	go test -run '^$' -bench DrainScripts -benchtime 200x ./internal/queue/
func BenchmarkDrainScripts(b *testing.B) {
	for _, tc := range []struct{ held, listpack int }{{0, 512}, {0, 128}, {3, 512}} {
		b.Run(fmt.Sprintf("held=%d/listpack=%d", tc.held, tc.listpack), func(b *testing.B) { benchDrain(b, tc.held, tc.listpack) })
	}
}

const (
	benchBatch = 500
	benchQueue = 100_000
)

func benchDrain(b *testing.B, held, listpack int) {
	// hash-max-ziplist-entries: the name Redis 6.2 knows, still an alias in 7.x.
	rdb, _ := testenv.PrivateRedisWith(b, nil, "--hash-max-ziplist-entries", strconv.Itoa(listpack))
	ctx := context.Background()
	k := queue.NewKeys("delaytask:order")
	st := queue.NewStore(rdb, k)
	now, err := st.Now(ctx)
	if err != nil {
		b.Fatal(err)
	}
	base := queue.DeadlineMillis(now.Add(-time.Hour))
	next := 0
	fill := func(n int) {
		zs := make([]redis.Z, 0, 1000)
		for i := 0; i < n; i++ {
			zs = append(zs, redis.Z{Score: float64(base + int64(next%3_600_000)), Member: fmt.Sprintf("ORDB%016d", next)})
			next++
			if len(zs) == cap(zs) || i == n-1 {
				if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
					b.Fatal(err)
				}
				zs = zs[:0]
			}
		}
	}
	fill(benchQueue)
	seq := 0
	claim := func() (string, []string) {
		seq++
		tok := "orderdelay/bench-host/4242:n0nc3." + strconv.FormatInt(int64(seq), 36)
		res, err := st.Claim(ctx, queue.ClaimArgs{Limit: benchBatch, Lease: time.Minute, Token: tok, Batch: true})
		if err != nil {
			b.Fatal(err)
		}
		if len(res.Items) != benchBatch {
			b.Fatalf("claimed %d, want %d", len(res.Items), benchBatch)
		}
		ss := make([]string, len(res.Items))
		for i, it := range res.Items {
			ss[i] = it.Serial
		}
		return tok, ss
	}
	type lease struct {
		tok     string
		serials []string
	}
	var ring []lease
	for range held {
		tok, ss := claim()
		ring = append(ring, lease{tok, ss})
	}
	// Warm the script cache, then count from zero.
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	var spent [3]float64 // claim, fence, finish: µs in the server
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		if n, err := rdb.ZCard(ctx, k.Queue).Result(); err != nil {
			b.Fatal(err)
		} else if n < 2*benchBatch {
			fill(benchQueue - int(n))
		}
		u0 := evalUsec(b, rdb)
		b.StartTimer()
		tok, ss := claim()
		b.StopTimer()
		u1 := evalUsec(b, rdb)
		ring = append(ring, lease{tok, ss})
		l := ring[0]
		ring = ring[1:]
		b.StartTimer()
		drop, err := st.FenceBatch(ctx, l.tok, len(l.serials), 0, l.serials)
		if err != nil || len(drop) != 0 {
			b.Fatalf("fence: %v, dropped %d", err, len(drop))
		}
		b.StopTimer()
		u2 := evalUsec(b, rdb)
		b.StartTimer()
		n, err := st.FinishBatch(ctx, l.tok, len(l.serials), l.serials)
		if err != nil || n != len(l.serials) {
			b.Fatalf("finish: %v, removed %d of %d", err, n, len(l.serials))
		}
		b.StopTimer()
		u3 := evalUsec(b, rdb)
		spent[0] += u1 - u0
		spent[1] += u2 - u1
		spent[2] += u3 - u2
		b.StartTimer()
	}
	b.StopTimer()
	orders := float64(b.N * benchBatch)
	b.ReportMetric(spent[0]/orders, "claim-µs/order")
	b.ReportMetric(spent[1]/orders, "fence-µs/order")
	b.ReportMetric(spent[2]/orders, "finish-µs/order")
	b.ReportMetric((spent[0]+spent[1]+spent[2])/orders, "redis-µs/order")
	stats := commandStats(b, rdb)
	for _, c := range []string{"hmget", "zrange", "zrem", "zremrangebyrank", "zmscore", "hset", "hdel", "hlen"} {
		b.ReportMetric(stats[c]/orders, c+"-µs/order")
	}
	b.ReportMetric(0, "ns/op") // wall time includes the client; the figures above are the server's
}

// evalUsec is the server's total of microseconds spent in EVALSHA (and
// EVAL: a script not yet cached) so far.
func evalUsec(b *testing.B, rdb *redis.Client) float64 {
	s := commandStats(b, rdb)
	return s["evalsha"] + s["eval"]
}

// commandStats reads INFO commandstats: microseconds spent per command.
func commandStats(b *testing.B, rdb *redis.Client) map[string]float64 {
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(name, "cmdstat_") {
			continue
		}
		for _, f := range strings.Split(rest, ",") {
			if v, ok := strings.CutPrefix(f, "usec="); ok {
				out[strings.TrimPrefix(name, "cmdstat_")], _ = strconv.ParseFloat(v, 64)
			}
		}
	}
	return out
}
