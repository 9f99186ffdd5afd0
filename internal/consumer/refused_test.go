package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// refusedEnv is an env on a private Redis whose consumer runs as the user
// "od", whose ACL the test changes while it runs, and the admin client
// (the default user) that changes it.
func refusedEnv(t *testing.T) (e *env, od *redis.Client) {
	t.Helper()
	admin, addr := testenv.PrivateRedis(t)
	keys := queue.NewKeys("refused:order")
	e = &env{Env: testenv.Env{T: t, RDB: admin, Keys: keys}, m: metrics.New(prometheus.NewRegistry(), "test", "test")}
	e.Postgres(orders.Statements{})
	if err := admin.Do(context.Background(), "ACL", "SETUSER", "od", "on", ">pw", "~*", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	od = redis.NewClient(&redis.Options{Addr: addr, Username: "od", Password: "pw"})
	t.Cleanup(func() { od.Close() })
	return e, od
}

func (e *env) acl(rules ...string) {
	e.T.Helper()
	args := append([]any{"ACL", "SETUSER", "od"}, toAny(rules)...)
	if err := e.RDB.Do(context.Background(), args...).Err(); err != nil {
		e.T.Fatal(err)
	}
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// An ACL tightened while the daemon runs refuses the claim (HSET) or the
// finish (HDEL): Redis answered, so dependency_up{redis} stays 1; the
// refusal is counted and raises config_warning{redis_permissions}; no
// order is lost or closed twice, and once the ACL is mended every order
// closes and the queue's keys empty.
func TestRefusedCommandWarnsLosesNothingAndRecovers(t *testing.T) {
	for _, cmd := range []string{"hset", "hdel"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e, od := refusedEnv(t)
			cfg := Config{Keys: e.Keys, Workers: 1, BatchSize: 50, Lease: time.Second, StatementTimeout: 500 * time.Millisecond,
				HeadCheck: 20 * time.Millisecond, BackoffMax: 100 * time.Millisecond}
			c, err := New(cfg, od, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
			if err != nil {
				t.Fatal(err)
			}
			past := e.RedisNow().Add(-time.Second)
			e.acl("-" + cmd)
			serials := e.Orders("r", 30, past)
			e.Enqueue(serials, past)
			runConsumer(t, c)

			eventually(t, "the refusal counted and warned", 30*time.Second, func() bool {
				errs := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClaim)) +
					testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageRemove))
				return errs > 0 && testutil.ToFloat64(e.m.ConfigWarning.WithLabelValues(metrics.CheckRedisPermissions)) == 1
			})
			if up := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepRedis)); up != 1 {
				t.Errorf("dependency_up{redis} = %v while Redis answers with refusals, want 1", up)
			}
			// Every order is still where a claim finds it, or closed (a
			// refused finish comes after the close committed).
			for _, s := range serials {
				if e.Status(s) == "closed" {
					continue
				}
				inQueue := e.RDB.ZScore(context.Background(), e.Keys.Queue, s).Err() == nil
				inLease := e.RDB.HExists(context.Background(), e.Keys.Lease, s).Val()
				if !inQueue && !inLease {
					t.Errorf("%s: pending, and neither in the queue key nor leased", s)
				}
			}

			e.acl("+" + cmd)
			eventually(t, "every order closed and the queue's keys empty", 60*time.Second, func() bool {
				if e.StatusCounts()["closed"] != len(serials) {
					return false
				}
				for _, k := range []string{e.Keys.Queue, e.Keys.Inflight, e.Keys.Leases} {
					if e.card(k) != 0 {
						return false
					}
				}
				return e.RDB.HLen(context.Background(), e.Keys.Lease).Val() == 0
			})
			if n := testutil.ToFloat64(e.m.Closed); n != float64(len(serials)) {
				t.Errorf("closed_total = %v, want %d (each order once)", n, len(serials))
			}
		})
	}
}

// refusalLines are the entries of logs whose error is an ACL refusal, and
// the number of those that are the one line naming the fix (refused).
func refusalLines(logs *observer.ObservedLogs) (all []observer.LoggedEntry, named int) {
	for _, l := range logs.All() {
		msg, _ := l.ContextMap()["error"].(string)
		if !strings.Contains(msg, "NOPERM") && !strings.Contains(msg, "can't run this command") {
			continue
		}
		all = append(all, l)
		if l.Level == zap.ErrorLevel && strings.HasPrefix(l.Message, "redis refused a command the daemon needs") {
			named++
		}
	}
	return all, named
}

// refusedDue is a refusedEnv's consumer (one worker, batches of 50, a
// 10 s lease), logging to the observer it returns, and three orders due
// a second ago, their serials made from prefix.
func refusedDue(t *testing.T, prefix string) (*env, *Consumer, *observer.ObservedLogs, []string) {
	t.Helper()
	e, od := refusedEnv(t)
	core, logs := observer.New(zap.DebugLevel)
	cfg := Config{Keys: e.Keys, Workers: 1, BatchSize: 50, Lease: 10 * time.Second, StatementTimeout: 5 * time.Second,
		HeadCheck: 20 * time.Millisecond, BackoffMax: 100 * time.Millisecond}
	c, err := New(cfg, od, e.Store, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders(prefix, 3, past)
	e.Enqueue(serials, past)
	return e, c, logs, serials
}

// A refusal is logged once: the error that names the fix (the ACL), not
// that and a warning of the caller's with the same error. Each path that
// meets one — the scan loop's claim and head check, the fence, the
// bookkeeping after a batch — is driven into refusals, and every line
// that carries a refusal must be that error, one per failed call
// (errors_total counts each call once).
func TestRefusalIsLoggedOnce(t *testing.T) {
	for _, tc := range []struct {
		name, cmd string
		loop      bool // run the scan loop (else claim, then process one batch)
	}{
		{"claim", "hset", true},
		{"fence", "zmscore", false},
		{"finish", "hdel", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, c, logs, serials := refusedDue(t, "once")
			if tc.loop {
				e.acl("-" + tc.cmd)
				stop := runConsumer(t, c)
				eventually(t, "two claims refused", 30*time.Second, func() bool {
					return testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageClaim)) >= 2
				})
				stop()
			} else {
				stopping := make(chan struct{})
				close(stopping) // do not hold the worker for the backoff
				c.stopping = stopping
				res := claimN(t, c, len(serials))
				e.acl("-" + tc.cmd)
				c.process(context.Background(), res.items)
			}
			var failed float64
			for _, stage := range []string{metrics.StageClaim, metrics.StageClose, metrics.StageRemove} {
				failed += testutil.ToFloat64(e.m.Errors.WithLabelValues(stage))
			}
			lines, named := refusalLines(logs)
			if failed == 0 || len(lines) == 0 {
				t.Fatalf("no refusal met (errors_total %v, %d lines): the test does not test", failed, len(lines))
			}
			for _, l := range lines {
				if l.Level != zap.ErrorLevel || !strings.HasPrefix(l.Message, "redis refused a command the daemon needs") {
					t.Errorf("a refusal logged again as %s %q", l.Level, l.Message)
				}
			}
			if float64(named) != failed {
				t.Errorf("%d refusal errors logged for %v refused calls, want one each", named, failed)
			}
		})
	}
}

// A PostgreSQL error is never taken for a Redis refusal, whatever its
// text: a shop's trigger raising "NOPERM …" with a SQLSTATE about the
// database (53000, insufficient resources) makes the batch wait for the
// database as any outage does — PostgreSQL marked down — and raises no
// config_warning{check="redis_permissions"}, nor logs the ACL's error.
func TestDatabaseErrorWordedAsARefusalIsNoRefusal(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("noperm", 1, past)
	e.Enqueue(serials, past)
	e.CloseTrigger("noperm_words", "true",
		`RAISE EXCEPTION 'NOPERM this user has no permissions to run the ''update'' command' USING ERRCODE = '53000'`)
	core, logs := observer.New(zap.DebugLevel)
	c, err := New(Config{Keys: e.Keys, BatchSize: 10}, e.RDB, e.Store, e.m, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	stopping := make(chan struct{})
	close(stopping) // do not hold the worker for the backoff
	c.stopping = stopping
	res := claimN(t, c, 1)
	c.process(context.Background(), res.items)
	if up := testutil.ToFloat64(e.m.DependencyUp.WithLabelValues(metrics.DepPostgres)); up != 0 {
		t.Fatalf("dependency_up{postgres} = %v, want 0: the trigger's error did not take the outage path", up)
	}
	if w := testutil.ToFloat64(e.m.ConfigWarning.WithLabelValues(metrics.CheckRedisPermissions)); w != 0 {
		t.Errorf("config_warning{redis_permissions} = %v after a PostgreSQL error that only reads like a refusal, want 0", w)
	}
	if n := logs.FilterMessageSnippet("redis refused").Len(); n != 0 {
		t.Errorf("%d log lines blame the Redis ACL for a PostgreSQL error", n)
	}
}

// A hand-back refused by Redis (the shutdown's, or a late claim's) says
// what the other refused calls say: the one error naming the ACL and
// config_warning{check="redis_permissions"}, counted in
// errors_total{stage="remove"}, not a bare warning an
// operator would read as Redis being away. Nothing is lost: every entry is
// still leased, to come back when its lease expires.
func TestRefusedHandBackWarnsOfThePermission(t *testing.T) {
	e, c, logs, serials := refusedDue(t, "hb")
	res := claimN(t, c, len(serials))
	e.acl("-zadd")
	c.handBack(res.items)

	if w := testutil.ToFloat64(e.m.ConfigWarning.WithLabelValues(metrics.CheckRedisPermissions)); w != 1 {
		t.Errorf("config_warning{redis_permissions} = %v after a refused hand-back, want 1", w)
	}
	if n := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageRemove)); n != 1 {
		t.Errorf("errors_total{remove} = %v after one refused hand-back, want 1", n)
	}
	lines, named := refusalLines(logs)
	if named != 1 || len(lines) != 1 {
		t.Errorf("a refused hand-back logged %d lines carrying the refusal, %d of them naming the ACL; want the one that names it", len(lines), named)
	}
	for _, s := range serials {
		if !e.RDB.HExists(context.Background(), e.Keys.Lease, s).Val() {
			t.Errorf("%s: no longer leased after a refused hand-back", s)
		}
	}
}
