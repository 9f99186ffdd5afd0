package httpapi

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// Long poll: POST /v1/queues/{queue}/poll?max=N&wait=10s answers as soon
// as a task is due, or after wait with no tasks.

// MaxPollWait bounds a poll's wait: well below the daemon's 30 s write
// timeout, which counts from the request to the end of the answer.
const MaxPollWait = 20 * time.Second

// pollRecheck is the longest a waiting poll goes without looking at the
// queue: producers that ZADD directly publish no wake-up, a pause may end,
// and a daemon shutting down ends its waits within it.
const pollRecheck = time.Second

// pollMinPause keeps a waiting poll from spinning when a task is due but
// the claim took none (only tasks over their attempts, which it buried).
const pollMinPause = 50 * time.Millisecond

// pollWait reads a poll's wait parameter: a duration (10s) or whole
// seconds (10), 0 to MaxPollWait; none is 0, no wait. ok is false (and the
// answer written) when it is malformed.
func pollWait(w http.ResponseWriter, r *http.Request) (time.Duration, bool) {
	v := r.URL.Query().Get("wait")
	if v == "" {
		return 0, true
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		n, nerr := strconv.Atoi(v)
		if nerr == nil && n >= 0 && n <= int(MaxPollWait/time.Second) {
			d, err = time.Duration(n)*time.Second, nil
		}
	}
	if err != nil || d < 0 || d > MaxPollWait {
		writeInvalid(w, "wait", fmt.Sprintf("wait: want a duration from 0s to %s, such as 10s", MaxPollWait))
		return 0, false
	}
	return d, true
}

// claimPolled claims up to limit due tasks of poll queue q, waiting up to
// wait for one to become due. It wakes when a producer publishes an
// earlier deadline on the queue's wake channel, when the queue's next due
// time (or lease expiry) comes, and at least every pollRecheck. A client
// that goes away ends the wait; nothing is leased after that.
func (s *Server) claimPolled(ctx context.Context, q *tasks.Runtime, limit int, lease, wait time.Duration) ([]queue.Task, string, error) {
	claim := func() ([]queue.Task, string, error) {
		return q.Poll(ctx, limit, MaxPollBytes-pollEnvelopeBytes, lease, s.log)
	}
	if wait <= 0 {
		return claim()
	}
	wake, done := s.wakes.subscribe(q.Redis, q.Keys.Wake)
	defer done()
	end := time.Now().Add(wait)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		if ctx.Err() != nil {
			return nil, "", nil // the client went away: lease nothing
		}
		ts, tok, err := claim()
		if err != nil || len(ts) > 0 {
			return ts, tok, err
		}
		left := time.Until(end)
		if left <= 0 || s.stopping.Load() {
			return nil, "", nil
		}
		now, next, err := q.Store.NextDue(ctx)
		if err != nil {
			return nil, "", err
		}
		d := min(left, pollRecheck)
		if next >= 0 {
			d = min(d, max(time.Duration(next-now)*time.Millisecond, pollMinPause))
		}
		timer.Reset(d)
		select {
		case <-ctx.Done():
			return nil, "", nil
		case <-wake:
		case <-timer.C:
		}
	}
}

// wakeHub shares one Redis subscription among a server's waiting polls:
// it subscribes to a queue's wake channel while a poll of that queue
// waits, and closes the subscription when none waits. The zero value is
// ready to use.
type wakeHub struct {
	mu      sync.Mutex
	ps      *redis.PubSub
	waiters map[string]map[chan struct{}]struct{}
}

// subscribe returns a channel that receives (without blocking the hub) when
// a deadline is published on channel, and a func that ends the
// subscription. A lost message is harmless: waiting polls look again every
// pollRecheck.
func (h *wakeHub) subscribe(rdb redis.UniversalClient, channel string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.waiters == nil {
		h.waiters = map[string]map[chan struct{}]struct{}{}
	}
	ws := h.waiters[channel]
	if ws == nil {
		ws = map[chan struct{}]struct{}{}
		h.waiters[channel] = ws
		if h.ps == nil {
			h.ps = rdb.Subscribe(context.Background(), channel)
			go h.forward(h.ps)
		} else {
			_ = h.ps.Subscribe(context.Background(), channel) // failed: the recheck catches up
		}
	}
	ws[ch] = struct{}{}
	return ch, func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		delete(ws, ch)
		if len(ws) > 0 {
			return
		}
		delete(h.waiters, channel)
		if len(h.waiters) == 0 {
			_ = h.ps.Close() // ends forward
			h.ps = nil
		} else {
			_ = h.ps.Unsubscribe(context.Background(), channel)
		}
	}
}

// forward hands each message of ps to the polls waiting on its channel,
// until ps is closed.
func (h *wakeHub) forward(ps *redis.PubSub) {
	for msg := range ps.Channel() {
		h.mu.Lock()
		for ch := range h.waiters[msg.Channel] {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
		h.mu.Unlock()
	}
}
