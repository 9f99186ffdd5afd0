package httpapi_test

// Long poll (issue 12, item 3): POST …/poll?wait=… answers as soon as a
// task is due, or empty after the wait; a client that goes away leases
// nothing. Real Redis, the real handler.

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

type longPoll struct {
	code int
	raw  string
	took time.Duration
	polled
}

// startPoll runs a poll of "plain" with query in the background.
func (e *produceEnv) startPoll(ctx context.Context, t *testing.T, query string) <-chan longPoll {
	t.Helper()
	out := make(chan longPoll, 1)
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/queues/plain/poll?"+query, nil)
	go func() {
		start := time.Now()
		rec := httptest.NewRecorder()
		e.h.ServeHTTP(rec, req)
		lp := longPoll{code: rec.Code, raw: rec.Body.String(), took: time.Since(start)}
		_ = json.Unmarshal(rec.Body.Bytes(), &lp.polled)
		out <- lp
	}()
	return out
}

// waitSubscribed waits until n polls listen on the queue's wake channel.
func (e *produceEnv) waitSubscribed(t *testing.T, k queue.Keys, n int64) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		m, err := e.rdb.PubSubNumSub(context.Background(), k.Wake).Result()
		if err != nil {
			t.Fatal(err)
		}
		if m[k.Wake] == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d subscribers on %s, want %d", m[k.Wake], k.Wake, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (e *produceEnv) client(t *testing.T, k queue.Keys) *client.Client {
	t.Helper()
	c, err := client.New(e.rdb, k.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func receive(t *testing.T, ch <-chan longPoll) longPoll {
	t.Helper()
	select {
	case lp := <-ch:
		return lp
	case <-time.After(time.Minute):
		t.Fatal("the poll never answered")
		return longPoll{}
	}
}

// A task put while a poll waits is handed to that poll.
func TestLongPollReturnsATaskPutDuringTheWait(t *testing.T) {
	e := newProduceAPI(t, false)
	ch := e.startPoll(context.Background(), t, "max=5&wait=20s")
	e.waitSubscribed(t, e.plain, 1)
	if _, _, err := e.client(t, e.plain).PutTask(context.Background(), "late", json.RawMessage(`{"n":1}`), time.Now(), client.Create); err != nil {
		t.Fatal(err)
	}
	lp := receive(t, ch)
	if lp.code != http.StatusOK || len(lp.Tasks) != 1 || lp.Tasks[0].ID != "late" || lp.Token == "" {
		t.Fatalf("poll: %d %s, want task late under a token", lp.code, lp.raw)
	}
	if e.leaseTokenOf(t, "late") != lp.Token {
		t.Errorf("late is not leased under the poll's token %s", lp.Token)
	}
	e.waitSubscribed(t, e.plain, 0) // the answered poll stops listening
}

// A task that becomes due within the wait is handed out once due, not
// before.
func TestLongPollReturnsATaskDueWithinTheWait(t *testing.T) {
	e := newProduceAPI(t, false)
	due := time.Now().Add(1500 * time.Millisecond)
	if _, _, err := e.client(t, e.plain).PutTask(context.Background(), "soon", nil, due, client.Create); err != nil {
		t.Fatal(err)
	}
	lp := receive(t, e.startPoll(context.Background(), t, "wait=15"))
	if lp.code != http.StatusOK || len(lp.Tasks) != 1 || lp.Tasks[0].ID != "soon" {
		t.Fatalf("poll: %d %s, want task soon", lp.code, lp.raw)
	}
	now, err := e.rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	if now.Before(due) {
		t.Errorf("handed out at %s (Redis clock), before it was due at %s", now, due)
	}
}

// With nothing due within the wait, the poll answers empty after it.
func TestLongPollWithNothingDueAnswersEmptyAfterTheWait(t *testing.T) {
	e := newProduceAPI(t, false)
	if _, _, err := e.client(t, e.plain).PutTask(context.Background(), "later", nil, time.Now().Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	lp := receive(t, e.startPoll(context.Background(), t, "wait=1500ms"))
	if lp.code != http.StatusOK || len(lp.Tasks) != 0 || lp.Token != "" {
		t.Fatalf("poll: %d %s, want an empty answer", lp.code, lp.raw)
	}
	if lp.took < 1500*time.Millisecond {
		t.Errorf("answered after %s, want after the whole wait of 1.5s", lp.took)
	}
	if n := e.count(t, e.plain); n != 1 {
		t.Errorf("queue holds %d tasks, want later still there", n)
	}
}

// A client that goes away ends its wait; nothing is leased for it, so a
// task that becomes due afterwards stays in the queue for the next poll.
func TestLongPollCancelledLeasesNothing(t *testing.T) {
	e := newProduceAPI(t, false)
	due := time.Now().Add(time.Second)
	if _, _, err := e.client(t, e.plain).PutTask(context.Background(), "after-cancel", nil, due, client.Create); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ch := e.startPoll(ctx, t, "wait=20s")
	e.waitSubscribed(t, e.plain, 1)
	cancel()
	lp := receive(t, ch)
	if len(lp.Tasks) != 0 {
		t.Fatalf("cancelled poll answered %s, want no tasks", lp.raw)
	}
	if lp.took >= 20*time.Second {
		t.Errorf("cancelled poll ran its whole wait (%s)", lp.took)
	}
	e.waitSubscribed(t, e.plain, 0)
	for { // until the task is due on Redis's clock
		now, err := e.rdb.Time(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		if now.After(due.Add(100 * time.Millisecond)) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if tok := e.leaseTokenOf(t, "after-cancel"); tok != "" {
		t.Errorf("after-cancel is leased under %s after its poll was cancelled", tok)
	}
	if n := e.count(t, e.plain); n != 1 {
		t.Errorf("queue holds %d tasks, want after-cancel", n)
	}
}

func (e *produceEnv) leaseTokenOf(t *testing.T, id string) string {
	t.Helper()
	p := &pollEnv{rdb: e.rdb}
	return p.leaseToken(t, e.plain, id)
}

// A bad wait is 400 and leases nothing.
func TestLongPollRefusesABadWait(t *testing.T) {
	e := newProduceAPI(t, false)
	// A second ago: time.Now() rounds up to the next millisecond, which a
	// fast poll may not have reached yet.
	if _, _, err := e.client(t, e.plain).PutTask(context.Background(), "due", nil, time.Now().Add(-time.Second), client.Create); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"abc", "-1s", "21s", "21", "1h", "-1", "10x", "%20"} {
		lp := receive(t, e.startPoll(context.Background(), t, "wait="+w))
		if lp.code != http.StatusBadRequest || lp.Error == "" {
			t.Errorf("wait=%s: %d %s, want 400 with an error", w, lp.code, lp.raw)
		}
	}
	if tok := e.leaseTokenOf(t, "due"); tok != "" {
		t.Errorf("due leased by a refused poll")
	}
	lp := receive(t, e.startPoll(context.Background(), t, "wait=0"))
	if lp.code != http.StatusOK || len(lp.Tasks) != 1 {
		t.Errorf("wait=0: %d %s, want the due task at once", lp.code, lp.raw)
	}
}

// Shutdown does not wait out a long poll: once the daemon is stopping, a
// waiting poll answers empty at its next look (within a second), so the
// HTTP server's shutdown is not held up for the whole wait.
func TestLongPollEndsWhenTheServerStops(t *testing.T) {
	e := newProduceAPI(t, false)
	ch := e.startPoll(context.Background(), t, "wait=20s")
	e.waitSubscribed(t, e.plain, 1)
	e.api.SetStopping()
	lp := receive(t, ch)
	if lp.code != http.StatusOK || len(lp.Tasks) != 0 || lp.took >= 20*time.Second {
		t.Errorf("poll while stopping: %d %s after %s, want an empty answer before the wait ends", lp.code, lp.raw, lp.took)
	}
}
