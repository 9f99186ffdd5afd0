package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/preflight"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestOrderQueueAloneRunsWithoutListsAndStreams: a daemon with only the
// order queue (shards, reconciler, janitor, relay with close events, the
// producer API, the admin tools and the gauges) under a user refused
// @list and @stream (but XADD, with close events) sends no command the
// user is refused: the narrowed start-up check is no false pass.
func TestOrderQueueAloneRunsWithoutListsAndStreams(t *testing.T) {
	for _, events := range []bool{true, false} {
		t.Run(fmt.Sprintf("close_events=%v", events), func(t *testing.T) {
			admin, addr := testenv.PrivateRedis(t)
			ctx := context.Background()
			rules := []any{"acl", "setuser", "od", "on", ">pw", "~*", "&*", "+@all", "-@list", "-@stream"}
			if events {
				rules = append(rules, "+xadd")
			}
			if err := admin.Do(ctx, rules...).Err(); err != nil {
				t.Fatal(err)
			}
			db, dsn := testenv.Postgres(t)
			q := queue.DefaultKey
			cfg := daemonConfig(t, queue.NewKeys(q), dsn, map[string]string{
				"ORDERDELAY_REDIS_URL":             fmt.Sprintf("redis://od:pw@%s/0", addr),
				"ORDERDELAY_CLOSE_EVENTS":          fmt.Sprint(events),
				"ORDERDELAY_QUEUE_SHARDS":          "2",
				"ORDERDELAY_LEASE":                 "2s",
				"ORDERDELAY_DRAIN_TIMEOUT":         "1s",
				"ORDERDELAY_STATEMENT_TIMEOUT":     "1s",
				"ORDERDELAY_RECONCILE_INTERVAL":    "200ms",
				"ORDERDELAY_RECONCILE_GRACE":       "3s",
				"ORDERDELAY_DEAD_LETTER_RETENTION": "1h",
				"ORDERDELAY_API_AUTH":              "none",
				"ORDERDELAY_ADMIN_TOKEN":           "admin-token-0123456789",
				"ORDERDELAY_ADMIN_ADDR":            "127.0.0.1:0",
			})
			// Orders due now (closed by the consumer), one long overdue and
			// not queued (the reconciler's), one in the future (extend).
			past := time.Now().Add(-time.Hour)
			due := make([]string, 10)
			for i := range due {
				due[i] = fmt.Sprintf("due-%05d", i)
			}
			if _, err := db.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT s, now() - interval '1 minute' FROM unnest($1::text[]) s`, "{"+strings.Join(due, ",")+"}"); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ('lost-1', $1), ('later-1', now() + interval '1 hour')`, past); err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			d := startDaemon(t, cfg, daemonOptions{started: func(ctx context.Context, d *daemon) {
				defer func() { <-ctx.Done() }()
				defer close(done)
				api := httptest.NewServer(d.api.Handler())
				defer api.Close()
				adm := httptest.NewServer(d.api.AdminHandler())
				defer adm.Close()
				call := func(srv *httptest.Server, method, path, body string, token bool) {
					req, _ := http.NewRequestWithContext(ctx, method, srv.URL+path, strings.NewReader(body))
					if token {
						req.Header.Set("Authorization", "Bearer admin-token-0123456789")
					}
					if body != "" {
						req.Header.Set("Content-Type", "application/json")
					}
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Errorf("%s %s: %v", method, path, err)
						return
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					t.Logf("%s %s: %d %.200s", method, path, resp.StatusCode, b)
					if resp.StatusCode >= 500 {
						t.Errorf("%s %s: %d %s", method, path, resp.StatusCode, b)
					}
				}
				items := make([]client.Item, len(due))
				for i, s := range due {
					items[i] = client.Item{Serial: s, Deadline: time.Now().Add(-time.Minute)}
				}
				if _, err := d.prod.Client().EnqueueMany(ctx, items, client.Create); err != nil {
					t.Errorf("enqueue: %v", err)
				}
				call(api, "PUT", "/v1/timeouts/later-1", `{"after":"1h"}`, false)
				call(api, "GET", "/v1/timeouts/later-1", "", false)
				call(api, "PUT", "/v1/timeouts/gone-1", `{"after":"1h"}`, false)
				call(api, "DELETE", "/v1/timeouts/gone-1", "", false)
				// A malformed member: the claim dead-letters it.
				if err := admin.ZAdd(ctx, q, redis.Z{Score: 1, Member: "bad member!"}).Err(); err != nil {
					t.Error(err)
				}
				waitFor(t, "the due orders closed", time.Minute, func() bool {
					var n int
					_ = db.Get(&n, `SELECT count(*) FROM orders WHERE status <> 'pending' AND serial_no <> 'later-1'`)
					return n == len(due)+1
				})
				if events {
					waitFor(t, "close events relayed", 30*time.Second, func() bool {
						return admin.XLen(ctx, "{"+q+"}:events").Val() >= int64(len(due)+1)
					})
				}
				call(api, "GET", "/metrics", "", false)
				call(api, "GET", "/readyz", "", false)
				call(adm, "GET", "/admin/v1/pause", "", true)
				call(adm, "POST", "/admin/v1/pause", `{"reason":"test"}`, true)
				call(adm, "POST", "/admin/v1/resume", "", true)
				call(adm, "POST", "/admin/v1/extend", `{"within":"2h","by":"1m"}`, true)
				call(adm, "POST", "/admin/v1/resync", `{}`, true)
				call(adm, "GET", "/admin/v1/orders/later-1", "", true)
				call(adm, "GET", "/admin/v1/dead", "", true)
				call(adm, "POST", "/admin/v1/dead/requeue", `{"serials":["bad member!"]}`, true)
				call(adm, "POST", "/admin/v1/dead/purge", `{"older_than":"1ms"}`, true)
				if _, err := d.tools.Unbatch(ctx, 100); err != nil {
					t.Errorf("unbatch: %v", err)
				}
				if _, _, err := readQueueStats(ctx, d.rdb, d.cfg); err != nil {
					t.Errorf("stats: %v", err)
				}
				call(adm, "POST", "/admin/v1/dead/requeue", `{"all":true}`, true)
				time.Sleep(time.Second) // a few more scans, reconciler and relay passes
			}})
			select {
			case <-done:
			case <-d.done:
				t.Fatalf("the daemon stopped: %v", d.err)
			case <-time.After(3 * time.Minute):
				t.Fatal("the daemon never ran the paths")
			}
			d.cancel()
			<-d.done
			log, err := admin.Do(ctx, "acl", "log").Slice()
			if err != nil {
				t.Fatal(err)
			}
			if len(log) > 0 {
				t.Errorf("ACL LOG holds %d refusals, want none: %v", len(log), log)
			}
			for _, k := range queue.ShardKeys(q, 2) {
				if n := admin.Exists(ctx, k.Events).Val(); n != 0 {
					t.Errorf("%s exists: the relay wrote a shard's events stream", k.Events)
				}
			}
			stats := admin.Info(ctx, "commandstats").Val()
			for _, line := range strings.Split(stats, "\n") {
				name, _, _ := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":")
				if !strings.HasPrefix(line, "cmdstat_") {
					continue
				}
				if (strings.HasPrefix(name, "x") || strings.HasPrefix(name, "l") || strings.HasPrefix(name, "r") && strings.HasSuffix(name, "push")) &&
					!(events && name == "xadd") && !(name == "xlen") {
					t.Errorf("the daemon sent %s", strings.TrimSpace(line))
				}
				if strings.Contains(line, "rejected_calls=") && !strings.Contains(line, "rejected_calls=0,") {
					t.Errorf("rejected: %s", strings.TrimSpace(line))
				}
			}
			t.Logf("commandstats:\n%s", stats)
		})
	}
}

// TestTaskQueuesStillNeedListsAndStreams: with a task queue configured the
// daemon asks about every list and stream command (the queue's forward,
// take, ack and stream-bury scripts): a user refused them does not start.
func TestTaskQueuesStillNeedListsAndStreams(t *testing.T) {
	url, dbsize := redisUser(t, "~*", "&*", "+@all", "-@list", "-@stream", "+xadd")
	_, dsn := testenv.Postgres(t)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(file, []byte("queues:\n  - name: jobs\n    action: {type: poll}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := daemonConfig(t, queue.NewKeys(queue.DefaultKey), dsn, map[string]string{"ORDERDELAY_REDIS_URL": url, "ORDERDELAY_QUEUES_FILE": file})
	d := startDaemon(t, cfg, daemonOptions{started: func(context.Context, *daemon) { t.Error("the daemon started its work") }})
	select {
	case <-d.done:
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon still runs a minute after its start")
	}
	var ue usageError
	var pe *preflight.PermissionError
	if !errors.As(d.err, &ue) || !errors.As(d.err, &pe) {
		t.Fatalf("runDaemon: %v, want a configuration error (exit 2): a refused permission", d.err)
	}
	want := []string{"LPUSH", "RPUSH", "LLEN", "LINDEX", "LREM", "LMOVE", "XACK", "XPENDING", "XRANGE", "XINFO GROUPS"}
	got := map[string]bool{}
	for _, r := range pe.Refusals {
		got[r.Command] = true
	}
	for _, c := range want {
		if !got[c] {
			t.Errorf("%s not refused: %v", c, d.err)
		}
	}
	if len(got) != len(want) {
		t.Errorf("refused %v, want exactly %v", got, want)
	}
	if n := dbsize(); n != 0 {
		t.Errorf("%d keys in Redis after the refused start, want none", n)
	}
}

// waitFor is testenv.WaitFor for a goroutine other than the test's: it
// reports with Errorf, and says whether cond became true.
func waitFor(t *testing.T, what string, within time.Duration, cond func() bool) bool {
	t.Helper()
	for end := time.Now().Add(within); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	t.Errorf("%s: not true within %s", what, within)
	return false
}
