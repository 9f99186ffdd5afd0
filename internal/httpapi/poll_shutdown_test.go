package httpapi_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
)

// deadConn is a response whose connection is gone (the daemon is shutting
// down, or the client went away): every write fails.
type deadConn struct{ h http.Header }

func (d *deadConn) Header() http.Header       { return d.h }
func (d *deadConn) WriteHeader(int)           {}
func (d *deadConn) Write([]byte) (int, error) { return 0, errors.New("connection closed") }

// A poll queue during shutdown: the daemon holds nothing between polls,
// so what a poll leased while its answer could not be delivered stays
// leased and comes back to the next poll once the lease ends, every task
// once, with one attempt counted; a task not yet due is never handed out.
func TestPollInterruptedByShutdownLosesNothing(t *testing.T) {
	e := newPollAPI(t)
	ctx := context.Background()
	ids := []string{"p-1", "p-2", "p-3"}
	e.putDue(t, e.jobs, `{"n":1}`, ids...)
	c, err := client.New(e.rdb, e.jobs.Queue)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.PutTask(ctx, "later", nil, time.Now().Add(time.Hour), client.Create); err != nil {
		t.Fatal(err)
	}
	e.h.ServeHTTP(&deadConn{h: http.Header{}}, httptest.NewRequest(http.MethodPost, "/v1/queues/jobs/poll?max=10", nil))
	held, err := e.rdb.ZRange(ctx, e.jobs.Inflight, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(held)
	if !slices.Equal(held, ids) {
		t.Fatalf("leased by the interrupted poll: %q, want %q", held, ids)
	}
	if p := e.poll(t, "jobs", 10); len(p.Tasks) != 0 {
		t.Fatalf("a poll during the lease got %d tasks, want none", len(p.Tasks))
	}
	// The lease ends (written where the claim reads it, not waited for).
	past := float64(time.Now().Add(-time.Second).UnixMilli())
	for _, id := range ids {
		if err := e.rdb.ZAddXX(ctx, e.jobs.Inflight, redis.Z{Score: past, Member: id}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	p := e.poll(t, "jobs", 10)
	var got []string
	for _, tk := range p.Tasks {
		got = append(got, tk.ID)
		if tk.Attempts != 1 || string(tk.Payload) != `{"n":1}` {
			t.Errorf("%s redelivered with attempts %d, payload %s; want 1 and its payload", tk.ID, tk.Attempts, tk.Payload)
		}
	}
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		t.Fatalf("redelivered %q, want %q", got, ids)
	}
	if a := e.ack(t, "jobs", p.Token, ids...); a.Acked != len(ids) {
		t.Fatalf("ack: %+v", a)
	}
	if n, _ := e.rdb.ZCard(ctx, e.jobs.Queue).Result(); n != 1 {
		t.Fatalf("%d tasks queued at the end, want only the one not yet due", n)
	}
	if n, _ := e.rdb.HLen(ctx, e.jobs.Payload).Result(); n != 1 {
		t.Fatalf("%d payloads at the end, want only the waiting task's", n)
	}
}
