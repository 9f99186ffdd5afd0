package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestParseRefusesBadRetentionAndListCap(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, yaml, want string }{
		{"negative dead_max", "queues:\n  - {name: a, dead_max: -1, action: {type: poll}}\n", "dead_max"},
		{"huge dead_max", "queues:\n  - {name: a, dead_max: 100000001, action: {type: poll}}\n", "dead_max"},
		{"dead_max not a number", "queues:\n  - {name: a, dead_max: lots, action: {type: poll}}\n", "line 2"},
		{"zero dead_retention", "queues:\n  - {name: a, dead_retention: 0s, action: {type: poll}}\n", "line 2"},
		{"bad dead_retention", "queues:\n  - {name: a, dead_retention: forever, action: {type: poll}}\n", "line 2"},
		{"dead_retention over 10 years", "queues:\n  - {name: a, dead_retention: 100000h, action: {type: poll}}\n", "dead_retention"},
		{"negative list max_len", "queues:\n  - {name: a, action: {type: list, max_len: -5}}\n", "max_len"},
		{"max_len on poll", "queues:\n  - {name: a, action: {type: poll, max_len: 5}}\n", "max_len"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.yaml))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Parse: %v, want an error mentioning %q", err, c.want)
			}
		})
	}
}

// A queue's own dead_retention and dead_max win; left out, the global
// ORDERDELAY_DEAD_LETTER_RETENTION and _MAX apply.
func TestQueueRetentionFallsBackToTheGlobalSettings(t *testing.T) {
	t.Parallel()
	f, err := Parse([]byte("queues:\n  - {name: own, dead_retention: 1h, dead_max: 5, action: {type: poll}}\n" +
		"  - {name: global, action: {type: poll}}\n  - {name: half, dead_max: 7, action: {type: poll}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		age  time.Duration
		keep int
	}{{time.Hour, 5}, {168 * time.Hour, 100}, {168 * time.Hour, 7}}
	for i, q := range f.Queues {
		if age, keep := q.Retention(168*time.Hour, 100); age != want[i].age || keep != want[i].keep {
			t.Errorf("%s: retention %s/%d, want %s/%d", q.Name, age, keep, want[i].age, want[i].keep)
		}
	}
}

// The janitor's purge covers every task queue, each under its own
// retention, and takes the purged dead letters' payloads with them.
func TestManagerPurgesEveryQueuesDeadLetters(t *testing.T) {
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	ctx := context.Background()
	base := keys.Queue
	f, err := Parse([]byte(fmt.Sprintf("queues:\n  - {name: capped, key: '%s-capped', dead_max: 2, action: {type: poll}}\n"+
		"  - {name: global, key: '%s-global', action: {type: list}}\n", base, base)))
	if err != nil {
		t.Fatal(err)
	}
	fam := metrics.NewTaskFamilies(prometheus.NewRegistry(), metrics.New(prometheus.NewRegistry(), "test", "test"))
	m, err := NewManager(f, rdb, nil, fam, zaptest.NewLogger(t), "test")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range m.Names() {
		r, _ := m.Queue(name)
		t.Cleanup(func() { testenv.DeleteQueue(rdb, r.Keys) })
		for i := range 5 {
			bury(t, rdb, r.Client, r.Keys, fmt.Sprintf("t%d", i), time.Duration(5-i)*time.Hour)
		}
	}
	if !m.PurgesDead(0, 0) {
		t.Fatal("PurgesDead is false though queue capped has dead_max")
	}
	// Global: keep 3, nothing by age. capped keeps its own 2.
	per, err := m.PurgeDead(ctx, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	if per["capped"] != 3 || per["global"] != 2 {
		t.Fatalf("purged %v, want capped 3 (own dead_max 2), global 2 (global cap 3)", per)
	}
	for _, name := range m.Names() {
		r, _ := m.Queue(name)
		dead, _ := rdb.ZCard(ctx, r.Keys.Dead).Result()
		payloads, _ := rdb.HLen(ctx, r.Keys.Payload).Result()
		if dead != payloads {
			t.Errorf("%s: %d dead letters but %d payloads: purged dead letters left theirs", name, dead, payloads)
		}
		if ok, _ := rdb.HExists(ctx, r.Keys.Payload, "t0").Result(); ok {
			t.Errorf("%s: the oldest dead letter's payload is still there", name)
		}
	}
	// By age: everything older than 90 minutes goes, in every queue.
	if _, err := m.PurgeDead(ctx, 90*time.Minute, 0); err != nil {
		t.Fatal(err)
	}
	for _, name := range m.Names() {
		r, _ := m.Queue(name)
		if ids, _ := rdb.ZRange(ctx, r.Keys.Dead, 0, -1).Result(); len(ids) != 1 || ids[0] != "t4" {
			t.Errorf("%s: dead letters %q after the age purge, want [t4]", name, ids)
		}
	}
}

// bury puts task id with a payload and dead-letters it ago before now,
// writing exactly what the bury script writes.
func bury(t *testing.T, rdb *redis.Client, cl *client.Client, k queue.Keys, id string, ago time.Duration) {
	t.Helper()
	ctx := context.Background()
	if _, _, err := cl.PutTask(ctx, id, json.RawMessage(`{"id":"`+id+`"}`), time.Now().Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	_, err = rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.ZRem(ctx, k.Queue, id)
		p.ZAdd(ctx, k.Dead, redis.Z{Score: float64(now.Add(-ago).UnixMilli()), Member: id})
		p.HSet(ctx, k.DeadInfo, id, "failed|3|0|boom")
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
