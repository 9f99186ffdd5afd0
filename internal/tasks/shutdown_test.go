package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Task queues during shutdown: a daemon that stops while it holds a batch
// lets the batch finish within the drain timeout (half the lease), or
// hands its tasks back with their true deadlines, attempts and payloads;
// it loses nothing, spends no attempt and runs nothing early. Each test
// runs the consumer the daemon builds for the queue (Manager.consumerConfig)
// with only the drain timeout changed, so the test need not wait half a
// lease.

type shutdownEnv struct {
	t   *testing.T
	rdb *redis.Client
	db  *sqlx.DB
	r   *Runtime
	m   *Manager
}

func newShutdownEnv(t *testing.T, queueYAML string, db *sqlx.DB) *shutdownEnv {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	f, err := Parse([]byte(fmt.Sprintf("queues:\n  - {name: q, key: '%s-q', %s}\n", keys.Queue, queueYAML)))
	if err != nil {
		t.Fatal(err)
	}
	fam := metrics.NewTaskFamilies(prometheus.NewRegistry(), metrics.New(prometheus.NewRegistry(), "test", "test"))
	m, err := NewManager(f, rdb, db, fam, zaptest.NewLogger(t), "test")
	if err != nil {
		t.Fatal(err)
	}
	r, _ := m.Queue("q")
	t.Cleanup(func() { testenv.DeleteQueue(rdb, r.Keys) })
	return &shutdownEnv{t: t, rdb: rdb, db: db, r: r, m: m}
}

// put puts n tasks named prefix-i due at due, and returns their ids.
func (s *shutdownEnv) put(prefix string, n int, due time.Time) []string {
	s.t.Helper()
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%02d", prefix, i)
		if _, _, err := s.r.Client.PutTask(context.Background(), ids[i], json.RawMessage(`{"id":"`+ids[i]+`"}`), due, client.Create); err != nil {
			s.t.Fatal(err)
		}
	}
	return ids
}

// run starts the daemon's consumer of the queue with drain as its drain
// timeout; stop cancels it and waits for Run to return.
func (s *shutdownEnv) run(drain time.Duration) (stop func()) {
	s.t.Helper()
	cfg := s.m.consumerConfig(s.r)
	cfg.DrainTimeout = drain
	c, err := consumer.New(cfg, s.rdb, nil, s.r.Metrics, zaptest.NewLogger(s.t))
	if err != nil {
		s.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }() //nolint:errcheck // nil when ctx ends
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	s.t.Cleanup(stop)
	return stop
}

// assertHandedBack checks that each of ids is queued again at its true
// deadline with no attempt spent and its payload, and that nothing is
// leased, backing off or dead-lettered.
func (s *shutdownEnv) assertHandedBack(ids []string, due time.Time) {
	s.t.Helper()
	ctx := context.Background()
	k := s.r.Keys
	for _, id := range ids {
		score, err := s.rdb.ZScore(ctx, k.Queue, id).Result()
		if err != nil {
			s.t.Fatalf("%s is not back in the queue: %v", id, err)
		}
		if want := float64(due.UnixMilli()); score != want {
			s.t.Errorf("%s handed back due %d, want its true deadline %d", id, int64(score), int64(want))
		}
		tk, err := s.r.Client.GetTask(ctx, id)
		if err != nil || tk.Attempts != 0 || string(tk.Payload) != `{"id":"`+id+`"}` {
			s.t.Errorf("%s after the hand-back: %+v, %v; want no attempt spent and its payload", id, tk, err)
		}
	}
	for _, key := range []string{k.Inflight, k.Dead} {
		if n, _ := s.rdb.ZCard(ctx, key).Result(); n != 0 {
			s.t.Errorf("%s holds %d after the shutdown, want 0", key, n)
		}
	}
	if n, _ := s.rdb.HLen(ctx, k.Lease).Result(); n != 0 {
		s.t.Errorf("%d lease records after the shutdown", n)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within 30s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *shutdownEnv) sleeping() bool {
	var n int
	if err := s.db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%pg_sleep(30)%' AND pid <> pg_backend_pid()`); err != nil {
		s.t.Fatal(err)
	}
	return n > 0
}

// A sql batch still running when the drain timeout passes is cancelled and
// handed back: the statement stops, nothing is lost or spent; tasks not
// yet due are never touched.
func TestSQLQueueShutdownHandsBackARunningBatch(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	if _, err := db.Exec(`CREATE TABLE shut_done (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	s := newShutdownEnv(t, `lease: 1m, action: {type: sql, statement: "INSERT INTO shut_done SELECT x FROM unnest($1::text[]) x, pg_sleep(30) RETURNING id"}`, db)
	due := time.Now().Add(-time.Second).Truncate(time.Millisecond)
	ids := s.put("s", 3, due)
	later := time.Now().Add(time.Hour).Truncate(time.Millisecond)
	future := s.put("f", 2, later)
	stop := s.run(300 * time.Millisecond)
	eventually(t, "the batch's statement running", s.sleeping)
	stop()
	s.assertHandedBack(ids, due)
	s.assertHandedBack(future, later)
	eventually(t, "the statement cancelled", func() bool { return !s.sleeping() })
	var n int
	if err := db.Get(&n, `SELECT count(*) FROM shut_done`); err != nil || n != 0 {
		t.Fatalf("%d rows written by a cancelled batch (%v)", n, err)
	}
}

// A sql batch that ends within the drain timeout completes: its tasks are
// done and gone with their payloads.
func TestSQLQueueShutdownFinishesABatchWithinTheDrain(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	if _, err := db.Exec(`CREATE TABLE shut_done (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	s := newShutdownEnv(t, `lease: 1m, action: {type: sql, statement: "INSERT INTO shut_done SELECT x FROM unnest($1::text[]) x, pg_sleep(0.5) RETURNING id"}`, db)
	ids := s.put("s", 3, time.Now().Add(-time.Second))
	stop := s.run(30 * time.Second)
	eventually(t, "the batch claimed", func() bool {
		n, _ := s.rdb.ZCard(context.Background(), s.r.Keys.Queue).Result()
		return n == 0
	})
	stop()
	var got []string
	if err := db.Select(&got, `SELECT id FROM shut_done ORDER BY id`); err != nil || !slices.Equal(got, ids) {
		t.Fatalf("done %q (%v), want %q", got, err, ids)
	}
	ctx := context.Background()
	for _, key := range []string{s.r.Keys.Queue, s.r.Keys.Inflight, s.r.Keys.Dead} {
		if n, _ := s.rdb.ZCard(ctx, key).Result(); n != 0 {
			t.Errorf("%s holds %d after a finished batch", key, n)
		}
	}
	if n, _ := s.rdb.HLen(ctx, s.r.Keys.Payload).Result(); n != 0 {
		t.Errorf("%d payloads left after the batch finished", n)
	}
}

// A webhook batch larger than the requests it sends at once: on shutdown
// the requests in flight are cut at the drain timeout and every task of
// the batch, sent or not, is handed back; no request starts after the cut.
func TestWebhookQueueShutdownHandsBackTheBatch(t *testing.T) {
	t.Setenv("OD_SHUT_SECRET", "0123456789abcdef0123456789abcdef")
	var mu sync.Mutex
	var seen []string
	var cut bool
	var lateRequests int
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct{ ID string }
		json.NewDecoder(r.Body).Decode(&body) //nolint:errcheck // the id is only counted
		mu.Lock()
		seen = append(seen, body.ID)
		if cut {
			lateRequests++
		}
		mu.Unlock()
		select {
		case <-release:
			w.WriteHeader(http.StatusOK)
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	s := newShutdownEnv(t, `lease: 1m, batch_size: 20, workers: 1, action: {type: webhook, url: '`+srv.URL+`', timeout: 20s, secret_env: OD_SHUT_SECRET}`, nil)
	due := time.Now().Add(-time.Second).Truncate(time.Millisecond)
	ids := s.put("w", 12, due)
	stop := s.run(300 * time.Millisecond)
	eventually(t, "the first requests in flight", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == webhookConcurrency
	})
	stop()
	mu.Lock()
	cut = true
	mu.Unlock()
	s.assertHandedBack(ids, due)
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != webhookConcurrency || lateRequests != 0 {
		t.Fatalf("%d requests sent (%d after the shutdown); want the %d in flight and none started after the cut",
			len(seen), lateRequests, webhookConcurrency)
	}
}

// A webhook batch answered within the drain timeout completes.
func TestWebhookQueueShutdownFinishesWithinTheDrain(t *testing.T) {
	t.Setenv("OD_SHUT_SECRET", "0123456789abcdef0123456789abcdef")
	var mu sync.Mutex
	got := map[string]int{}
	started := make(chan struct{}, 100)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct{ ID string }
		json.NewDecoder(r.Body).Decode(&body) //nolint:errcheck // the id is only counted
		started <- struct{}{}
		time.Sleep(200 * time.Millisecond) // a slow receiver; the drain outlasts it
		mu.Lock()
		got[body.ID]++
		mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	s := newShutdownEnv(t, `lease: 1m, batch_size: 20, workers: 1, action: {type: webhook, url: '`+srv.URL+`', timeout: 20s, secret_env: OD_SHUT_SECRET}`, nil)
	ids := s.put("w", 12, time.Now().Add(-time.Second))
	stop := s.run(30 * time.Second)
	<-started
	stop()
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("%s delivered %d times, want once", id, got[id])
		}
	}
	ctx := context.Background()
	for _, key := range []string{s.r.Keys.Queue, s.r.Keys.Inflight, s.r.Keys.Dead} {
		if n, _ := s.rdb.ZCard(ctx, key).Result(); n != 0 {
			t.Errorf("%s holds %d after the batch finished", key, n)
		}
	}
}

// Stream and list queues hold nothing between passes (a forward is one
// script): stopped at any moment, each due task is either still queued
// with its payload or delivered, exactly once, and tasks not yet due are
// still queued. A restart delivers the rest.
func TestForwardQueuesShutdownLoseNothing(t *testing.T) {
	t.Parallel()
	for _, action := range []string{"{type: stream}", "{type: list}", "{type: list, reliable: true}"} {
		t.Run(action, func(t *testing.T) {
			s := newShutdownEnv(t, `batch_size: 7, action: `+action, nil)
			ctx := context.Background()
			k := s.r.Keys
			ids := s.put("d", 60, time.Now().Add(-time.Second))
			future := s.put("f", 3, time.Now().Add(time.Hour))
			delivered := func() []string {
				var out []string
				if s.r.Config.Action.Type == ActionStream {
					msgs, err := s.rdb.XRange(ctx, k.Stream, "-", "+").Result()
					if err != nil {
						t.Fatal(err)
					}
					for _, m := range msgs {
						out = append(out, m.Values["id"].(string))
					}
					return out
				}
				items, err := s.rdb.LRange(ctx, k.Ready, 0, -1).Result()
				if err != nil {
					t.Fatal(err)
				}
				for _, it := range items {
					var li client.ListItem
					if err := json.Unmarshal([]byte(it), &li); err != nil {
						t.Fatal(err)
					}
					out = append(out, li.ID)
				}
				return out
			}
			check := func(when string) int {
				t.Helper()
				got := delivered()
				seen := map[string]bool{}
				for _, id := range got {
					if seen[id] {
						t.Fatalf("%s: %s delivered twice", when, id)
					}
					seen[id] = true
				}
				for _, id := range append(slices.Clone(ids), future...) {
					_, err := s.rdb.ZScore(ctx, k.Queue, id).Result()
					queued := err == nil
					if queued == seen[id] {
						t.Fatalf("%s: %s queued %v and delivered %v: want exactly one", when, id, queued, seen[id])
					}
					if has, _ := s.rdb.HExists(ctx, k.Payload, id).Result(); has != queued {
						t.Fatalf("%s: %s queued %v but has a payload %v", when, id, queued, has)
					}
				}
				for _, id := range future {
					if seen[id] {
						t.Fatalf("%s: %s delivered an hour early", when, id)
					}
				}
				return len(got)
			}
			stop := s.run(time.Second)
			eventually(t, "a first forward", func() bool { return len(delivered()) > 0 })
			stop()
			check("after the shutdown")
			stop = s.run(time.Second)
			eventually(t, "the rest forwarded after a restart", func() bool { return len(delivered()) == len(ids) })
			stop()
			if n := check("after the restart"); n != len(ids) {
				t.Fatalf("%d delivered, want %d", n, len(ids))
			}
		})
	}
}
