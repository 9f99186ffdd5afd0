package consumer

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// TestStatsSurviveMalformedMembers: members a raw producer wrote
// wrongly (a control character, ±inf, a score in seconds) neither break
// the script nor hide how late the real overdue task is.
func TestStatsSurviveMalformedMembers(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	cl, k := taskQueue(t, e.RDB, "junk")
	// Whole milliseconds, as deadlines are stored: a deadline rounded up
	// to the next millisecond would read as 9m59.999s overdue.
	now := e.RedisNow().Truncate(time.Millisecond)
	e.putTask(cl, "real-1", now.Add(-10*time.Minute))
	if err := e.RDB.ZAdd(ctx, k.Queue,
		redis.Z{Score: math.Inf(-1), Member: "minus-inf"},
		redis.Z{Score: math.Inf(1), Member: "plus-inf"},
		redis.Z{Score: 1.5, Member: "tiny"},
		redis.Z{Score: float64(now.Add(-time.Second).UnixMilli()), Member: "ctl\x01char"},
	).Err(); err != nil {
		t.Fatal(err)
	}
	// A lease record without a deadline and an inflight entry without
	// either (a half-written companion) must not break it either.
	if err := e.RDB.ZAdd(ctx, k.Inflight, redis.Z{Score: float64(now.UnixMilli()), Member: "orphan"}).Err(); err != nil {
		t.Fatal(err)
	}
	st, err := queue.ReadStats(ctx, e.RDB, k)
	if err != nil {
		t.Fatalf("stats with malformed members: %v", err)
	}
	t.Logf("stats %+v", st)
	if st.Depth != 6 || st.Held != 1 {
		t.Errorf("depth %d held %d, want 6 (five members and the orphan) and 1", st.Depth, st.Held)
	}
	if st.Overdue != 4 {
		t.Errorf("overdue %d, want 4 (real-1, minus-inf, tiny, the control character: all due)", st.Overdue)
	}
	if st.OldestDue < 10*time.Minute || st.OldestDue > 11*time.Minute {
		t.Errorf("oldest overdue %s, want real-1's 10 minutes: junk scores must neither hide it nor stand in for it", st.OldestDue)
	}
}
