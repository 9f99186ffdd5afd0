package e2e

// Sharded queues (issue 8, parts 3 and 4): ORDERDELAY_QUEUE_SHARDS on a
// real 3-master Redis Cluster and on standalone Redis, the migration of a
// live queue from one key to shards, and the Redis cost per order that
// docs/scaling.md derives its capacity figures from.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

const testShards = 4

// shardedWorld is a world whose order queue is sharded: all lists the
// queue key's keys, then the shards'; rdb reaches every one of them (a
// cluster client on a cluster).
type shardedWorld struct {
	*world
	rdb     redis.UniversalClient
	all     []queue.Keys
	mode    string // ORDERDELAY_REDIS_MODE
	cluster *testenv.Cluster
}

func newShardedWorld(t *testing.T, w *world, rdb redis.UniversalClient, mode string, c *testenv.Cluster) *shardedWorld {
	t.Helper()
	all := append([]queue.Keys{w.keys}, queue.ShardKeys(w.keys.Queue, testShards)...)
	t.Cleanup(func() {
		for _, k := range all[1:] {
			testenv.DeleteQueue(rdb, k)
		}
	})
	return &shardedWorld{world: w, rdb: rdb, all: all, mode: mode, cluster: c}
}

// settings are the daemon settings of the world's engine and shards.
func (s *shardedWorld) settings(extra ...string) []string {
	return append([]string{"ORDERDELAY_REDIS_MODE=" + s.mode, "ORDERDELAY_QUEUE_SHARDS=" + strconv.Itoa(testShards)}, extra...)
}

// lens returns the entries (queued or leased) of each key, the queue key's
// first.
func (s *shardedWorld) lens() []int64 {
	s.t.Helper()
	ctx := context.Background()
	out := make([]int64, len(s.all))
	for i, k := range s.all {
		n, err := s.rdb.ZCard(ctx, k.Queue).Result()
		if err != nil {
			s.t.Fatal(err)
		}
		out[i] = n + held(s.t, s.rdb, k)
	}
	return out
}

func (s *shardedWorld) total() int64 {
	var n int64
	for _, l := range s.lens() {
		n += l
	}
	return n
}

func (s *shardedWorld) zadd(key string, serials []string, deadline time.Time) {
	s.t.Helper()
	z := make([]redis.Z, len(serials))
	for i, sr := range serials {
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(deadline)), Member: sr}
	}
	if err := s.rdb.ZAdd(context.Background(), key, z...).Err(); err != nil {
		s.t.Fatal(err)
	}
}

// cli runs an orderdelay command with the world's engine and shards.
func (s *shardedWorld) cli(args ...string) string {
	s.t.Helper()
	return s.world.cli(append(args, "--redis-mode", s.mode, "--queue-shards", strconv.Itoa(testShards))...)
}

// TestShardKeysOnARealCluster proves the key layout with CLUSTER KEYSLOT:
// a shard and all its companions share one slot, the shards and the queue
// key are in distinct slots, and the shards spread over all three masters.
func TestShardKeysOnARealCluster(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateCluster(t)
	ctx := context.Background()
	node := redis.NewClient(&redis.Options{Addr: c.Addrs[0]})
	defer node.Close()
	slotOf := func(key string) int64 {
		s, err := node.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, base := range []string{queue.DefaultKey, "shop-7:orders"} {
		for _, shards := range []int{4, 16} {
			all := append([]queue.Keys{queue.NewKeys(base)}, queue.ShardKeys(base, shards)...)
			slots := map[int64]string{}
			masters := map[string]int{}
			for _, k := range all {
				slot := slotOf(k.Queue)
				if int64(queue.HashSlot(k.Queue)) != slot {
					t.Errorf("queue.HashSlot(%q) = %d, CLUSTER KEYSLOT says %d", k.Queue, queue.HashSlot(k.Queue), slot)
				}
				for _, comp := range []string{k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch, k.Dead, k.DeadInfo, k.Wake, k.Paused, k.Events} {
					if got := slotOf(comp); got != slot {
						t.Errorf("%s is in slot %d, its queue %s in %d", comp, got, k.Queue, slot)
					}
				}
				if other, dup := slots[slot]; dup {
					t.Errorf("%s and %s share slot %d", other, k.Queue, slot)
				}
				slots[slot] = k.Queue
				if k.Queue != base {
					addr, err := c.NodeFor(ctx, k.Queue)
					if err != nil {
						t.Fatal(err)
					}
					masters[addr]++
				}
			}
			if len(masters) != len(c.Addrs) {
				t.Errorf("%s, %d shards: on %d masters %v, want all %d", base, shards, len(masters), masters, len(c.Addrs))
			}
			t.Logf("%s, %d shards: shards per master %v", base, shards, masters)
		}
	}
	// The trap the layout avoids: a brace in the queue key changes what
	// Redis hashes, and its companions no longer share its slot.
	if slotOf("delaytask:order:{3}") == slotOf("{delaytask:order:{3}}:inflight") {
		t.Errorf("a braced shard key would share its companions' slot; the test's premise is wrong")
	}
}

// runSharded is the sharded integration scenario on one engine: two
// replicas with ORDERDELAY_QUEUE_SHARDS=4; orders enqueued through both
// replicas' HTTP API, the Go client with WithShards, raw ZADD to the shard
// keys (as a producer in another language would) and raw ZADD to the queue
// key (a producer that ignores sharding); 10% paid, 30 never enqueued.
// Every unpaid order is closed exactly once.
func runSharded(t *testing.T, s *shardedWorld, payWindow time.Duration) {
	ctx := context.Background()
	s.withAudit()
	settings := s.settings("ORDERDELAY_CLOSE_SQL="+auditClose, "ORDERDELAY_BATCH_SIZE=50",
		"ORDERDELAY_LEASE=2s", "ORDERDELAY_STATEMENT_TIMEOUT=1s", "ORDERDELAY_DRAIN_TIMEOUT=1s",
		"ORDERDELAY_RECONCILE_INTERVAL=500ms", "ORDERDELAY_RECONCILE_GRACE=3s")
	d1, d2 := s.start(settings...), s.start(settings...)
	if s.cluster != nil {
		// Every replica listens on every key's wake channel.
		for _, k := range s.all {
			waitFor(t, "both daemons subscribed to "+k.Wake, 10*time.Second, func() bool { return numsub(t, s.cluster, k.Wake) == 2 })
		}
	}

	const quarter = 300
	// Set up against a far deadline; it is moved near once all is in place.
	deadline := time.Now().Add(time.Hour)
	serials := s.createOrders("sh", 4*quarter, deadline)
	s.createOrders("never-enqueued", 30, deadline)
	api, goClient, rawShard, rawBase := serials[:quarter], serials[quarter:2*quarter], serials[2*quarter:3*quarter], serials[3*quarter:]

	putTimeouts(t, []*daemon{d1, d2}, api, deadline)
	cl, err := client.New(s.rdb, s.keys.Queue, client.WithShards(testShards))
	if err != nil {
		t.Fatal(err)
	}
	items := make([]client.Item, len(goClient))
	for i, sr := range goClient {
		items[i] = client.Item{Serial: sr, Deadline: deadline}
	}
	if _, err := cl.EnqueueMany(ctx, items, client.Create); err != nil {
		t.Fatalf("EnqueueMany: %v", err)
	}
	byShard := map[string][]string{}
	for _, sr := range rawShard {
		k := queue.KeyFor(s.keys.Queue, sr, testShards)
		byShard[k] = append(byShard[k], sr)
	}
	for k, ss := range byShard {
		s.zadd(k, ss, deadline)
	}
	s.zadd(s.keys.Queue, rawBase, deadline)
	lens := s.lens()
	if lens[0] != quarter {
		t.Errorf("the queue key holds %d entries, want the %d raw ZADDs to it", lens[0], quarter)
	}
	for i, n := range lens[1:] {
		if n < quarter*3/testShards/2 {
			t.Errorf("shard %d holds %d entries, want about %d", i, n, quarter*3/testShards)
		}
	}
	s.pay(slices.Concat(api[:30], goClient[:30], rawShard[:30], rawBase[:30]))
	keys := make([]string, len(s.all))
	for i, k := range s.all {
		keys[i] = k.Queue
	}
	moveDeadlines(t, s.db, s.rdb, keys, serials, time.Now().Add(payWindow))
	t.Logf("entries per key (queue key, then shards): %v", lens)

	waitFor(t, "every key drained", 60*time.Second, func() bool { return s.total() == 0 })
	waitFor(t, "the reconciler closes what was never enqueued", 30*time.Second, func() bool {
		return s.count("SELECT count(*) FROM orders WHERE status = 'pending'") == 0
	})
	s.checkInvariants()
	if n := s.closed(); n != 4*quarter-120+30 {
		t.Errorf("%d orders closed, want %d", n, 4*quarter-120+30)
	}
	if n := s.count("SELECT count(*) FROM orders WHERE status = 'paid'"); n != 120 {
		t.Errorf("%d orders paid, want the 120 untouched", n)
	}
	if dc := s.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	for name, want := range map[string]float64{
		"orderdelay_orders_closed_total":                    4*quarter - 120,
		`orderdelay_orders_skipped_total{reason="settled"}`: 120,
		"orderdelay_claimed_total":                          4 * quarter,
		"orderdelay_reclaimed_total":                        0,
		"orderdelay_enqueued_total":                         quarter,
		"orderdelay_orders_reconciled_total":                30,
	} {
		if v := sum(name, d1, d2); v != want {
			t.Errorf("%s summed over both replicas %v, want %v", name, v, want)
		}
	}
	p50, p99 := s.lateness("sh-%")
	t.Logf("fast-path lateness over %d closes: p50 %s, p99 %s; replica 1 closed %v, replica 2 closed %v", 4*quarter-120,
		p50.Round(time.Millisecond), p99.Round(time.Millisecond),
		d1.metrics()["orderdelay_orders_closed_total"], d2.metrics()["orderdelay_orders_closed_total"])

	// inspect covers every key; the gauges sum them.
	secs := s.createOrders("secs", 1, time.Now().Add(-time.Minute))
	if err := s.rdb.ZAdd(ctx, queue.KeyFor(s.keys.Queue, secs[0], testShards),
		redis.Z{Score: float64(time.Now().Unix()), Member: secs[0]}).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the seconds-for-milliseconds entry dead-lettered", 30*time.Second, func() bool {
		return sum(`orderdelay_dead_lettered_total{reason="score_out_of_range"}`, d1, d2) == 1
	})
	var got struct {
		Depth       int64 `json:"depth"`
		DeadLetters int64 `json:"dead_letters"`
		Shards      []struct {
			Shard int    `json:"shard"`
			Key   string `json:"key"`
			Slot  int    `json:"slot"`
			Dead  int64  `json:"dead_letters"`
		} `json:"shards"`
	}
	out := s.cli("inspect", "--json")
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("inspect --json: %v\n%s", err, out)
	}
	if got.Depth != 0 || got.DeadLetters != 1 || len(got.Shards) != testShards+1 {
		t.Errorf("inspect: depth %d, dead letters %d, %d keys; want 0, 1, %d:\n%s", got.Depth, got.DeadLetters, len(got.Shards), testShards+1, out)
	}
	for i, sh := range got.Shards {
		if sh.Shard != i-1 || sh.Key != s.all[i].Queue || sh.Slot != int(queue.HashSlot(sh.Key)) {
			t.Errorf("inspect key %d: %+v, want shard %d %s", i, sh, i-1, s.all[i].Queue)
		}
	}
	if out := s.cli("inspect", "--dead"); !strings.Contains(out, secs[0]) || !strings.Contains(out, "score_out_of_range") {
		t.Errorf("inspect --dead does not list %s from its shard:\n%s", secs[0], out)
	}
	if m := d1.metrics(); m["orderdelay_dead_letter_depth"] != 1 || m["orderdelay_queue_depth"] != 0 {
		t.Errorf("gauges: dead_letter_depth %v, queue_depth %v; want 1 and 0 (summed over keys)",
			m["orderdelay_dead_letter_depth"], m["orderdelay_queue_depth"])
	}
	// Pause reaches every shard's claim script; resume clears them all.
	s.cli("pause", "--reason", "shards test")
	for _, k := range s.all {
		if n, err := s.rdb.Exists(ctx, k.Paused).Result(); err != nil || n != 1 {
			t.Errorf("after pause, %s exists: %d (%v), want 1", k.Paused, n, err)
		}
	}
	s.cli("resume")
	for _, k := range s.all {
		if n, err := s.rdb.Exists(ctx, k.Paused).Result(); err != nil || n != 0 {
			t.Errorf("after resume, %s exists: %d (%v), want 0", k.Paused, n, err)
		}
	}

	if s.cluster != nil {
		noRoutingErrors(t, d1, d2)
	}
	for _, d := range []*daemon{d1, d2} {
		d.stopCleanly()
	}
}

func TestShardIntegrationStandalone(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	runSharded(t, newShardedWorld(t, w, w.rdb, "standalone", nil), 3*time.Second)
}

func TestShardIntegrationCluster(t *testing.T) {
	t.Parallel()
	c := testenv.PrivateCluster(t)
	key, node := keyOn(t, c, "shop-s:order", c.Addrs[0]) // the queue key is not on the node the daemons are given
	w := clusterWorld(t, c, key, node)
	runSharded(t, newShardedWorld(t, w, c.Client(t), "cluster", c), 4*time.Second)
}

// TestShardLiveMigration moves a live queue from one key to shards the way
// docs/scaling.md says: first the daemons (rolling restart with
// ORDERDELAY_QUEUE_SHARDS=4), then the producers. A backlog sits in the
// queue key before the switch and producers write throughout; the
// reconciler is off, so nothing the fast path loses could be hidden.
func TestShardLiveMigration(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	s := newShardedWorld(t, w, w.rdb, "standalone", nil)
	s.withAudit()
	ctx := context.Background()
	common := []string{"ORDERDELAY_CLOSE_SQL=" + auditClose, "ORDERDELAY_BATCH_SIZE=100", "ORDERDELAY_RECONCILE_INTERVAL=0",
		"ORDERDELAY_LEASE=3s", "ORDERDELAY_STATEMENT_TIMEOUT=2s", "ORDERDELAY_DRAIN_TIMEOUT=2s"}
	// Before: the unsharded deployment with a backlog spread over the
	// next seconds, all in the queue key.
	const backlog = 3000
	w.spread("pre", backlog, time.Now().Add(500*time.Millisecond), 6*time.Second)
	old := w.start(common...)

	// The checkout keeps creating orders (1 s to pay) and enqueueing them,
	// unsharded until told to switch.
	var sharded atomic.Bool
	shardedClient, err := client.New(w.rdb, w.keys.Queue, client.WithShards(testShards))
	if err != nil {
		t.Fatal(err)
	}
	plainClient, err := client.New(w.rdb, w.keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	producer := w.startCheckout("live", 10*time.Millisecond, 10, func(serials []string, due time.Time) error {
		items := make([]client.Item, len(serials))
		for j, sr := range serials {
			items[j] = client.Item{Serial: sr, Deadline: due}
		}
		cl := plainClient
		if sharded.Load() {
			cl = shardedClient
		}
		_, err := cl.EnqueueMany(ctx, items, client.Create)
		return err
	})

	time.Sleep(time.Second)
	// Step 1: the consumers. A rolling restart: a new replica with shards
	// comes up, then the old one is stopped (it hands back what it holds).
	n1 := w.start(append(common, "ORDERDELAY_QUEUE_SHARDS=4")...)
	time.Sleep(500 * time.Millisecond)
	if code := old.stop(); code != 0 {
		t.Errorf("old replica: exit status %d, want 0", code)
	}
	n2 := w.start(append(common, "ORDERDELAY_QUEUE_SHARDS=4")...)
	beforeSwitch := producer.produced.Load()
	time.Sleep(time.Second)
	// Step 2: the producers.
	sharded.Store(true)
	switched := producer.produced.Load()
	time.Sleep(2 * time.Second)
	total := producer.stop()
	if lens := s.lens(); slices.Max(lens[1:]) == 0 {
		t.Errorf("no entry in any shard after the producers switched: %v", lens)
	}

	waitFor(t, "the queue key and every shard drained", 60*time.Second, func() bool { return s.total() == 0 })
	w.checkInvariants()
	all := backlog + int(total)
	if n := w.closed(); n != all {
		t.Errorf("%d orders closed, want all %d (%d backlog + %d produced)", n, all, backlog, total)
	}
	if dc := w.doubleCloses(); dc != 0 {
		t.Errorf("%d orders closed twice", dc)
	}
	if n := w.count("SELECT count(*) FROM close_audit"); n != all {
		t.Errorf("%d closes audited, want %d", n, all)
	}
	var byReplica []string
	rows, err := w.db.Query("SELECT count(*) FROM close_audit GROUP BY replica ORDER BY min(at)")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var c int
		if err := rows.Scan(&c); err != nil {
			t.Fatal(err)
		}
		byReplica = append(byReplica, strconv.Itoa(c))
	}
	rows.Close()
	t.Logf("backlog %d in the queue key; %d enqueued unsharded (%d before the sharded replicas took over), %d to shards; closes per replica in order of start (old, new, new): %s",
		backlog, switched, beforeSwitch, total-switched, strings.Join(byReplica, ", "))
	for _, d := range []*daemon{n1, n2} {
		d.stopCleanly()
	}
}

// redisCPU is the CPU time (user + system, INFO cpu) of each server.
func redisCPU(t *testing.T, nodes []*redis.Client) []time.Duration {
	t.Helper()
	out := make([]time.Duration, len(nodes))
	for i, rdb := range nodes {
		info, err := rdb.Info(context.Background(), "cpu").Result()
		if err != nil {
			t.Fatal(err)
		}
		var total float64
		for _, line := range strings.Split(info, "\n") {
			for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
				if v, ok := strings.CutPrefix(strings.TrimSpace(line), f); ok {
					x, err := strconv.ParseFloat(v, 64)
					if err != nil {
						t.Fatal(err)
					}
					total += x
				}
			}
		}
		out[i] = time.Duration(total * float64(time.Second))
	}
	return out
}

// commandStats is INFO commandstats summed over servers: command -> calls
// and microseconds. Commands that scripts run are counted too, so only the
// EVALSHA/EVAL rows are round trips.
func commandStats(t *testing.T, nodes []*redis.Client) map[string][2]int64 {
	t.Helper()
	out := map[string][2]int64{}
	for _, rdb := range nodes {
		info, err := rdb.Info(context.Background(), "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
			if !ok || !strings.HasPrefix(name, "cmdstat_") {
				continue
			}
			var calls, usec int64
			for _, kv := range strings.Split(rest, ",") {
				k, v, _ := strings.Cut(kv, "=")
				switch k {
				case "calls":
					calls, _ = strconv.ParseInt(v, 10, 64)
				case "usec":
					usec, _ = strconv.ParseInt(v, 10, 64)
				}
			}
			c := out[strings.TrimPrefix(name, "cmdstat_")]
			out[strings.TrimPrefix(name, "cmdstat_")] = [2]int64{c[0] + calls, c[1] + usec}
		}
	}
	return out
}

// statsDelta returns the calls of each command between two readings,
// leaving out the harness's own (INFO, CLUSTER, ZCARD samples).
func statsDelta(before, after map[string][2]int64) map[string][2]int64 {
	out := map[string][2]int64{}
	for name, a := range after {
		b := before[name]
		if a[0] > b[0] && name != "info" && name != "zcard" && !strings.HasPrefix(name, "cluster") {
			out[name] = [2]int64{a[0] - b[0], a[1] - b[1]}
		}
	}
	return out
}

func sumCalls(d map[string][2]int64) (n int64) {
	for _, v := range d {
		n += v[0]
	}
	return n
}

// costRun is one measured drain.
type costRun struct {
	name   string
	shards int
	w      *world
	rdb    redis.UniversalClient // reaches every key
	nodes  []*redis.Client       // every master, for INFO
	mode   string
}

// measure enqueues n orders due now through the Go client, then lets one
// daemon drain them, and logs what Redis spent on each.
func (r costRun) measure(t *testing.T, n int) {
	ctx := context.Background()
	w := r.w
	all := append([]queue.Keys{w.keys}, queue.ShardKeys(w.keys.Queue, r.shards)...)
	t.Cleanup(func() {
		for _, k := range all[1:] {
			testenv.DeleteQueue(r.rdb, k)
		}
	})
	due := time.Now().Add(-time.Second)
	serials := w.createOrders("bench", n, due)
	cl, err := client.New(r.rdb, w.keys.Queue, client.WithShards(r.shards))
	if err != nil {
		t.Fatal(err)
	}
	items := make([]client.Item, n)
	for i, sr := range serials {
		items[i] = client.Item{Serial: sr, Deadline: due}
	}
	// A checkout enqueues one order per call (as the HTTP API does), from
	// many requests at once; a batch importer many per call. The first
	// tenth goes one by one from 16 goroutines.
	single := n / 10
	cpuS := redisCPU(t, r.nodes)
	inParallel(16, 16, func(g int) {
		for i := g; i < single; i += 16 {
			if _, _, err := cl.Enqueue(ctx, items[i].Serial, items[i].Deadline, client.Create); err != nil {
				t.Error(err)
				return
			}
		}
	})
	cpu0, cs0 := redisCPU(t, r.nodes), commandStats(t, r.nodes)
	for i := single; i < n; i += 100 {
		if _, err := cl.EnqueueMany(ctx, items[i:min(i+100, n)], client.Create); err != nil {
			t.Fatal(err)
		}
	}
	cpu1, cs1 := redisCPU(t, r.nodes), commandStats(t, r.nodes)
	enq := statsDelta(cs0, cs1)

	start := time.Now()
	d := w.start("ORDERDELAY_REDIS_MODE="+r.mode, "ORDERDELAY_QUEUE_SHARDS="+strconv.Itoa(r.shards), "ORDERDELAY_RECONCILE_INTERVAL=0")
	// Per-key drain, sampled every 20 ms in one pipeline.
	type sample struct {
		at   time.Duration
		lens []int64
	}
	var samples []sample
	for {
		// Queued, backing off, and claimed batches (one entry per batch
		// lease: left is zero exactly when everything is settled).
		cards := make([]*redis.IntCmd, 3*len(all))
		if _, err := r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range all {
				cards[3*i], cards[3*i+1], cards[3*i+2] = p.ZCard(ctx, k.Queue), p.ZCard(ctx, k.Inflight), p.ZCard(ctx, k.Leases)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		sm := sample{at: time.Since(start), lens: make([]int64, len(all))}
		var left int64
		for i := range all {
			sm.lens[i] = cards[3*i].Val() + cards[3*i+1].Val() + cards[3*i+2].Val()
			left += sm.lens[i]
		}
		samples = append(samples, sm)
		if left == 0 {
			break
		}
		if time.Since(start) > 3*time.Minute {
			t.Fatalf("not drained after 3 minutes: %v", sm.lens)
		}
		time.Sleep(20 * time.Millisecond)
	}
	drained := samples[len(samples)-1].at
	cpu2, cs2 := redisCPU(t, r.nodes), commandStats(t, r.nodes)
	drain := statsDelta(cs1, cs2)
	// Idle: nothing due, for longer than the 5 s scan interval.
	time.Sleep(500 * time.Millisecond)
	cs3 := commandStats(t, r.nodes)
	const idleFor = 6 * time.Second
	time.Sleep(idleFor)
	idle := statsDelta(cs3, commandStats(t, r.nodes))
	d.stopCleanly()
	if c := w.count("SELECT count(*) FROM orders WHERE status = 'closed'"); c != n {
		t.Fatalf("%d closed, want %d", c, n)
	}

	// Per-key claim rate: the entries a key held at the first sample,
	// over the time until its last non-empty sample.
	var rates []string
	for i := range all {
		first, last := -1, -1
		for j, sm := range samples {
			if sm.lens[i] > 0 {
				if first < 0 {
					first = j
				}
				last = j
			}
		}
		if first < 0 || first == len(samples)-1 {
			continue
		}
		name := "queue key"
		if i > 0 {
			name = fmt.Sprintf("shard %d", i-1)
		}
		span := samples[last+1].at - samples[first].at
		rates = append(rates, fmt.Sprintf("%s %.0f/s", name, float64(samples[first].lens[i])/span.Seconds()))
	}
	perOrder := func(a, b []time.Duration, n int) (total float64, each []string) {
		for i := range a {
			us := float64((b[i] - a[i]).Microseconds()) / float64(n)
			total += us
			each = append(each, fmt.Sprintf("%.1f", us))
		}
		return total, each
	}
	singleCPU, singleEach := perOrder(cpuS, cpu0, single)
	enqCPU, enqEach := perOrder(cpu0, cpu1, n-single)
	drainCPU, drainEach := perOrder(cpu1, cpu2, n)
	script := func(d map[string][2]int64, n int) (calls, usec float64) {
		for _, c := range []string{"evalsha", "eval"} {
			calls += float64(d[c][0])
			usec += float64(d[c][1])
		}
		return calls / float64(n), usec / float64(n)
	}
	ec, eu := script(enq, n-single)
	dc, du := script(drain, n)
	var idleTop []string
	for name, v := range idle {
		idleTop = append(idleTop, fmt.Sprintf("%s %.1f", name, float64(v[0])/idleFor.Seconds()))
	}
	sort.Strings(idleTop)
	t.Logf("%s, %d orders:\n"+
		"  enqueue one per call (Enqueue, 16 callers at once): %.1f µs Redis CPU/order (per server %v)\n"+
		"  enqueue (EnqueueMany, 100 a call): %.1f µs Redis CPU/order (per server %v), scripts %.3f calls %.1f µs/order\n"+
		"  claim + remove (daemon draining):  %.1f µs Redis CPU/order (per server %v), scripts %.3f calls %.1f µs/order\n"+
		"  drained in %s (%.0f orders/s; race-instrumented daemon, PostgreSQL on the same 2 cores)\n"+
		"  per-key claim rates: %s\n"+
		"  idle: %.1f commands/s (%s)",
		r.name, n, singleCPU, singleEach, enqCPU, enqEach, ec, eu, drainCPU, drainEach, dc, du,
		drained.Round(10*time.Millisecond), float64(n)/drained.Seconds(), strings.Join(rates, ", "),
		float64(sumCalls(idle))/idleFor.Seconds(), strings.Join(idleTop, ", "))
}

// TestShardRedisCostPerOrder measures what one order costs Redis with
// S = 1 and S = 4, each on a private redis-server of its own (so its CPU
// time and command counters are the run's alone, and the runs may go side
// by side; -parallel 1 for figures undisturbed by other tests' work on the
// machine), and with S = 4 on a private 3-master
// cluster (how the cost spreads over masters): enqueue through the Go
// client and claim + remove by the daemon draining a backlog, in Redis CPU
// microseconds per order (INFO cpu) and script time (INFO commandstats);
// per-key claim rates while draining; and the idle command rate.
// docs/scaling.md derives a deployment's capacity from these figures.
// ORDERDELAY_SHARD_BENCH_N sets the orders per run (default 10000).
func TestShardRedisCostPerOrder(t *testing.T) {
	t.Parallel()
	n := 10000
	if v := os.Getenv("ORDERDELAY_SHARD_BENCH_N"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			t.Fatal(err)
		}
	}
	var runs []subtest
	for _, shards := range []int{1, testShards} {
		name := fmt.Sprintf("standalone S=%d", shards)
		runs = append(runs, subtest{strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			rdb, addr := testenv.PrivateRedis(t)
			w := withDatabase(t, rdb, "redis://"+addr+"/0", queue.NewKeys(fmt.Sprintf("bench%d:order", shards)))
			costRun{name: name, shards: shards, w: w, rdb: rdb, nodes: []*redis.Client{rdb}, mode: "standalone"}.measure(t, n)
		}})
	}
	runs = append(runs, subtest{"cluster_S=4", func(t *testing.T) {
		c := testenv.PrivateCluster(t)
		key, node := keyOn(t, c, "bench:order")
		w := clusterWorld(t, c, key, node)
		var nodes []*redis.Client
		for _, a := range c.Addrs {
			nc := redis.NewClient(&redis.Options{Addr: a})
			t.Cleanup(func() { nc.Close() })
			nodes = append(nodes, nc)
		}
		costRun{name: "cluster of 3 masters S=4", shards: testShards, w: w, rdb: c.Client(t), nodes: nodes, mode: "cluster"}.measure(t, n)
	}})
	together(t, runs...)
}
