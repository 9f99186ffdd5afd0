package client_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// newClient returns a client on a queue of the test's own, with the raw
// Redis client and keys for inspection.
func newClient(t *testing.T) (*client.Client, *redis.Client, queue.Keys) {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	c, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatalf("client.New(%q): %v", keys.Queue, err)
	}
	return c, rdb, keys
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// zscore returns the score of serial in the queue, failing if absent.
func zscore(t *testing.T, rdb *redis.Client, key, serial string) int64 {
	t.Helper()
	s, err := rdb.ZScore(context.Background(), key, serial).Result()
	if err != nil {
		t.Fatalf("ZSCORE %s %s: %v", key, serial, err)
	}
	return int64(s)
}

func zcard(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	n, err := rdb.ZCard(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("ZCARD %s: %v", key, err)
	}
	return n
}

// base is a deadline comfortably inside the valid window.
func base() time.Time { return time.Now().Add(time.Hour).Truncate(time.Millisecond) }

func TestNewRefusesBadKey(t *testing.T) {
	rdb, _ := testenv.Redis(t)
	if _, err := client.New(rdb, "{tagged}:order"); err == nil {
		t.Errorf("New with a braced key = nil error, want an error")
	}
	c, err := client.New(rdb, "")
	if err != nil {
		t.Fatalf("New with an empty key: %v", err)
	}
	if got := c.Keys().Queue; got != queue.DefaultKey {
		t.Errorf("New(\"\").Keys().Queue = %q, want %q", got, queue.DefaultKey)
	}
}

func TestEnqueueCreateIsIdempotent(t *testing.T) {
	c, rdb, keys := newClient(t)
	ctx := ctxT(t)
	first := base()

	res, at, err := c.Enqueue(ctx, "ord-1", first, client.Create)
	if err != nil {
		t.Fatalf("first Enqueue: %v", err)
	}
	if res != client.Created || !at.Equal(first) {
		t.Errorf("first Enqueue = %v, %s; want created, %s", res, at, first)
	}

	// A retry (the checkout did not see the first reply) keeps the first deadline.
	res, at, err = c.Enqueue(ctx, "ord-1", first.Add(10*time.Minute), client.Create)
	if err != nil {
		t.Fatalf("retry Enqueue: %v", err)
	}
	if res != client.Unchanged || !at.Equal(first) {
		t.Errorf("retry Enqueue = %v, %s; want unchanged, %s", res, at, first)
	}
	if got, want := zscore(t, rdb, keys.Queue, "ord-1"), first.UnixMilli(); got != want {
		t.Errorf("ZSCORE after retry = %d, want %d", got, want)
	}
	if got := zcard(t, rdb, keys.Queue); got != 1 {
		t.Errorf("ZCARD = %d, want 1", got)
	}
}

func TestEnqueueModes(t *testing.T) {
	d := base()
	tests := []struct {
		name         string
		existing     *time.Time // nil: no entry before the call
		mode         client.Mode
		deadline     time.Time
		wantResult   client.Result
		wantDeadline time.Time
	}{
		{"create absent", nil, client.Create, d, client.Created, d},
		{"create existing keeps", &d, client.Create, d.Add(time.Minute), client.Unchanged, d},
		{"reschedule absent creates", nil, client.Reschedule, d, client.Created, d},
		{"reschedule later moves", &d, client.Reschedule, d.Add(time.Minute), client.Moved, d.Add(time.Minute)},
		{"reschedule earlier moves", &d, client.Reschedule, d.Add(-time.Minute), client.Moved, d.Add(-time.Minute)},
		{"reschedule same is unchanged", &d, client.Reschedule, d, client.Unchanged, d},
		{"only later absent creates", nil, client.OnlyLater, d, client.Created, d},
		{"only later later moves", &d, client.OnlyLater, d.Add(time.Minute), client.Moved, d.Add(time.Minute)},
		{"only later earlier keeps", &d, client.OnlyLater, d.Add(-time.Minute), client.Unchanged, d},
		{"only later same keeps", &d, client.OnlyLater, d, client.Unchanged, d},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rdb, keys := newClient(t)
			ctx := ctxT(t)
			if tt.existing != nil {
				if _, _, err := c.Enqueue(ctx, "ord", *tt.existing, client.Create); err != nil {
					t.Fatalf("seed: %v", err)
				}
			}
			res, at, err := c.Enqueue(ctx, "ord", tt.deadline, tt.mode)
			if err != nil {
				t.Fatalf("Enqueue: %v", err)
			}
			if res != tt.wantResult {
				t.Errorf("result = %v, want %v", res, tt.wantResult)
			}
			if !at.Equal(tt.wantDeadline) {
				t.Errorf("deadline = %s, want %s", at, tt.wantDeadline)
			}
			if got, want := zscore(t, rdb, keys.Queue, "ord"), tt.wantDeadline.UnixMilli(); got != want {
				t.Errorf("ZSCORE = %d, want %d", got, want)
			}
		})
	}
}

func TestEnqueueStoresDeadlineRoundedUp(t *testing.T) {
	tests := []struct {
		name   string
		offset time.Duration // past a whole millisecond
		wantUp bool
	}{
		{"whole millisecond", 0, false},
		{"one nanosecond past", time.Nanosecond, true},
		{"one microsecond past", time.Microsecond, true},
		{"just below the next", time.Millisecond - time.Nanosecond, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rdb, keys := newClient(t)
			whole := base()
			want := whole.UnixMilli()
			if tt.wantUp {
				want++
			}
			_, at, err := c.Enqueue(ctxT(t), "ord", whole.Add(tt.offset), client.Create)
			if err != nil {
				t.Fatalf("Enqueue: %v", err)
			}
			if got := zscore(t, rdb, keys.Queue, "ord"); got != want {
				t.Errorf("ZSCORE = %d, want %d", got, want)
			}
			if got := at.UnixMilli(); got != want {
				t.Errorf("returned deadline = %d ms, want %d", got, want)
			}
		})
	}
}

func TestEnqueueAfterUsesClock(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	now := time.Date(2026, 5, 1, 10, 0, 0, 0, time.UTC)
	c, err := client.New(rdb, keys.Queue, client.WithClock(func() time.Time { return now }))
	if err != nil {
		t.Fatal(err)
	}
	_, at, err := c.EnqueueAfter(ctxT(t), "ord", 30*time.Minute, client.Create)
	if err != nil {
		t.Fatalf("EnqueueAfter: %v", err)
	}
	if want := now.Add(30 * time.Minute); !at.Equal(want) {
		t.Errorf("deadline = %s, want %s", at.UTC(), want)
	}
}

func TestEnqueueManyAcrossChunks(t *testing.T) {
	c, rdb, keys := newClient(t)
	ctx := ctxT(t)
	d := base()
	const n = 2500 // three script calls of at most 1,000 entries
	// Every tenth serial exists already with an earlier deadline.
	for i := 0; i < n; i += 10 {
		if _, _, err := c.Enqueue(ctx, fmt.Sprintf("ord-%04d", i), d.Add(-time.Minute), client.Create); err != nil {
			t.Fatalf("seed %d: %v", i, err)
		}
	}
	items := make([]client.Item, n)
	for i := range items {
		items[i] = client.Item{Serial: fmt.Sprintf("ord-%04d", i), Deadline: d.Add(time.Duration(i) * time.Millisecond)}
	}
	for _, mode := range []client.Mode{client.Create, client.OnlyLater} {
		t.Run(map[client.Mode]string{client.Create: "create", client.OnlyLater: "only later"}[mode], func(t *testing.T) {
			res, err := c.EnqueueMany(ctx, items, mode)
			if err != nil {
				t.Fatalf("EnqueueMany: %v", err)
			}
			if len(res) != n {
				t.Fatalf("got %d results, want %d", len(res), n)
			}
			for i, r := range res {
				var want client.ItemResult
				switch {
				case mode == client.Create && i%10 == 0:
					want = client.ItemResult{Result: client.Unchanged, Deadline: d.Add(-time.Minute)}
				case mode == client.Create:
					want = client.ItemResult{Result: client.Created, Deadline: items[i].Deadline}
				case i%10 == 0: // OnlyLater after Create: the pre-seeded ones move later
					want = client.ItemResult{Result: client.Moved, Deadline: items[i].Deadline}
				default: // OnlyLater with the same deadline
					want = client.ItemResult{Result: client.Unchanged, Deadline: items[i].Deadline}
				}
				if r.Result != want.Result || !r.Deadline.Equal(want.Deadline) {
					t.Fatalf("item %d (%s) = %v %s, want %v %s", i, items[i].Serial, r.Result, r.Deadline, want.Result, want.Deadline)
				}
				if got := zscore(t, rdb, keys.Queue, items[i].Serial); got != want.Deadline.UnixMilli() {
					t.Fatalf("ZSCORE %s = %d, want %d", items[i].Serial, got, want.Deadline.UnixMilli())
				}
			}
			if got := zcard(t, rdb, keys.Queue); got != n {
				t.Errorf("ZCARD = %d, want %d", got, n)
			}
		})
	}
}

// TestEnqueueManyDuplicateAcrossChunkBoundary: the chunks run in order, so a
// serial repeated in the next chunk sees the first chunk's write.
func TestEnqueueManyDuplicateAcrossChunkBoundary(t *testing.T) {
	c, _, _ := newClient(t)
	d := base()
	items := make([]client.Item, 1001)
	for i := range items {
		items[i] = client.Item{Serial: "ord-" + strconv.Itoa(i), Deadline: d}
	}
	items[999] = client.Item{Serial: "dup", Deadline: d}
	items[1000] = client.Item{Serial: "dup", Deadline: d.Add(time.Hour)}
	res, err := c.EnqueueMany(ctxT(t), items, client.Create)
	if err != nil {
		t.Fatalf("EnqueueMany: %v", err)
	}
	if got := res[999]; got.Result != client.Created || !got.Deadline.Equal(d) {
		t.Errorf("item 999 = %v %s, want created %s", got.Result, got.Deadline, d)
	}
	if got := res[1000]; got.Result != client.Unchanged || !got.Deadline.Equal(d) {
		t.Errorf("item 1000 = %v %s, want unchanged %s", got.Result, got.Deadline, d)
	}
}

func TestEnqueueManyEmpty(t *testing.T) {
	c, _, _ := newClient(t)
	res, err := c.EnqueueMany(ctxT(t), nil, client.Create)
	if err != nil || len(res) != 0 {
		t.Errorf("EnqueueMany(nil) = %v, %v; want no results, nil", res, err)
	}
}

func TestValidationErrorsWriteNothing(t *testing.T) {
	now := time.Now()
	good := client.Item{Serial: "ok-1", Deadline: now.Add(time.Hour)}
	tests := []struct {
		name string
		bad  client.Item
		want error
	}{
		{"empty serial", client.Item{Serial: "", Deadline: now.Add(time.Hour)}, client.ErrInvalidSerial},
		{"129-byte serial", client.Item{Serial: strings.Repeat("9", 129), Deadline: now.Add(time.Hour)}, client.ErrInvalidSerial},
		{"control character", client.Item{Serial: "ord\n1", Deadline: now.Add(time.Hour)}, client.ErrInvalidSerial},
		{"invalid UTF-8", client.Item{Serial: "ord\xff", Deadline: now.Add(time.Hour)}, client.ErrInvalidSerial},
		{"deadline in seconds", client.Item{Serial: "ord-2", Deadline: time.UnixMilli(now.Add(time.Hour).Unix())}, client.ErrInvalidDeadline},
		{"zero deadline", client.Item{Serial: "ord-2"}, client.ErrInvalidDeadline},
		{"eleven years ahead", client.Item{Serial: "ord-2", Deadline: now.AddDate(11, 0, 0)}, client.ErrInvalidDeadline},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rdb, keys := newClient(t)
			ctx := ctxT(t)
			// The bad item comes after good ones: still nothing is written.
			items := []client.Item{good, {Serial: "ok-2", Deadline: good.Deadline}, tt.bad}
			res, err := c.EnqueueMany(ctx, items, client.Create)
			if !errors.Is(err, tt.want) {
				t.Fatalf("EnqueueMany error = %v, want %v", err, tt.want)
			}
			if res != nil {
				t.Errorf("EnqueueMany results = %v, want nil", res)
			}
			if _, _, err := c.Enqueue(ctx, tt.bad.Serial, tt.bad.Deadline, client.Reschedule); !errors.Is(err, tt.want) {
				t.Errorf("Enqueue error = %v, want %v", err, tt.want)
			}
			if got := zcard(t, rdb, keys.Queue); got != 0 {
				t.Errorf("ZCARD after refused writes = %d, want 0", got)
			}
		})
	}
}

func TestGetCancelNotFound(t *testing.T) {
	c, rdb, keys := newClient(t)
	ctx := ctxT(t)
	d := base()

	if _, err := c.Get(ctx, "ord"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Get before enqueue: error = %v, want ErrNotFound", err)
	}
	if err := c.Cancel(ctx, "ord"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Cancel before enqueue: error = %v, want ErrNotFound", err)
	}
	if _, _, err := c.Enqueue(ctx, "ord", d, client.Create); err != nil {
		t.Fatalf("Enqueue: %v", err)
	}
	e, err := c.Get(ctx, "ord")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if e.Serial != "ord" || e.State != client.StateQueued || !e.Deadline.Equal(d) || e.Attempts != 0 {
		t.Errorf("Get = %+v, want serial ord, queued, deadline %s, 0 attempts", e, d)
	}
	if err := c.Cancel(ctx, "ord"); err != nil {
		t.Fatalf("Cancel: %v", err)
	}
	if got := zcard(t, rdb, keys.Queue); got != 0 {
		t.Errorf("ZCARD after Cancel = %d, want 0", got)
	}
	if _, err := c.Get(ctx, "ord"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Get after Cancel: error = %v, want ErrNotFound", err)
	}
	if err := c.Cancel(ctx, "ord"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("second Cancel: error = %v, want ErrNotFound", err)
	}
	if _, err := c.Get(ctx, "bad\x00"); !errors.Is(err, client.ErrInvalidSerial) {
		t.Errorf("Get of an invalid serial: error = %v, want ErrInvalidSerial", err)
	}
	if err := c.Cancel(ctx, ""); !errors.Is(err, client.ErrInvalidSerial) {
		t.Errorf("Cancel of an empty serial: error = %v, want ErrInvalidSerial", err)
	}
}

// seedLease puts serial in the state a consumer's claim leaves it: out of
// the queue, in the lease hash and the inflight and deadlines sets. token
// "-" is a backoff. The record format is the consumer's
// ("deadline|attempts|token|last error").
func seedLease(t *testing.T, rdb *redis.Client, keys queue.Keys, serial string, deadline, until time.Time, attempts int, token, lastErr string) {
	t.Helper()
	ctx := context.Background()
	rec := fmt.Sprintf("%d|%d|%s|%s", deadline.UnixMilli(), attempts, token, lastErr)
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.HSet(ctx, keys.Lease, serial, rec)
		p.ZAdd(ctx, keys.Inflight, redis.Z{Score: float64(until.UnixMilli()), Member: serial})
		p.ZAdd(ctx, keys.Deadlines, redis.Z{Score: float64(deadline.UnixMilli()), Member: serial})
		return nil
	})
	if err != nil {
		t.Fatalf("seed lease: %v", err)
	}
}

func TestGetStates(t *testing.T) {
	c, rdb, keys := newClient(t)
	ctx := ctxT(t)
	d := base()
	until := d.Add(time.Minute)
	seedLease(t, rdb, keys, "leased", d, until, 2, "tok123", "")
	seedLease(t, rdb, keys, "backoff", d, until, 3, "-", "pq: deadlock detected")
	if err := rdb.HSet(ctx, keys.DeadInfo, "dead", fmt.Sprintf("not_found|10|%d|no order row", d.UnixMilli())).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, keys.Dead, redis.Z{Score: float64(d.UnixMilli()), Member: "dead"}).Err(); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		serial string
		want   client.Entry
	}{
		{"leased", client.Entry{Serial: "leased", Deadline: d, State: client.StateLeased, Attempts: 2, Owner: "tok123", Until: until}},
		{"backoff", client.Entry{Serial: "backoff", Deadline: d, State: client.StateBackoff, Attempts: 3, Until: until, LastError: "pq: deadlock detected"}},
		{"dead", client.Entry{Serial: "dead", Deadline: d, State: client.StateDead, Attempts: 10, Reason: "not_found", LastError: "no order row"}},
	}
	for _, tt := range tests {
		t.Run(tt.serial, func(t *testing.T) {
			got, err := c.Get(ctx, tt.serial)
			if err != nil {
				t.Fatalf("Get: %v", err)
			}
			if got.Serial != tt.want.Serial || got.State != tt.want.State || !got.Deadline.Equal(tt.want.Deadline) ||
				got.Attempts != tt.want.Attempts || got.Owner != tt.want.Owner || !got.Until.Equal(tt.want.Until) ||
				got.Reason != tt.want.Reason || got.LastError != tt.want.LastError {
				t.Errorf("Get = %+v,\nwant %+v", got, tt.want)
			}
		})
	}
}

// TestEnqueueSeesLeasedEntries: an entry a replica holds right now counts as
// existing; a reschedule takes it back from the lease.
func TestEnqueueSeesLeasedEntries(t *testing.T) {
	tests := []struct {
		name         string
		mode         client.Mode
		offset       time.Duration
		wantResult   client.Result
		wantReleased bool // lease dropped, entry back in the queue
	}{
		{"create keeps the lease", client.Create, time.Hour, client.Unchanged, false},
		{"only later earlier keeps the lease", client.OnlyLater, -time.Minute, client.Unchanged, false},
		{"only later later takes it back", client.OnlyLater, time.Hour, client.Moved, true},
		{"reschedule takes it back", client.Reschedule, time.Hour, client.Moved, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, rdb, keys := newClient(t)
			ctx := ctxT(t)
			d := base()
			seedLease(t, rdb, keys, "ord", d, d.Add(time.Minute), 0, "tok", "")
			res, at, err := c.Enqueue(ctx, "ord", d.Add(tt.offset), tt.mode)
			if err != nil {
				t.Fatalf("Enqueue: %v", err)
			}
			want := d
			if tt.wantReleased {
				want = d.Add(tt.offset)
			}
			if res != tt.wantResult || !at.Equal(want) {
				t.Errorf("Enqueue = %v %s, want %v %s", res, at, tt.wantResult, want)
			}
			leased, err := rdb.HExists(ctx, keys.Lease, "ord").Result()
			if err != nil {
				t.Fatal(err)
			}
			queued := zcard(t, rdb, keys.Queue) == 1
			inflight := zcard(t, rdb, keys.Inflight) == 1
			if leased == tt.wantReleased || inflight == tt.wantReleased || queued != tt.wantReleased {
				t.Errorf("after Enqueue: lease record %v, inflight %v, queued %v; want lease/inflight %v, queued %v",
					leased, inflight, queued, !tt.wantReleased, tt.wantReleased)
			}
		})
	}
}

func TestCancelLeasedEntry(t *testing.T) {
	c, rdb, keys := newClient(t)
	ctx := ctxT(t)
	d := base()
	seedLease(t, rdb, keys, "ord", d, d.Add(time.Minute), 1, "tok", "")
	if err := c.Cancel(ctx, "ord"); err != nil {
		t.Fatalf("Cancel of a leased entry: %v", err)
	}
	for _, key := range []string{keys.Queue, keys.Inflight, keys.Deadlines} {
		if got := zcard(t, rdb, key); got != 0 {
			t.Errorf("ZCARD %s after Cancel = %d, want 0", key, got)
		}
	}
	if n, err := rdb.HLen(ctx, keys.Lease).Result(); err != nil || n != 0 {
		t.Errorf("HLEN lease after Cancel = %d, %v; want 0", n, err)
	}
}

// subscribe subscribes to the queue's wake channel and returns its messages,
// once Redis has confirmed the subscription.
func subscribe(t *testing.T, rdb *redis.Client, keys queue.Keys) <-chan *redis.Message {
	t.Helper()
	ctx := ctxT(t)
	ps := rdb.Subscribe(ctx, keys.Wake)
	t.Cleanup(func() { ps.Close() })
	if _, err := ps.Receive(ctx); err != nil { // the subscription confirmation
		t.Fatalf("subscribe %s: %v", keys.Wake, err)
	}
	return ps.Channel()
}

// nextWake returns the next wake-up payload, failing after a timeout.
func nextWake(t *testing.T, ch <-chan *redis.Message) string {
	t.Helper()
	select {
	case m := <-ch:
		return m.Payload
	case <-time.After(5 * time.Second):
		t.Fatalf("no message on the wake channel within 5s")
		return ""
	}
}

// TestWakePublishedOnlyForEarlierHead proves a write that does not move the
// head publishes nothing without waiting for silence: after each such write
// a write that does publish follows, and pub/sub delivers in order, so the
// next message must be that one's.
func TestWakePublishedOnlyForEarlierHead(t *testing.T) {
	c, rdb, keys := newClient(t)
	ch := subscribe(t, rdb, keys)
	ctx := ctxT(t)
	d := base()
	ms := func(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

	steps := []struct {
		name     string
		serial   string
		deadline time.Time
		mode     client.Mode
		publish  bool
	}{
		{"first entry of an empty queue", "a", d, client.Create, true},
		{"later than the head", "b", d.Add(time.Minute), client.Create, false},
		{"equal to the head", "c", d, client.Create, false},
		{"idempotent retry", "a", d.Add(-time.Hour), client.Create, false},
		{"earlier than the head", "e", d.Add(-time.Minute), client.Create, true},
		{"reschedule later", "b", d.Add(2 * time.Minute), client.Reschedule, false},
		{"reschedule to before the head", "b", d.Add(-2 * time.Minute), client.Reschedule, true},
		{"only later, earlier: unchanged", "a", d.Add(-time.Hour), client.OnlyLater, false},
	}
	var marker int
	for _, s := range steps {
		if _, _, err := c.Enqueue(ctx, s.serial, s.deadline, s.mode); err != nil {
			t.Fatalf("%s: Enqueue: %v", s.name, err)
		}
		if !s.publish {
			// A fresh serial far earlier than anything queued always
			// publishes; it must be the next message.
			marker++
			md := d.Add(-time.Duration(24+marker) * time.Hour)
			if _, _, err := c.Enqueue(ctx, fmt.Sprintf("marker-%d", marker), md, client.Create); err != nil {
				t.Fatalf("%s: marker: %v", s.name, err)
			}
			if got := nextWake(t, ch); got != ms(md) {
				t.Fatalf("%s: published %s, want nothing (next should be the marker %s)", s.name, got, ms(md))
			}
			// Remove the marker so the head is what the steps expect.
			if err := c.Cancel(ctx, fmt.Sprintf("marker-%d", marker)); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if got := nextWake(t, ch); got != ms(s.deadline) {
			t.Fatalf("%s: published %s, want %s", s.name, got, ms(s.deadline))
		}
	}
}

func TestWakePublishesEarliestOfBatch(t *testing.T) {
	c, rdb, keys := newClient(t)
	ch := subscribe(t, rdb, keys)
	d := base()
	items := []client.Item{
		{Serial: "x", Deadline: d.Add(3 * time.Second)},
		{Serial: "y", Deadline: d.Add(1 * time.Second)},
		{Serial: "z", Deadline: d.Add(2 * time.Second)},
	}
	if _, err := c.EnqueueMany(ctxT(t), items, client.Create); err != nil {
		t.Fatalf("EnqueueMany: %v", err)
	}
	if got, want := nextWake(t, ch), strconv.FormatInt(d.Add(time.Second).UnixMilli(), 10); got != want {
		t.Errorf("published %s, want the batch's earliest %s", got, want)
	}
}

// TestNoScriptRecovery runs on a private Redis, because SCRIPT FLUSH would
// disturb everyone else on the shared one.
func TestNoScriptRecovery(t *testing.T) {
	rdb, _ := testenv.PrivateRedis(t)
	ctx := ctxT(t)
	c, err := client.New(rdb, "noscript:order")
	if err != nil {
		t.Fatal(err)
	}
	d := base()
	if _, _, err := c.Enqueue(ctx, "before-flush", d, client.Create); err != nil {
		t.Fatalf("Enqueue before flush: %v", err)
	}
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatalf("SCRIPT FLUSH: %v", err)
	}
	items := make([]client.Item, 2100) // several EVALSHA in one pipeline
	for i := range items {
		items[i] = client.Item{Serial: "ord-" + strconv.Itoa(i), Deadline: d}
	}
	res, err := c.EnqueueMany(ctx, items, client.Create)
	if err != nil {
		t.Fatalf("EnqueueMany after SCRIPT FLUSH: %v", err)
	}
	for i, r := range res {
		if r.Result != client.Created {
			t.Fatalf("item %d: result %v, want created", i, r.Result)
		}
	}
	if n := rdb.ZCard(ctx, "noscript:order").Val(); n != int64(len(items))+1 {
		t.Errorf("ZCARD = %d, want %d", n, len(items)+1)
	}
	// Get and Cancel use Script.Run, which falls back to EVAL by itself.
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "ord-0"); err != nil {
		t.Errorf("Get after SCRIPT FLUSH: %v", err)
	}
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Cancel(ctx, "ord-0"); err != nil {
		t.Errorf("Cancel after SCRIPT FLUSH: %v", err)
	}
}

func TestRedisDownIsAnError(t *testing.T) {
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { rdb.Close() })
	c, err := client.New(rdb, "down:order")
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	if _, _, err := c.Enqueue(ctx, "ord", base(), client.Create); err == nil {
		t.Errorf("Enqueue with Redis down = nil error, want an error")
	}
	if _, err := c.Get(ctx, "ord"); err == nil || errors.Is(err, client.ErrNotFound) {
		t.Errorf("Get with Redis down: error = %v, want a connection error (not ErrNotFound)", err)
	}
	if err := c.Cancel(ctx, "ord"); err == nil || errors.Is(err, client.ErrNotFound) {
		t.Errorf("Cancel with Redis down: error = %v, want a connection error (not ErrNotFound)", err)
	}
}

// Keys is a type callers outside the module can name: a variable of it
// holds the queue's key names.
func TestKeysIsNameable(t *testing.T) {
	c, _, _ := newClient(t)
	var k client.Keys = c.Keys()
	all := c.AllKeys()
	if len(all) != 1 || all[0] != k || k.Meta != "{"+k.Queue+"}:meta" {
		t.Errorf("Keys() = %+v, AllKeys() = %+v", k, all)
	}
}
