package queue_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func TestParseDeadRecord(t *testing.T) {
	tests := []struct {
		rec  string
		want queue.DeadRecord
		ok   bool
	}{
		{"failed|3|1700000000000|boom", queue.DeadRecord{Reason: "failed", Attempts: 3, Deadline: "1700000000000", LastError: "boom"}, true},
		{"malformed|0|garbage|", queue.DeadRecord{Reason: "malformed", Deadline: "garbage"}, true},
		{"failed|x|1|a|b|c", queue.DeadRecord{Reason: "failed", Deadline: "1", LastError: "a|b|c"}, true}, // a damaged count shows as 0
		{"failed|3|1", queue.DeadRecord{}, false},
		{"", queue.DeadRecord{}, false},
	}
	for _, tt := range tests {
		got, ok := queue.ParseDeadRecord(tt.rec)
		if got != tt.want || ok != tt.ok {
			t.Errorf("ParseDeadRecord(%q) = %+v, %v; want %+v, %v", tt.rec, got, ok, tt.want, tt.ok)
		}
	}
}

// Dead lists oldest first, each with its record; an entry whose record is
// missing or damaged is still listed, with what is known.
func TestStoreDeadListsWithRecords(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	rdb.ZAdd(ctx, keys.Dead, redis.Z{Member: "b", Score: 2000}, redis.Z{Member: "a", Score: 1000}, redis.Z{Member: "c", Score: 3000})
	rdb.HSet(ctx, keys.DeadInfo, "a", "not_found|2|1700000000000|no row", "b", "damaged")
	got, err := st.Dead(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	want := []queue.DeadEntry{
		{Serial: "a", Reason: "not_found", Attempts: 2, Deadline: "1700000000000", LastError: "no row", At: time.UnixMilli(1000)},
		{Serial: "b", At: time.UnixMilli(2000)},
		{Serial: "c", At: time.UnixMilli(3000)},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d entries, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	if got, err := st.Dead(ctx, 1); err != nil || len(got) != 1 || got[0].Serial != "a" {
		t.Errorf("limit 1: %+v, %v; want the oldest", got, err)
	}
}

// Requeue moves a dead letter back due now, keeps an entry a producer
// wrote meanwhile, and names a serial that is not dead.
func TestStoreRequeue(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	rdb.ZAdd(ctx, keys.Dead, redis.Z{Member: "d", Score: 1000}, redis.Z{Member: "live", Score: 1000})
	rdb.HSet(ctx, keys.DeadInfo, "d", "failed|1|1|x", "live", "failed|1|1|x")
	rdb.ZAdd(ctx, keys.Queue, redis.Z{Member: "live", Score: 4102444800000})
	before, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := st.Requeue(ctx, "d", "live"); err != nil || n != 2 {
		t.Fatalf("requeue: %d, %v; want 2", n, err)
	}
	if d, err := rdb.ZScore(ctx, keys.Queue, "d").Result(); err != nil || time.UnixMilli(int64(d)).Before(before.Truncate(time.Millisecond)) {
		t.Errorf("requeued entry due %v (%v), want now (≥ %v)", d, err, before)
	}
	if d, _ := rdb.ZScore(ctx, keys.Queue, "live").Result(); d != 4102444800000 {
		t.Errorf("the producer's entry moved to %v", d)
	}
	if n, _ := rdb.Exists(ctx, keys.Dead, keys.DeadInfo).Result(); n != 0 {
		t.Errorf("%d dead-letter keys left", n)
	}
	if _, err := st.Requeue(ctx, "d"); !errors.Is(err, queue.ErrNotDead) {
		t.Errorf("requeue of a serial not dead: %v, want ErrNotDead", err)
	}
}
