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
	"strconv"
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

// luaUnbatch is unbatch for the scripts that drop a lease record: it takes
// the record's member off its batch lease, if it has one (field "#"+token
// of {queue}:leasebatch counts the members a batch still holds; the
// daemon's claim script writes it), and drops the batch with its last
// member, so the gauges count no member twice.
const luaUnbatch = `
local function unbatch(leases, info, rec)
  if not rec then return end
  local tok = string.match(rec, '^[^|]*|[^|]*|([^|]*)')
  if not tok or redis.call('HEXISTS', info, '#' .. tok) == 0 then return end
  if redis.call('HINCRBY', info, '#' .. tok, -1) <= 0 then
    redis.call('ZREM', leases, tok)
    redis.call('HDEL', info, tok, '#' .. tok, '<' .. tok)
  end
end
`

// maxPerCall bounds how many entries one script call writes, so a huge batch
// never blocks Redis for long.
const maxPerCall = 1000

// enqueueScript adds or moves entries.
//
//	KEYS[1] -> queue            KEYS[2] -> {queue}:lease
//	KEYS[3] -> {queue}:inflight KEYS[4] -> {queue}:deadlines
//	KEYS[5] -> {queue}:wake (channel)
//	KEYS[6] -> {queue}:leases KEYS[7] -> {queue}:leasebatch
//	ARGV[1] -> mode: "nx" | "set" | "later" | "adopt" (nx that publishes
//	           nothing: a sharded client moving an entry into its shard)
//	ARGV[2k], ARGV[2k+1] -> serial, deadline (integer Unix ms), k = 1..n
//
// Returns a flat array: for each serial its result (0 unchanged, 1 created,
// 2 moved) and its deadline after the call.
//
// An entry held under a lease or backing off lives in the lease hash instead
// of the queue; it counts as existing. Moving it drops the lease record, so
// the replica holding it cannot remove it (its compare-and-set fails) and the
// new deadline is kept; a batch lease (see the daemon's claim script) holds
// one member fewer. The script publishes the earliest written deadline
// when it is earlier than the queue's head, so sleeping daemons wake up.
var enqueueScript = redis.NewScript(luaUnbatch + `
local mode = ARGV[1]
local n = (#ARGV - 1) / 2
local members = {}
for i = 1, n do members[i] = ARGV[2 * i] end
-- Current scores and lease records, read in a few calls, not one per item.
local scores, recs, missing, at = {}, {}, {}, {}
for i = 1, n, 500 do
  local part = redis.call('ZMSCORE', KEYS[1], unpack(members, i, math.min(i + 499, n)))
  for j = 1, #part do scores[i + j - 1] = part[j] end
end
for i = 1, n do
  if not scores[i] then missing[#missing + 1] = members[i]; at[#at + 1] = i end
end
for i = 1, #missing, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(missing, i, math.min(i + 499, #missing)))
  for j = 1, #part do recs[at[i + j - 1]] = part[j] end
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local headScore = head[2] and tonumber(head[2]) or nil
local earliest = nil
local out, zadd, seen = {}, {}, {}
for i = 1, n do
  local s = members[i]
  local d = tonumber(ARGV[2 * i + 1])
  local res = 0
  local cur, leased = seen[s], false
  if cur == nil then
    if scores[i] then
      cur = tonumber(scores[i])
    elseif recs[i] then
      cur = tonumber(string.match(recs[i], '^([^|]*)'))
      leased = true
    end
  end
  if not cur then
    res = 1
  elseif (mode == 'set' and d ~= cur) or (mode == 'later' and d > cur) then
    if leased then
      unbatch(KEYS[6], KEYS[7], recs[i])
      redis.call('HDEL', KEYS[2], s)
      redis.call('ZREM', KEYS[3], s)
      redis.call('ZREM', KEYS[4], s)
    end
    res = 2
  else
    d = cur
  end
  if res ~= 0 then
    zadd[#zadd + 1] = d; zadd[#zadd + 1] = s
    if earliest == nil or d < earliest then earliest = d end
  end
  seen[s] = d
  out[#out + 1] = res
  out[#out + 1] = d
end
for i = 1, #zadd, 1000 do
  redis.call('ZADD', KEYS[1], unpack(zadd, i, math.min(i + 999, #zadd)))
end
if mode ~= 'adopt' and earliest ~= nil and (headScore == nil or earliest < headScore) then
  redis.call('PUBLISH', KEYS[5], earliest)
end
return out
`)

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
	// One group of script calls per key written: the queue key, or each
	// shard an item hashes to; idx maps a group's replies back to items.
	type group struct {
		k    queue.Keys
		args []any
		idx  []int
	}
	var groups []*group
	byKey := map[string]*group{}
	for i, it := range items {
		if err := queue.ValidateSerial(it.Serial); err != nil {
			return nil, fmt.Errorf("item %d: %w", i, err)
		}
		ms := queue.DeadlineMillis(it.Deadline)
		if err := queue.ValidateDeadline(ms, now); err != nil {
			return nil, fmt.Errorf("item %d (%q): %w", i, it.Serial, err)
		}
		k := c.keysFor(it.Serial)
		g := byKey[k.Queue]
		if g == nil {
			g = &group{k: k, args: make([]any, 0, 2*len(items))}
			byKey[k.Queue] = g
			groups = append(groups, g)
		}
		g.args = append(g.args, it.Serial, ms)
		g.idx = append(g.idx, i)
	}
	if c.shards > 1 && mode != Create {
		if err := c.adopt(ctx, items); err != nil {
			return nil, fmt.Errorf("enqueue: %w", err)
		}
	}
	type call struct {
		g     *group
		first int // index into g.idx of the call's first item
	}
	var cmds []*redis.Cmd
	var calls []call
	run := func(p redis.Scripter) {
		cmds, calls = cmds[:0], calls[:0]
		for _, g := range groups {
			keys := []string{g.k.Queue, g.k.Lease, g.k.Inflight, g.k.Deadlines, g.k.Wake, g.k.Leases, g.k.LeaseBatch}
			for start := 0; start < len(g.args); start += 2 * maxPerCall {
				end := min(start+2*maxPerCall, len(g.args))
				a := make([]any, 0, end-start+1)
				a = append(a, mode.arg())
				a = append(a, g.args[start:end]...)
				cmds = append(cmds, enqueueScript.EvalSha(ctx, p, keys, a...))
				calls = append(calls, call{g: g, first: start / 2})
			}
		}
	}
	if err := c.pipelined(ctx, run, &cmds); err != nil {
		return nil, fmt.Errorf("enqueue: %w", err)
	}
	out := make([]ItemResult, len(items))
	got := 0
	for n, cmd := range cmds {
		vals, err := cmd.Int64Slice()
		if err != nil {
			return nil, fmt.Errorf("enqueue: %w", err)
		}
		if len(vals)%2 != 0 {
			return nil, fmt.Errorf("enqueue: odd reply length %d", len(vals))
		}
		g, first := calls[n].g, calls[n].first
		if first+len(vals)/2 > len(g.idx) {
			return nil, fmt.Errorf("enqueue: %d results for %d items", first+len(vals)/2, len(g.idx))
		}
		for i := 0; i < len(vals); i += 2 {
			out[g.idx[first+i/2]] = ItemResult{Result: Result(vals[i]), Deadline: time.UnixMilli(vals[i+1])}
			got++
		}
	}
	if got != len(items) {
		return nil, fmt.Errorf("enqueue: %d results for %d items", got, len(items))
	}
	return out, nil
}

// pipelined runs the script calls that build adds in one pipeline with
// EVALSHA, and once more after loading the script if Redis had lost it (a
// restarted Redis has no scripts; EVALSHA inside a pipeline does not fall
// back to EVAL by itself).
func (c *Client) pipelined(ctx context.Context, build func(redis.Scripter), cmds *[]*redis.Cmd) error {
	for try := 0; ; try++ {
		_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error { build(p); return nil })
		if err == nil {
			return nil
		}
		if try == 0 && redis.HasErrorPrefix(err, "NOSCRIPT") {
			if err := enqueueScript.Load(ctx, c.rdb).Err(); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

// getScript reads one entry wherever it is.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:inflight
//	KEYS[4] -> {queue}:deadinfo KEYS[5] -> {queue}:leases
//	ARGV[1] -> serial
//
// A member of a batch lease has no entry of its own in {queue}:inflight:
// its lease ends when its batch's does. Returns {state, deadline, attempts, token, until, reason, last error} or
// nil when there is no entry.
var getScript = redis.NewScript(`
local s = ARGV[1]
local q = redis.call('ZSCORE', KEYS[1], s)
if q then return {'queued', q, '0', '', '0', '', ''} end
local rec = redis.call('HGET', KEYS[2], s)
if rec then
  local d, a, tok, e = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|?(.*)$')
  local until_ = redis.call('ZSCORE', KEYS[3], s) or redis.call('ZSCORE', KEYS[5], tok) or '0'
  local state = 'leased'
  if tok == '-' then state = 'backoff' end
  return {state, d, a, tok, until_, '', e or ''}
end
local dead = redis.call('HGET', KEYS[4], s)
if dead then
  local r, a, d, e = string.match(dead, '^([^|]*)|([^|]*)|([^|]*)|?(.*)$')
  return {'dead', d, a, '', '0', r, e or ''}
end
return nil
`)

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
	keys := []string{k.Queue, k.Lease, k.Inflight, k.DeadInfo, k.Leases}
	vals, err := getScript.Run(ctx, c.rdb, keys, serial).StringSlice()
	if errors.Is(err, redis.Nil) {
		return Entry{}, ErrNotFound
	}
	if err != nil {
		return Entry{}, fmt.Errorf("get %q: %w", serial, err)
	}
	if len(vals) != 7 {
		return Entry{}, fmt.Errorf("get %q: reply of %d fields, want 7", serial, len(vals))
	}
	deadline, err1 := parseMillis(vals[1])
	attempts, err2 := strconv.Atoi(vals[2])
	until, err3 := parseMillis(vals[4])
	if err := errors.Join(err1, err2, err3); err != nil {
		return Entry{}, fmt.Errorf("get %q: malformed record: %w", serial, err)
	}
	e := Entry{Serial: serial, State: State(vals[0]), Deadline: deadline, Attempts: attempts,
		Reason: vals[5], LastError: vals[6]}
	if e.State == StateLeased {
		e.Owner = vals[3]
	}
	if e.State == StateLeased || e.State == StateBackoff {
		e.Until = until
	}
	return e, nil
}

// parseMillis parses a Unix-millisecond score as Redis prints it (which may
// be in exponent form for large values).
func parseMillis(s string) (time.Time, error) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return time.Time{}, err
	}
	return time.UnixMilli(int64(f)), nil
}

// cancelScript removes an entry that is queued, leased or backing off.
//
//	KEYS[1] -> queue  KEYS[2] -> {queue}:lease  KEYS[3] -> {queue}:inflight
//	KEYS[4] -> {queue}:deadlines KEYS[5] -> {queue}:leases
//	KEYS[6] -> {queue}:leasebatch
//	ARGV[1] -> serial
//
// Returns 1 if something was removed, else 0. A replica closing the order
// right now finishes its close (the SQL decides) but cannot re-add it.
var cancelScript = redis.NewScript(luaUnbatch + `
local n = redis.call('ZREM', KEYS[1], ARGV[1])
unbatch(KEYS[5], KEYS[6], redis.call('HGET', KEYS[2], ARGV[1]))
n = n + redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if n > 0 then return 1 end
return 0
`)

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

// cancel runs cancelScript on the queue with keys k; it returns 1 if it
// removed an entry, else 0.
func (c *Client) cancel(ctx context.Context, k queue.Keys, serial string) (int, error) {
	keys := []string{k.Queue, k.Lease, k.Inflight, k.Deadlines, k.Leases, k.LeaseBatch}
	n, err := cancelScript.Run(ctx, c.rdb, keys, serial).Int()
	if err != nil {
		return 0, fmt.Errorf("cancel %q: %w", serial, err)
	}
	return n, nil
}
