// Package client lets a checkout service written in Go put order timeouts on
// an orderdelay queue: enqueue one order or a pipelined batch, reschedule,
// cancel and look up. It applies the same validation as the daemon, so a bad
// serial or a deadline in seconds instead of milliseconds is refused here,
// not dead-lettered later.
//
// It depends on go-redis only; the daemon's SQL, logging and metrics stay out
// of a checkout service's build.
//
// Every write goes through one Lua script that also sees entries the daemon
// currently holds under a lease, so an idempotent enqueue of an order being
// closed right now does not create a second entry, and a reschedule of it
// takes effect. When a write makes an entry earlier than the queue's head it
// publishes the deadline so that sleeping daemons wake up for it.
package client

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Errors returned by this package; test with errors.Is.
var (
	// ErrInvalidSerial: the serial is empty, longer than 128 bytes, not
	// UTF-8 or contains a control character.
	ErrInvalidSerial = queue.ErrInvalidSerial
	// ErrInvalidDeadline: the deadline is before 2000-01-01 or more than
	// ten years ahead.
	ErrInvalidDeadline = queue.ErrInvalidDeadline
	// ErrNotFound: no entry for that serial.
	ErrNotFound = errors.New("not found")
	// ErrDurableQueue: the task queue is durable (the daemon's queues file
	// says durable: true). Its tasks live in PostgreSQL, which this client
	// cannot reach, so PutTask, PutTasks and DeleteTasks refuse it and
	// change nothing: use the daemon's HTTP API or `orderdelay task`.
	ErrDurableQueue = errors.New("durable queue")
	// ErrQueueFull: the task queue holds its max_pending tasks; a new task
	// is refused (nothing is written) until some leave. See QueueFullError.
	ErrQueueFull = errors.New("queue full")
)

// Mode says what Enqueue does when the serial is already queued.
type Mode int

const (
	// Create adds the entry only if it is absent; a retry never moves the
	// deadline (ZADD NX semantics).
	Create Mode = iota
	// Reschedule sets the deadline whether or not the entry exists.
	Reschedule
	// OnlyLater sets the deadline only if it is later than the current one
	// (or the entry is absent).
	OnlyLater
)

func (m Mode) arg() string {
	switch m {
	case Reschedule:
		return queue.ModeReschedule
	case OnlyLater:
		return queue.ModeLater
	default:
		return queue.ModeCreate
	}
}

// Result says what a write did.
type Result int

const (
	Unchanged Result = queue.ResultUnchanged // the entry existed and kept its deadline
	Created   Result = queue.ResultCreated   // a new entry was added
	Moved     Result = queue.ResultMoved     // an existing entry got a new deadline
)

func (r Result) String() string {
	switch r {
	case Created:
		return "created"
	case Moved:
		return "moved"
	default:
		return "unchanged"
	}
}

// State is where an entry is in its life.
type State string

const (
	StateQueued  State = "queued"  // waiting for its deadline
	StateLeased  State = "leased"  // a daemon replica is closing it now
	StateBackoff State = "backoff" // a try failed; waiting to be retried
	StateDead    State = "dead"    // dead-lettered; see Entry.Reason
)

// Entry describes one queue entry as Get sees it.
type Entry struct {
	Serial   string
	Deadline time.Time // the true deadline, also while leased
	State    State
	Attempts int
	// Owner is the lease token of the replica holding a leased entry.
	Owner string
	// Until is when a lease or backoff ends.
	Until time.Time
	// Reason and LastError are set for dead and backing-off entries.
	Reason    string
	LastError string
}

// Item is one order for EnqueueMany.
type Item struct {
	Serial   string
	Deadline time.Time
}

// Client writes to one queue. It is safe for concurrent use.
type Client struct {
	rdb  redis.UniversalClient
	keys queue.Keys
	st   *queue.Store // the store of keys: the task scripts
	now  func() time.Time
	// shards is the number of shard keys order timeouts are spread over
	// (WithShards); 1: the queue key only.
	shards int
	shard  []queue.Keys // the shards' keys; nil when shards is 1
	// writer is who the task scripts are told writes ("" is writerClient);
	// only internal/durabletier makes a writerDurable copy.
	writer string
}

// Option configures a Client.
type Option func(*Client)

// WithClock replaces time.Now, for tests.
func WithClock(now func() time.Time) Option { return func(c *Client) { c.now = now } }

// New returns a Client for the queue named key (queue.DefaultKey when
// empty) on rdb.
func New(rdb redis.UniversalClient, key string, opts ...Option) (*Client, error) {
	if key == "" {
		key = queue.DefaultKey
	}
	if err := queue.ValidateKey(key); err != nil {
		return nil, err
	}
	c := &Client{rdb: rdb, keys: queue.NewKeys(key), now: time.Now, shards: 1}
	for _, o := range opts {
		o(c)
	}
	if c.shards < 1 || c.shards > queue.MaxShards {
		return nil, fmt.Errorf("shards: want 1 to %d, got %d", queue.MaxShards, c.shards)
	}
	c.shard = queue.ShardKeys(key, c.shards)
	c.st = queue.NewStore(rdb, c.keys)
	return c, nil
}

// Keys holds the names of every Redis key of one queue: the sorted set
// producers write (Queue) and its companions ({Queue}:inflight, :lease,
// :dead, :deadinfo, :payload, :meta, ...), each a string field. It is
// declared in the module's internal store package; this alias is its name
// for callers outside the module.
type Keys = queue.Keys

// Keys returns the Redis keys of the client's queue (its base key when
// sharded; see AllKeys).
func (c *Client) Keys() Keys { return c.keys }

// Enqueue puts serial on the queue with the given deadline, rounded up to
// the millisecond. With Create a retry is harmless: the entry keeps its
// first deadline, which Enqueue returns.
func (c *Client) Enqueue(ctx context.Context, serial string, deadline time.Time, mode Mode) (Result, time.Time, error) {
	res, err := c.EnqueueMany(ctx, []Item{{Serial: serial, Deadline: deadline}}, mode)
	if err != nil {
		return Unchanged, time.Time{}, err
	}
	return res[0].Result, res[0].Deadline, nil
}

// EnqueueAfter is Enqueue with a deadline of now + timeout.
func (c *Client) EnqueueAfter(ctx context.Context, serial string, timeout time.Duration, mode Mode) (Result, time.Time, error) {
	return c.Enqueue(ctx, serial, c.now().Add(timeout), mode)
}

// ItemResult is what EnqueueMany did with one item.
type ItemResult struct {
	Result   Result
	Deadline time.Time
}

// EnqueueMany writes a batch in as few round trips as possible: items are
// validated first (nothing is written if any is invalid), then sent in
// chunks of up to 1,000 per script call, all chunks in one pipeline.
func (c *Client) EnqueueMany(ctx context.Context, items []Item, mode Mode) ([]ItemResult, error) {
	now := c.now()
	// One batch per key written: the queue key, or each shard an item
	// hashes to; idx maps a batch's results back to items.
	var batches []queue.EnqueueBatch
	var idx [][]int
	byKey := map[string]int{}
	for i, it := range items {
		if err := queue.ValidateSerial(it.Serial); err != nil {
			return nil, fmt.Errorf("item %d: %w", i, err)
		}
		ms := queue.DeadlineMillis(it.Deadline)
		if err := queue.ValidateDeadline(ms, now); err != nil {
			return nil, fmt.Errorf("item %d (%q): %w", i, it.Serial, err)
		}
		k := c.keysFor(it.Serial)
		g, ok := byKey[k.Queue]
		if !ok {
			g = len(batches)
			byKey[k.Queue] = g
			batches = append(batches, queue.EnqueueBatch{Keys: k, Items: make([]queue.EnqueueItem, 0, len(items))})
			idx = append(idx, nil)
		}
		batches[g].Items = append(batches[g].Items, queue.EnqueueItem{Serial: it.Serial, Deadline: ms})
		idx[g] = append(idx[g], i)
	}
	if c.shards > 1 && mode != Create {
		if err := c.adopt(ctx, items); err != nil {
			return nil, fmt.Errorf("enqueue: %w", err)
		}
	}
	res, err := queue.Enqueue(ctx, c.rdb, mode.arg(), batches)
	if err != nil {
		return nil, err
	}
	out := make([]ItemResult, len(items))
	for g, rs := range res {
		for j, r := range rs {
			out[idx[g][j]] = ItemResult{Result: Result(r.Result), Deadline: time.UnixMilli(r.Deadline)}
		}
	}
	return out, nil
}

// Get returns the entry for serial, or ErrNotFound. A sharded client looks
// in the serial's shard, then in the queue key (entries written before the
// switch to shards, or by producers that ignore them).
func (c *Client) Get(ctx context.Context, serial string) (Entry, error) {
	if err := queue.ValidateSerial(serial); err != nil {
		return Entry{}, err
	}
	if c.shards > 1 {
		e, err := c.get(ctx, c.keysFor(serial), serial)
		if !errors.Is(err, ErrNotFound) {
			return e, err
		}
	}
	return c.get(ctx, c.keys, serial)
}

func (c *Client) get(ctx context.Context, k queue.Keys, serial string) (Entry, error) {
	r, ok, err := queue.NewStore(c.rdb, k).Get(ctx, serial)
	if err != nil {
		return Entry{}, err
	}
	if !ok {
		return Entry{}, ErrNotFound
	}
	e := Entry{Serial: serial, State: State(r.State), Deadline: r.Deadline, Attempts: r.Attempts,
		Reason: r.Reason, LastError: r.LastError}
	if e.State == StateLeased {
		e.Owner = r.Token
	}
	if e.State == StateLeased || e.State == StateBackoff {
		e.Until = r.Until
	}
	return e, nil
}

// Cancel removes the entry for serial (a paid order no longer needs its
// timeout). It returns ErrNotFound if there was none. A sharded client
// removes it from the serial's shard and from the queue key.
func (c *Client) Cancel(ctx context.Context, serial string) error {
	if err := queue.ValidateSerial(serial); err != nil {
		return err
	}
	n := 0
	if c.shards > 1 {
		m, err := c.cancel(ctx, c.keysFor(serial), serial)
		if err != nil {
			return err
		}
		n += m
	}
	m, err := c.cancel(ctx, c.keys, serial)
	if err != nil {
		return err
	}
	if n+m == 0 {
		return ErrNotFound
	}
	return nil
}

// cancel removes serial's entry from the queue with keys k
// (queue.Store.Cancel); it returns 1 if it removed one, else 0.
func (c *Client) cancel(ctx context.Context, k queue.Keys, serial string) (int, error) {
	ok, err := queue.NewStore(c.rdb, k).Cancel(ctx, serial)
	if ok {
		return 1, err
	}
	return 0, err
}
