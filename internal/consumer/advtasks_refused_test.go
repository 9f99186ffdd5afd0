package consumer

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A stream queue's sweep of its consumer groups' pending entries (the
// dead-lettering of entries delivered max_attempts times) runs commands
// the forward script does not: XINFO GROUPS and XPENDING. An ACL
// tightened at runtime that refuses one of them is Redis answering, like
// a refused claim: it must be reported as the permission problem it is
// (config_warning{check="redis_permissions"}, the one error line that
// names the fix), not as a failure to retry with nothing said about the
// ACL — while it lasts no exhausted entry is ever dead-lettered, and the
// only sign was a warning a second that never mentions permissions.
func TestAdvStreamSweepRefusedIsReportedAsARefusal(t *testing.T) {
	for _, cmd := range []string{"xpending", "xinfo"} {
		t.Run("-"+cmd, func(t *testing.T) {
			admin, addr := testenv.PrivateRedis(t)
			ctx := context.Background()
			keys := queue.NewKeys("refused:ev")
			if err := admin.Do(ctx, "ACL", "SETUSER", "od", "on", ">pw", "~*", "&*", "+@all").Err(); err != nil {
				t.Fatal(err)
			}
			od := redis.NewClient(&redis.Options{Addr: addr, Username: "od", Password: "pw"})
			t.Cleanup(func() { od.Close() })
			e := &env{Env: testenv.Env{T: t, RDB: admin, Keys: keys}, m: metrics.New(prometheus.NewRegistry(), "test", "test")}
			if err := admin.XGroupCreateMkStream(ctx, keys.Stream, "g", "0").Err(); err != nil {
				t.Fatal(err)
			}
			st := queue.NewStore(admin, keys)
			payload, _ := json.Marshal(map[string]int{"n": 1})
			if _, err := st.PutTask(ctx, queue.ModeCreate, queue.WriterClient, queue.TaskWrite{ID: "ev-1",
				DeadlineMS: time.Now().Add(-time.Second).UnixMilli(), Payload: string(payload)}); err != nil {
				t.Fatal(err)
			}
			core, logs := observer.New(zap.DebugLevel)
			c, err := New(Config{Keys: keys, MaxAttempts: 2,
				Forward: &Forward{Kind: "stream", Queue: "ev", MaxLen: 1000, AckTimeout: time.Minute}}, od, nil, e.m, zap.New(core))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.claim(ctx, 100); err != nil { // forwards ev-1; its sweep finds nothing pending
				t.Fatal(err)
			}
			if res, err := admin.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c1",
				Streams: []string{keys.Stream, ">"}, Count: 10, Block: -1}).Result(); err != nil || len(res) != 1 || len(res[0].Messages) != 1 {
				t.Fatalf("XREADGROUP: %v, %v", res, err)
			}
			e.acl("-" + cmd)
			c.streamSwept = 0 // the next forward sweeps (at most one a second)
			if _, err := c.claim(ctx, 100); err != nil {
				t.Fatalf("the forward itself was refused (%v): the test does not test the sweep", err)
			}
			if n := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClaim)); n != 1 {
				t.Fatalf("errors_total{claim} = %v after one refused sweep, want 1: the test does not test", n)
			}
			if w := testutil.ToFloat64(e.m.ConfigWarning.WithLabelValues(metrics.CheckRedisPermissions)); w != 1 {
				t.Errorf("ACL -%s refused the stream sweep: config_warning{redis_permissions} = %v, want 1", cmd, w)
			}
			var named int
			for _, l := range logs.All() {
				msg, _ := l.ContextMap()["error"].(string)
				if !strings.Contains(msg, "NOPERM") {
					continue
				}
				if l.Level == zap.ErrorLevel && strings.HasPrefix(l.Message, "redis refused a command the daemon needs") {
					named++
				} else {
					t.Logf("the refusal logged as %s %q", l.Level, l.Message)
				}
			}
			if named != 1 {
				t.Errorf("ACL -%s refused the stream sweep: %d lines naming the refusal, want 1", cmd, named)
			}
		})
	}
}
