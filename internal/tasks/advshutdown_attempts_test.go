package tasks

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// A task that already spent an attempt (its first run failed; it backed
// off and was claimed again) is running when the daemon stops, and the
// drain cuts it: the hand-back must keep what the task has spent, as the
// Go worker's release does (releaseScript: "so its attempts survive").
// Otherwise every stop that meets a retry of the task gives it its
// attempts back, and max_attempts no longer bounds its runs: a task that
// fails slowly on a queue whose replicas are restarted (a rolling
// deploy, an autoscaler) is run without end and never dead-lettered.
func TestAdvShutdownHandBackKeepsTheAttemptsATaskSpent(t *testing.T) {
	srvURL, runs, second := secondRunCutWebhook(t)
	s := newShutdownEnv(t, `lease: 1m, batch_size: 1, workers: 1, retry: {backoff: [10ms], max_attempts: 3}, `+
		`action: {type: webhook, url: '`+srvURL+`', timeout: 20s, secret_env: OD_SHUT_SECRET}`, nil)
	ids := s.put("a", 1, time.Now().Add(-time.Second))
	stop := s.run(300 * time.Millisecond)
	awaitSecondRun(t, second, runs)
	stop()
	if n := runs.Load(); n != 2 {
		t.Fatalf("%d runs before the stop returned, want 2", n)
	}
	tk, err := s.r.Client.GetTask(context.Background(), ids[0])
	if err != nil {
		t.Fatalf("%s after the stop: %v (lost)", ids[0], err)
	}
	if tk.Attempts != 1 {
		t.Errorf("%s handed back with attempts %d, want the 1 its failed first run spent (state %s)", ids[0], tk.Attempts, tk.State)
	}
}

// secondRunCutWebhook is a webhook endpoint (its secret in OD_SHUT_SECRET)
// whose every run fails but the second, which runs until the client goes
// away (a drain cuts it); second is closed when that run begins.
func secondRunCutWebhook(t *testing.T) (url string, runs *atomic.Int32, second <-chan struct{}) {
	t.Helper()
	t.Setenv("OD_SHUT_SECRET", "0123456789abcdef0123456789abcdef")
	runs = new(atomic.Int32)
	began := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Read whole, so the server notices the client going away.
		io.Copy(io.Discard, r.Body) //nolint:errcheck // only counted
		if runs.Add(1) == 2 {
			close(began)
			<-r.Context().Done()
			return
		}
		w.WriteHeader(http.StatusInternalServerError)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, runs, began
}

// awaitSecondRun waits until secondRunCutWebhook's second run has begun.
func awaitSecondRun(t *testing.T, second <-chan struct{}, runs *atomic.Int32) {
	t.Helper()
	select {
	case <-second:
	case <-time.After(30 * time.Second):
		t.Fatalf("the task's second run did not start (%d runs)", runs.Load())
	}
}
