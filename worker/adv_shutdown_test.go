package worker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// ShutdownTimeout is "how long Run waits for running handlers after its
// context ends": counted from the end of the context, not from the claim
// loops' return. A claim loop inside a poll whose reply Redis holds (a
// stuck primary) returns only when go-redis gives up on it, a whole read
// timeout later; a Kubernetes pod whose grace period was sized from
// ShutdownTimeout would be killed before the handlers were cancelled and
// their tasks handed back.
func TestAdvShutdownTimeoutCountsFromTheContextsEnd(t *testing.T) {
	e := newEnv(t)
	o, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.NewProxy(t, o.Addr)
	o.Addr, o.ReadTimeout = proxy.Addr(), time.Minute // a stalled call holds its caller a minute
	rdb := redis.NewClient(o)
	t.Cleanup(func() { rdb.Close() })
	hook := testenv.NewSentAfter()
	rdb.AddHook(hook)

	// A long lease: no heartbeat extends it (nor cancels it as expired)
	// while the test runs, so the first command after the stall is the
	// claim loop's next poll.
	q := e.queue(3 * time.Minute)
	q.Concurrency = 2
	e.put("held", `{}`)
	began, cancelled := make(chan struct{}), make(chan struct{})
	const timeout = 300 * time.Millisecond
	w := newWorker(t, rdb, Config{ShutdownTimeout: timeout})
	if err := w.Handle(q, func(ctx context.Context, _ *Task) error {
		close(began)
		<-ctx.Done()
		close(cancelled)
		return ctx.Err()
	}); err != nil {
		t.Fatal(err)
	}
	stop, wait := start(t, w)
	t.Cleanup(func() { proxy.Stall(0) })
	<-began
	proxy.Stall(5 * time.Minute) // ended below, or at cleanup
	hook.Arm()
	select {
	case <-hook.Sent():
	case <-time.After(30 * time.Second):
		t.Fatal("the claim loop sent nothing to Redis within 30 s of the stall")
	}
	stopped := time.Now()
	stop()
	// Generous against a busy machine, far below the poll's read timeout.
	const bound = 20 * time.Second
	select {
	case <-cancelled:
		t.Logf("the running handler was cancelled %s after the context ended (ShutdownTimeout %s)",
			time.Since(stopped).Round(time.Millisecond), timeout)
	case <-time.After(bound):
		t.Fatalf("the running handler was not cancelled within %s of the context's end (ShutdownTimeout %s): "+
			"the timeout began only once the claim loop's Redis call returned", bound, timeout)
	}
	proxy.Stall(0)
	if err := wait(); !errors.Is(err, ErrShutdownTimeout) {
		t.Errorf("Run returned %v, want ErrShutdownTimeout", err)
	}
}
