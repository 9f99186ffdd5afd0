package e2e

// Named task queues (issue "Beyond orders"): each action runs against the
// real binary, Redis and PostgreSQL. Tests are named after the scenarios of
// the seed articles they reproduce.

import (
	"context"
	"crypto/hmac"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Seed 000, scenario 1 (a call record re-pushed to a third party until it
// accepts, then marked as undeliverable) with seed 001, scenario 2's
// growing delays (1 min, 2 min, … until a threshold).
func TestSeed001CallRecordRepushWebhookWithRetries(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	attempts := map[string][]int{}
	arrived := map[string][]time.Time{} // when each attempt reached the receiver
	keys := map[string]map[string]bool{}
	var badSig int
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		ts, _ := strconv.ParseInt(r.Header.Get(tasks.HeaderTimestamp), 10, 64)
		want := tasks.Sign([]byte(webhookSecret), ts, body)
		var b tasks.WebhookBody
		json.Unmarshal(body, &b)
		mu.Lock()
		defer mu.Unlock()
		if !hmac.Equal([]byte(want), []byte(r.Header.Get(tasks.HeaderSignature))) || time.Since(time.Unix(ts, 0)) > time.Minute {
			badSig++
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		attempts[b.ID] = append(attempts[b.ID], b.Attempt)
		arrived[b.ID] = append(arrived[b.ID], time.Now())
		if keys[b.ID] == nil {
			keys[b.ID] = map[string]bool{}
		}
		keys[b.ID][r.Header.Get(tasks.HeaderIdempotencyKey)] = true
		if b.ID == "cr-flaky" && b.Attempt == 1 || b.ID == "cr-down" {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	tw := newTaskWorld(t, `
queues:
  - name: callrecord
    key: PREFIX:callrecord
    action: {type: webhook, url: `+srv.URL+`, timeout: 2s, secret_env: OD_TEST_SECRET}
    retry: {backoff: [200ms, 400ms], max_attempts: 3}
`)
	d := tw.start()
	for _, id := range []string{"cr-ok", "cr-flaky", "cr-down"} {
		if code := d.call(http.MethodPut, "/v1/queues/callrecord/tasks/"+id, "", `{"after":"100ms","payload":{"call":"`+id+`","secs":42}}`, nil); code != http.StatusCreated {
			t.Fatalf("PUT %s: %d", id, code)
		}
	}
	waitFor(t, "cr-down given up on", 30*time.Second, func() bool {
		var got struct {
			State  string `json:"state"`
			Reason string `json:"reason"`
		}
		d.call(http.MethodGet, "/v1/queues/callrecord/tasks/cr-down", "", "", &got)
		return got.State == "dead" && got.Reason == "failed"
	})
	waitFor(t, "cr-ok and cr-flaky done", 30*time.Second, func() bool {
		return d.call(http.MethodGet, "/v1/queues/callrecord/tasks/cr-flaky", "", "", nil) == http.StatusNotFound &&
			d.call(http.MethodGet, "/v1/queues/callrecord/tasks/cr-ok", "", "", nil) == http.StatusNotFound
	})
	mu.Lock()
	defer mu.Unlock()
	if badSig != 0 {
		t.Errorf("%d requests with a bad signature", badSig)
	}
	if got := fmt.Sprint(attempts["cr-ok"], attempts["cr-flaky"], attempts["cr-down"]); got != "[1] [1 2] [1 2 3]" {
		t.Errorf("attempts per task %s, want [1] [1 2] [1 2 3] (the attempt count travels with the task)", got)
	}
	if len(keys["cr-flaky"]) != 1 || len(keys["cr-down"]) != 1 {
		t.Errorf("idempotency keys changed between attempts: %v", keys)
	}
	// The delays grow as the policy says: attempt n+1 cannot arrive before
	// the n-th delay has passed since attempt n arrived (the retry is
	// scheduled after the answer to attempt n). Only lower bounds are
	// exact; the upper bound is generous, for a loaded machine.
	backoff := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}
	for id, want := range map[string][]time.Duration{"cr-flaky": backoff[:1], "cr-down": backoff} {
		at := arrived[id]
		if len(at) != len(want)+1 {
			continue // the counts are checked above
		}
		for n, d := range want {
			gap := at[n+1].Sub(at[n])
			t.Logf("%s: attempt %d arrived %v after attempt %d (policy: %v)", id, n+2, gap, n+1, d)
			if gap < d-5*time.Millisecond || gap > d+20*time.Second {
				t.Errorf("%s: attempt %d arrived %v after attempt %d, want at least the policy's %v (and not 20 s more)", id, n+2, gap, n+1, d)
			}
		}
	}
	m := d.metrics()
	if m[`orderdelay_task_done_total{queue="callrecord"}`] != 2 || m[`orderdelay_task_dead_lettered_total{queue="callrecord",reason="failed"}`] != 1 {
		t.Errorf("task metrics: done %v, failed %v", m[`orderdelay_task_done_total{queue="callrecord"}`],
			m[`orderdelay_task_dead_lettered_total{queue="callrecord",reason="failed"}`])
	}
	d.stop()
}

// A webhook's redirect is a failed attempt, never a delivery: a followed
// 302 turned the signed POST into a GET whose 200 dropped the task, and a
// 307 re-sent the signed body to another host. And what the task API, the
// dead letters and the log record of a failure names the URL's scheme and
// host only: tokens in its path, query or userinfo stay out.
func TestWebhookRedirectFailsAndErrorsKeepURLTokens(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	landed := map[string]int{} // requests that reached a redirect's target, by server
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		landed["elsewhere"]++
		mu.Unlock()
	}))
	defer elsewhere.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/moved":
			http.Redirect(w, r, "/landing", http.StatusFound)
		case r.URL.Path == "/forwarded":
			http.Redirect(w, r, elsewhere.URL+"/landing", http.StatusTemporaryRedirect)
		case r.URL.Path == "/landing":
			mu.Lock()
			landed["landing"]++
			mu.Unlock()
		default:
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	host := srv.Listener.Addr().String()
	closedHost := testenv.FreeAddr(t) // nothing listens there
	tokened := func(h string) string { return "'http://user:USERSECRET@" + h + "/hook/PATHSECRET?token=QUERYSECRET'" }
	queueYAML := func(name, url string) string {
		return "  - name: " + name + "\n    key: PREFIX:" + name + "\n    action: {type: webhook, url: " + url +
			", timeout: 2s, secret_env: OD_TEST_SECRET}\n    retry: {backoff: [100ms], max_attempts: 2}\n"
	}
	tw := newTaskWorld(t, "queues:\n"+queueYAML("moved", srv.URL+"/moved")+queueYAML("forwarded", srv.URL+"/forwarded")+
		queueYAML("tokened", tokened(host))+queueYAML("unreachable", tokened(closedHost)))
	d := tw.start()
	type state struct {
		State     string `json:"state"`
		Reason    string `json:"reason"`
		LastError string `json:"last_error"`
	}
	cases := []struct{ queue, want string }{
		{"moved", "webhook http://" + host + ": status 302"},
		{"forwarded", "webhook http://" + host + ": status 307"},
		{"tokened", "webhook http://" + host + ": status 503"},
		{"unreachable", "webhook http://" + closedHost + ": "},
	}
	for _, c := range cases {
		if code := d.call(http.MethodPut, "/v1/queues/"+c.queue+"/tasks/t-1", "", `{"after":"10ms","payload":{"n":1}}`, nil); code != http.StatusCreated {
			t.Fatalf("PUT on %s: %d", c.queue, code)
		}
	}
	secrets := []string{"USERSECRET", "PATHSECRET", "QUERYSECRET"}
	for _, c := range cases {
		var got state
		waitFor(t, c.queue+": t-1 settled", 30*time.Second, func() bool {
			got = state{}
			code := d.call(http.MethodGet, "/v1/queues/"+c.queue+"/tasks/t-1", "", "", &got)
			return code == http.StatusNotFound || got.State == "dead"
		})
		if got.State != "dead" || got.Reason != "failed" {
			t.Errorf("%s: task state %q reason %q, want dead and failed (gone means it counted as delivered)", c.queue, got.State, got.Reason)
		}
		if !strings.HasPrefix(got.LastError, c.want) {
			t.Errorf("%s: last_error %q, want it to begin %q", c.queue, got.LastError, c.want)
		}
		tools, err := admin.New(tw.rdb, tw.prefix+":"+c.queue, nil)
		if err != nil {
			t.Fatal(err)
		}
		dead, err := tools.Dead(context.Background(), 10)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range secrets {
			if strings.Contains(got.LastError, s) {
				t.Errorf("%s: last_error %q holds the URL's %s", c.queue, got.LastError, s)
			}
			for _, e := range dead {
				if strings.Contains(e.LastError, s) {
					t.Errorf("%s: dead letter %q holds the URL's %s", c.queue, e.LastError, s)
				}
			}
		}
	}
	mu.Lock()
	if len(landed) != 0 {
		t.Errorf("redirects were followed: requests reached %v", landed)
	}
	mu.Unlock()
	d.stop()
	for _, s := range secrets {
		if strings.Contains(d.Output(), s) {
			t.Errorf("the daemon's log holds the URL's %s", s)
		}
	}
}

// During a secret rotation (previous_secret_env) each request carries a
// signature by each secret: a receiver still on the old secret finds its
// signature in the second header, and one comparing X-Orderdelay-Signature
// with the new secret, as every receiver did before rotations, still can.
func TestWebhookSecretRotation(t *testing.T) {
	t.Parallel()
	type request struct {
		h    http.Header
		body []byte
	}
	got := make(chan request, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		select {
		case got <- request{r.Header.Clone(), body}:
		default: // only the first request is checked
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	tw := newTaskWorld(t, `
queues:
  - name: rotating
    key: PREFIX:rotating
    action: {type: webhook, url: `+srv.URL+`, timeout: 2s, secret_env: OD_TEST_SECRET, previous_secret_env: OD_TEST_PREVIOUS_SECRET}
`)
	d := tw.start()
	if code := d.call(http.MethodPut, "/v1/queues/rotating/tasks/t-1", "", `{"after":"10ms","payload":{"n":1}}`, nil); code != http.StatusCreated {
		t.Fatalf("PUT: %d", code)
	}
	var r request
	select {
	case r = <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("no request within 30s")
	}
	ts, err := strconv.ParseInt(r.h.Get(tasks.HeaderTimestamp), 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", tasks.HeaderTimestamp, err)
	}
	if sig, want := r.h.Get(tasks.HeaderSignature), tasks.Sign([]byte(webhookSecret), ts, r.body); sig != want {
		t.Errorf("%s %q, want %q: Sign by the current secret alone", tasks.HeaderSignature, sig, want)
	}
	if sig, want := r.h.Get("X-Orderdelay-Signature-Previous"), tasks.Sign([]byte(previousWebhookSecret), ts, r.body); sig != want {
		t.Errorf("X-Orderdelay-Signature-Previous %q, want %q: Sign by the previous secret", sig, want)
	}
	d.stop()
}

// Seed 000: tasks with payloads, added and removed atomically, batch delete.
func TestSeed000PayloadTasksAndBatchDelete(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, `
queues:
  - name: later
    key: PREFIX:later
    action: {type: poll}
`)
	d := tw.start()
	ctx := context.Background()
	for i := range 5 {
		body := fmt.Sprintf(`{"after":"1h","payload":{"n":%d}}`, i)
		if code := d.call(http.MethodPut, fmt.Sprintf("/v1/queues/later/tasks/t-%d", i), "", body, nil); code != http.StatusCreated {
			t.Fatalf("PUT: %d", code)
		}
	}
	// A retry does not move the task or replace its payload.
	var got struct {
		Result  string          `json:"result"`
		Payload json.RawMessage `json:"payload"`
	}
	d.call(http.MethodPut, "/v1/queues/later/tasks/t-0", "", `{"after":"2h","payload":{"n":99}}`, &got)
	d.call(http.MethodGet, "/v1/queues/later/tasks/t-0", "", "", &got)
	if string(got.Payload) != `{"n":0}` {
		t.Errorf("payload after a retried create %s, want the first", got.Payload)
	}
	for _, bad := range []string{`{"after":"1h","payload":{bad}}`, `{"after":"1h","payload":1,"x":2}`} {
		if code := d.call(http.MethodPut, "/v1/queues/later/tasks/bad", "", bad, nil); code != http.StatusBadRequest {
			t.Errorf("PUT %s: %d, want 400", bad, code)
		}
	}
	if code := d.call(http.MethodPut, "/v1/queues/nope/tasks/x", "", `{"after":"1h"}`, nil); code != http.StatusNotFound {
		t.Errorf("unknown queue: %d, want 404", code)
	}
	var del struct {
		Deleted int `json:"deleted"`
	}
	if code := d.call(http.MethodPost, "/v1/queues/later/batch-delete", "", `{"ids":["t-0","t-1","t-2","missing"]}`, &del); code != http.StatusOK || del.Deleted != 3 {
		t.Fatalf("batch delete: %d, deleted %d, want 3", code, del.Deleted)
	}
	k := tw.keys("later")
	if n, _ := tw.rdb.HLen(ctx, k.Payload).Result(); n != 2 {
		t.Errorf("%d payloads left, want 2: payloads go with their entries", n)
	}
	if n, _ := tw.rdb.ZCard(ctx, k.Queue).Result(); n != 2 {
		t.Errorf("%d entries left, want 2", n)
	}
	out := tw.cli("task", "get", "later", "t-3", "--queues-file", tw.file)
	if !strings.Contains(out, `"n": 3`) {
		t.Errorf("task get: %s", out)
	}
	d.stop()
}

func TestTaskActionsStreamListSQLAndPoll(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, `
queues:
  - name: events
    key: PREFIX:events
    action: {type: stream}
  - name: ready
    key: PREFIX:ready
    action: {type: list}
  - name: reliable
    key: PREFIX:reliable
    action: {type: list, reliable: true, ack_timeout: 1s}
  - name: confirm
    key: PREFIX:confirm
    action: {type: sql, statement: "UPDATE receipts SET confirmed = true WHERE id = ANY($1) RETURNING id"}
  - name: jobs
    key: PREFIX:jobs
    lease: 1s
    action: {type: poll}
    retry: {max_attempts: 2}
`)
	if _, err := tw.db.Exec("CREATE TABLE receipts (id text PRIMARY KEY, confirmed bool NOT NULL DEFAULT false)"); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.db.Exec("INSERT INTO receipts (id) SELECT 'rcpt-' || g FROM generate_series(1, 50) g"); err != nil {
		t.Fatal(err)
	}
	d := tw.start()
	ctx := context.Background()
	put := func(q, id string) {
		t.Helper()
		if code := d.call(http.MethodPut, "/v1/queues/"+q+"/tasks/"+id, "", `{"after":"100ms","payload":{"id":"`+id+`"}}`, nil); code != http.StatusCreated {
			t.Fatalf("PUT %s/%s: %d", q, id, code)
		}
	}

	// stream: acknowledged delivery through a consumer group.
	ek := tw.keys("events")
	if err := tw.rdb.XGroupCreateMkStream(ctx, ek.Stream, "workers", "0").Err(); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		put("events", fmt.Sprintf("ev-%d", i))
	}
	var first []redis.XMessage
	waitFor(t, "stream entries", 20*time.Second, func() bool {
		res, err := tw.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "workers", Consumer: "c1", Streams: []string{ek.Stream, ">"}, Count: 10, Block: -1}).Result()
		if err == nil && len(res) == 1 {
			first = append(first, res[0].Messages...)
		}
		return len(first) == 3
	})
	if p := first[0].Values["payload"]; !strings.Contains(fmt.Sprint(p), `"ev-`) {
		t.Errorf("stream entry without its payload: %v", first[0].Values)
	}
	// c1 crashes before acking ev-0..2; another consumer claims them.
	claimed, _, err := tw.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: ek.Stream, Group: "workers", Consumer: "c2", MinIdle: 0, Start: "0"}).Result()
	if err != nil || len(claimed) != 3 {
		t.Fatalf("XAUTOCLAIM after a consumer crash: %d entries (%v), want 3", len(claimed), err)
	}

	// list: at-most-once ready list.
	put("ready", "r-1")
	waitFor(t, "ready list item", 20*time.Second, func() bool {
		v, err := tw.rdb.RPop(ctx, tw.keys("ready").Ready).Result()
		if err != nil {
			return false
		}
		var it client.ListItem
		return json.Unmarshal([]byte(v), &it) == nil && it.ID == "r-1" && strings.Contains(string(it.Payload), "r-1")
	})

	// reliable list: an unacknowledged item comes back.
	put("reliable", "rl-1")
	rc, err := client.New(tw.rdb, tw.prefix+":reliable")
	if err != nil {
		t.Fatal(err)
	}
	var it client.ListItem
	waitFor(t, "take", 20*time.Second, func() bool { it, err = rc.Take(ctx); return err == nil })
	if it.ID != "rl-1" || it.Attempts != 0 {
		t.Fatalf("took %+v", it)
	}
	// The consumer dies without Ack; after the queue's 1 s ack_timeout the
	// item is back, its earlier delivery counted.
	waitFor(t, "redelivered after the ack timeout", 20*time.Second, func() bool {
		it, err = rc.Take(ctx)
		return err == nil && it.ID == "rl-1"
	})
	if it.Attempts != 1 {
		t.Errorf("redelivered with attempts %d, want 1", it.Attempts)
	}
	if err := rc.Ack(ctx, it); err != nil {
		t.Fatal(err)
	}
	if n, _ := tw.rdb.LLen(ctx, tw.keys("reliable").Processing).Result(); n != 0 {
		t.Errorf("processing list holds %d after ack", n)
	}

	// sql: a set-based statement.
	for i := 1; i <= 50; i++ {
		put("confirm", fmt.Sprintf("rcpt-%d", i))
	}
	waitFor(t, "receipts confirmed", 20*time.Second, func() bool {
		return tw.count("SELECT count(*) FROM receipts WHERE confirmed") == 50
	})

	// poll: lease, ack, redelivery counted as an attempt, then failed.
	put("jobs", "j-1")
	put("jobs", "j-2")
	type polled struct {
		Token string `json:"token"`
		Tasks []struct {
			ID       string `json:"id"`
			Attempts int    `json:"attempts"`
		} `json:"tasks"`
	}
	// Both due on Redis's clock before the first poll, so one poll can
	// lease both (a poll within the millisecond of a put sees only one).
	waitFor(t, "both jobs due", 20*time.Second, func() bool {
		now, err := tw.rdb.Time(ctx).Result()
		if err != nil {
			return false
		}
		n, err := tw.rdb.ZCount(ctx, tw.keys("jobs").Queue, "-inf", strconv.FormatInt(now.UnixMilli(), 10)).Result()
		return err == nil && n == 2
	})
	var p polled
	waitFor(t, "poll returns both", 20*time.Second, func() bool {
		p = polled{}
		d.call(http.MethodPost, "/v1/queues/jobs/poll?max=10", "", "", &p)
		return len(p.Tasks) == 2
	})
	var ack struct {
		Acked int `json:"acked"`
	}
	both := p
	d.call(http.MethodPost, "/v1/queues/jobs/ack", "", `{"token":"`+p.Token+`","ids":["j-1"]}`, &ack)
	if ack.Acked != 1 {
		t.Fatalf("ack: %d", ack.Acked)
	}
	// j-2 was not acked: after its 1 s lease it comes back with one more
	// attempt. (On a busy machine the poll that returned both can be a
	// redelivery already, and a poll's answer can arrive after the test's
	// HTTP timeout: count from what the poll said, and accept any later
	// attempt, or the task already dead after its second.)
	before := -1
	for _, tk := range both.Tasks {
		if tk.ID == "j-2" {
			before = tk.Attempts
		}
	}
	waitFor(t, "j-2 redelivered", 20*time.Second, func() bool {
		p = polled{}
		d.call(http.MethodPost, "/v1/queues/jobs/poll?max=10", "", "", &p)
		if len(p.Tasks) == 1 && p.Tasks[0].ID == "j-2" && p.Tasks[0].Attempts > before {
			return true
		}
		var got struct {
			State    string `json:"state"`
			Attempts int    `json:"attempts"`
		}
		d.call(http.MethodGet, "/v1/queues/jobs/tasks/j-2", "", "", &got)
		return got.State == "dead" && got.Attempts == 2
	})
	waitFor(t, "j-2 failed after max attempts", 20*time.Second, func() bool {
		d.call(http.MethodPost, "/v1/queues/jobs/poll?max=10", "", "", nil)
		var got struct {
			State string `json:"state"`
		}
		d.call(http.MethodGet, "/v1/queues/jobs/tasks/j-2", "", "", &got)
		return got.State == "dead"
	})
	if code := d.call(http.MethodPost, "/v1/queues/events/poll", "", "", nil); code != http.StatusConflict {
		t.Errorf("polling a stream queue: %d, want 409", code)
	}
	m := d.metrics()
	if m[`orderdelay_task_forwarded_total{queue="events"}`] != 3 {
		t.Errorf("forwarded{events} %v, want 3", m[`orderdelay_task_forwarded_total{queue="events"}`])
	}
	d.stop()
}

func TestTaskQueuesFileErrorsExit2AndOrdersStillClose(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, "queues:\n  - name: side\n    key: PREFIX:side\n    action: {type: stream}\n")
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte("queues:\n  - name: x\n    action: {type: carrier-pigeon}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bd := tw.launch(t, nil, "ORDERDELAY_QUEUES_FILE="+bad)
	if code := bd.exit(60 * time.Second); code != 2 || !strings.Contains(bd.Output(), "ORDERDELAY_QUEUES_FILE") {
		t.Fatalf("bad queues file: exit %d, output:\n%s", code, bd.Output())
	}
	// With a valid file, the order queue runs exactly as before.
	d := tw.start()
	past := time.Now().Add(-time.Second)
	tw.zadd(tw.createOrders("with-tasks", 100, past), float64(queue.DeadlineMillis(past)))
	waitFor(t, "orders closed", 30*time.Second, func() bool { return tw.closed() == 100 })
	d.stop()
}

// A dry run changes nothing in Redis: the task queues are not served
// either (their actions would forward, call webhooks and run SQL for real).
func TestDryRunLeavesTaskQueuesAlone(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, "queues:\n  - name: events\n    key: PREFIX:events\n    action: {type: stream}\n")
	ctx := context.Background()
	ek := tw.keys("events")
	tc, err := client.New(tw.rdb, ek.Queue)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := tc.PutTask(ctx, "ev-due", json.RawMessage(`{"n":1}`), time.Now().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	past := time.Now().Add(-time.Minute)
	tw.zadd(tw.createOrders("dry", 1, past), float64(queue.DeadlineMillis(past)))
	d := tw.start("ORDERDELAY_DRY_RUN=true")
	waitFor(t, "dry run reports the order", 30*time.Second, func() bool {
		return d.metrics()["orderdelay_dry_run_would_close_total"] == 1
	})
	d.stop()
	if n, _ := tw.rdb.XLen(ctx, ek.Stream).Result(); n != 0 {
		t.Errorf("%d messages forwarded to the task stream in a dry run", n)
	}
	if _, err := tw.rdb.ZScore(ctx, ek.Queue, "ev-due").Result(); err != nil {
		t.Errorf("the due task left its queue in a dry run: %v", err)
	}
}
