package queue_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// PurgeTasksBefore removes only dead letters older than the cutoff, in
// steps, and all of them with a zero cutoff.
func TestPurgeTasksBefore(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	now, err := st.Now(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2500 {
		at := now.Add(-2 * time.Hour)
		if i%2 == 1 {
			at = now
		}
		rdb.ZAdd(ctx, keys.Dead, redisZ(fmt.Sprintf("d-%d", i), float64(at.UnixMilli())))
		rdb.HSet(ctx, keys.Payload, fmt.Sprintf("d-%d", i), "{}")
	}
	n, err := st.PurgeTasksBefore(ctx, now.Add(-time.Hour))
	if err != nil || n != 1250 {
		t.Fatalf("purged %d (%v), want the 1250 older than an hour", n, err)
	}
	if left, _ := rdb.HLen(ctx, keys.Payload).Result(); left != 1250 {
		t.Errorf("%d payloads left, want 1250", left)
	}
	if n, err := st.PurgeTasksBefore(ctx, time.Time{}); err != nil || n != 1250 {
		t.Errorf("purge all: %d (%v), want 1250", n, err)
	}
}

// Page walks a sorted set in its own order (score, then member bytes) with
// keyset cursors: no entry twice, none skipped, ties across page borders
// included, and a cursor whose entry has gone meanwhile still continues
// where it was.
func TestPageWalksTiesAndSurvivesARemovedCursor(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	var want []string
	for i := range 300 {
		id := fmt.Sprintf("%c-%03d", 'a'+rng.IntN(26), i)
		if i%7 == 0 {
			id = "é" + id // multi-byte: byte order, not the locale's
		}
		score := float64(1_700_000_000_000 + rng.IntN(5)) // many ties
		rdb.ZAdd(ctx, keys.Queue, redisZ(id, score))
	}
	all, err := rdb.ZRange(ctx, keys.Queue, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	want = all
	for _, limit := range []int{1, 7, 1000} {
		var got []string
		var after *queue.Cursor
		for range 400 {
			zs, err := st.Page(ctx, keys.Queue, after, limit)
			if err != nil {
				t.Fatal(err)
			}
			for _, z := range zs {
				got = append(got, z.Member.(string))
			}
			if len(zs) < limit {
				break
			}
			last := zs[len(zs)-1]
			c, err := queue.ParseCursor(queue.Cursor{Score: last.Score, ID: last.Member.(string)}.String())
			if err != nil {
				t.Fatal(err)
			}
			after = &c
		}
		if !slices.Equal(got, want) {
			t.Fatalf("limit %d: paged %d entries, want %d in set order", limit, len(got), len(want))
		}
	}
	// Remove the cursor's own entry between pages.
	zs, err := st.Page(ctx, keys.Queue, nil, 50)
	if err != nil {
		t.Fatal(err)
	}
	last := zs[49]
	rdb.ZRem(ctx, keys.Queue, last.Member)
	next, err := st.Page(ctx, keys.Queue, &queue.Cursor{Score: last.Score, ID: last.Member.(string)}, 10)
	if err != nil || len(next) == 0 || next[0].Member != want[50] {
		t.Errorf("after a removed cursor: %v %v, want to start at %q", err, next, want[50])
	}
}

func redisZ(member string, score float64) redis.Z { return redis.Z{Member: member, Score: score} }

func TestParseCursorRefusesGarbage(t *testing.T) {
	for _, s := range []string{"!!", "", "bm9wZQ", queue.Cursor{Score: 1, ID: ""}.String(), "TmFOfGE"} {
		if _, err := queue.ParseCursor(s); err == nil || !strings.Contains(err.Error(), "cursor") {
			t.Errorf("queue.ParseCursor(%q) = %v, want a bad cursor error", s, err)
		}
	}
}

// Records tells a missing payload from an empty one and reads the hash the
// listing asks for; Sizes, DeadIDs and DeadCount count what is there.
func TestStoreRecordsAndSizes(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	rdb.HSet(ctx, keys.DeadInfo, "a", "failed|1|2|x")
	rdb.HSet(ctx, keys.Lease, "a", "2|1|tok|")
	rdb.HSet(ctx, keys.Payload, "a", `{"v":1}`, "b", "")
	recs, err := st.Records(ctx, []string{"a", "b", "c"}, true, true)
	want := []queue.Record{{Rec: "failed|1|2|x", Payload: `{"v":1}`, HasPayload: true}, {HasPayload: true}, {}}
	if err != nil || !slices.Equal(recs, want) {
		t.Errorf("dead records %+v, %v; want %+v", recs, err, want)
	}
	if recs, err := st.Records(ctx, []string{"a"}, false, false); err != nil || !slices.Equal(recs, []queue.Record{{Rec: "2|1|tok|"}}) {
		t.Errorf("lease records without payloads: %+v, %v", recs, err)
	}
	rdb.ZAdd(ctx, keys.Queue, redisZ("q1", 1), redisZ("q2", 2))
	rdb.ZAdd(ctx, keys.Inflight, redisZ("l1", 1))
	rdb.ZAdd(ctx, keys.Dead, redisZ("d2", 2), redisZ("d1", 1), redisZ("d3", 3))
	if q, f, err := st.Sizes(ctx); err != nil || q != 2 || f != 1 {
		t.Errorf("sizes %d, %d, %v; want 2, 1", q, f, err)
	}
	if ids, err := st.DeadIDs(ctx, 2); err != nil || !slices.Equal(ids, []string{"d1", "d2"}) {
		t.Errorf("dead ids %v, %v; want the two oldest", ids, err)
	}
	if n, err := st.DeadCount(ctx); err != nil || n != 3 {
		t.Errorf("dead count %d, %v", n, err)
	}
}
