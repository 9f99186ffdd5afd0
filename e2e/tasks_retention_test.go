package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// The daemon's janitor bounds every task queue's dead letters, each queue
// under its own dead_max or the global ORDERDELAY_DEAD_LETTER_MAX, and the
// purged dead letters' payloads go with them; a live task that reuses a
// purged id keeps its payload.
func TestTaskQueueDeadLetterRetention(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, `
queues:
  - name: own
    key: PREFIX:own
    dead_max: 2
    action: {type: poll}
  - name: global
    key: PREFIX:global
    action: {type: poll}
`)
	ctx := context.Background()
	old := time.Now().Add(-time.Hour).UnixMilli()
	for _, name := range []string{"own", "global"} {
		k := tw.keys(name)
		for i := range 6 {
			id := fmt.Sprintf("d-%d", i)
			tw.rdb.ZAdd(ctx, k.Dead, redis.Z{Score: float64(old + int64(i)), Member: id})
			tw.rdb.HSet(ctx, k.DeadInfo, id, "failed|3|1|boom")
			tw.rdb.HSet(ctx, k.Payload, id, `{"id":"`+id+`"}`)
		}
		// d-0, the oldest, is also a live task again (its id reused).
		tw.rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(time.Now().Add(time.Hour).UnixMilli()), Member: "d-0"})
	}
	d := tw.start("ORDERDELAY_DEAD_LETTER_MAX=4", "ORDERDELAY_DEAD_LETTER_RETENTION=0")
	want := map[string]int64{"own": 2, "global": 4}
	for name, keep := range want {
		k := tw.keys(name)
		waitFor(t, name+": dead letters trimmed", 30*time.Second, func() bool {
			n, _ := tw.rdb.ZCard(ctx, k.Dead).Result()
			return n == keep
		})
		payloads, _ := tw.rdb.HKeys(ctx, k.Payload).Result()
		// The kept dead letters' payloads and the live d-0's.
		if int64(len(payloads)) != keep+1 {
			t.Errorf("%s: payloads %q; want the %d kept dead letters' and the live d-0's", name, payloads, keep)
		}
		if ok, _ := tw.rdb.HExists(ctx, k.Payload, "d-0").Result(); !ok {
			t.Errorf("%s: the live task d-0 lost its payload to the purge of its old dead letter", name)
		}
		if ok, _ := tw.rdb.HExists(ctx, k.Payload, "d-1").Result(); ok {
			t.Errorf("%s: the purged dead letter d-1 left its payload", name)
		}
	}
	d.stop()
}
