// Package consumer is the heart of orderdelay: it claims due order serials
// from the Redis queue under a lease, closes the unpaid orders in PostgreSQL
// in batches on a bounded pool of workers, and removes from the queue only
// what is settled, only after the close has committed, and only if the
// entry is still the one it leased.
//
// The scanner sleeps until the earliest deadline, measured on Redis's clock
// and never longer than the scan interval; the producer script publishes
// earlier deadlines so a sleeping scanner wakes for them, and a cheap head
// check between scans notices entries written by raw ZADD producers.
//
// The Redis side of every step (claim, fence, finish, retry, dead-letter,
// hand back, stats) is package queue's store; what a consumer does with
// what it claims — close orders, run a task action, forward to a stream or
// list, or read without changing anything in a dry run — is its handler
// (handler.go), chosen once in New.
//
// The services that run beside the scan loop — the reconciler, the
// close-event relay, the dead-letter janitor — are package maintain's.
package consumer

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"golang.org/x/time/rate"

	"github.com/orderdelay/orderdelay/internal/lifecycle"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Defaults of Config; each applies when its field is zero. They are the
// one source of these numbers: the daemon's settings (internal/config) and
// the task queues' (internal/tasks) take their defaults from here.
const (
	DefaultWorkers          = 4
	DefaultBatchSize        = 500
	DefaultScanInterval     = 5 * time.Second
	DefaultLease            = 60 * time.Second
	DefaultStatementTimeout = 10 * time.Second
	DefaultDrainTimeout     = 20 * time.Second
	DefaultMaxAttempts      = 10
	DefaultBackoffMax       = 5 * time.Minute
	// DefaultHeadCheck is the idle poll of the queue head that notices
	// deadlines written by raw ZADD producers (about 3 commands a second:
	// with the claims' and the pings', an idle replica costs Redis under 5
	// commands a second, issue 13).
	DefaultHeadCheck = 350 * time.Millisecond

	// DefaultRetryBase is the first delay of a retry: an order without a
	// row is looked for again after it, doubling per attempt up to
	// BackoffMax (task queues start their backoff from it too).
	DefaultRetryBase = time.Second
	retryBase        = DefaultRetryBase
	// dependencyBackoffMax caps the wait after a failed Redis or PostgreSQL
	// call, so the daemon catches up quickly when the dependency returns.
	dependencyBackoffMax = 10 * time.Second
	// BookkeepingTimeout bounds each Redis call that records the outcome
	// of a batch, the hand-back among them; they run even after the drain
	// timeout cancelled the SQL, all but the hand-back within this much of
	// it (Consumer.bookkeeping).
	BookkeepingTimeout = 5 * time.Second
	// sleepFloor is the shortest sleep before a deadline.
	sleepFloor = time.Millisecond
)

// Config configures a Consumer. Zero values take the defaults above.
//
// It is the order queue's (a Store, none of DryRun, Process and Forward),
// a dry run of it (DryRun and a Store), or a task queue's (Process or
// Forward; the Store is not used): New refuses any other combination.
type Config struct {
	Keys             queue.Keys
	Workers          int           // batches closed concurrently
	BatchSize        int           // serials per claim and per close
	ScanInterval     time.Duration // longest sleep between scans
	Lease            time.Duration // how long a claim is held
	StatementTimeout time.Duration // deadline of one batch; below Lease
	DrainTimeout     time.Duration // how long in-flight batches may finish on shutdown
	MaxAttempts      int           // attempts before an order without a row is dead-lettered
	BackoffMax       time.Duration // cap of the per-entry retry backoff
	CloseDelay       time.Duration // an entry is due this long after its deadline (0: at it)
	HeadCheck        time.Duration // idle poll of the queue head; negative disables it
	Owner            string        // replica name in lease tokens; default host-pid
	// MaxCloseRate caps the orders this replica claims (and so closes) per
	// second; 0 means unlimited.
	MaxCloseRate float64
	// Slots, if set, is a worker budget shared with other consumers (the
	// shards of one logical queue, see Group): a claim takes a slot and its
	// batch gives it back. nil: a pool of Workers slots of its own.
	Slots chan struct{}
	// Limiter, if set, is a MaxCloseRate limiter shared with other
	// consumers; it replaces this consumer's own.
	Limiter *rate.Limiter
	// Family is the logical queue's keys (the queue key first, then its
	// shards) when this consumer serves one of several (see Group). A
	// producer may write a serial into the queue key or into its shard, so
	// the fence also asks those for a later deadline.
	Family []queue.Keys
	// SharedWake: the Group subscribes to the wake channels of all its
	// consumers on one connection, so this consumer does not subscribe.
	SharedWake bool
	// DryRun leaves the queue as it is: due entries are read, not leased,
	// each once; the Store's Close is expected not to commit (see
	// orders.DryRun); nothing is removed, retried or dead-lettered.
	DryRun bool

	// Task queues (nil/zero for the order queue):
	// Process runs a task queue's action instead of the order close.
	Process ProcessFunc
	// Retry is the delay before retry number attempts+1 of a failed task.
	Retry func(attempts int) time.Duration
	// Forward moves due tasks into a stream or list in the claim itself,
	// atomically, instead of leasing them to workers.
	Forward *Forward
	// CountRedeliveries makes a re-claim of an expired lease spend an
	// attempt (tasks handed to polling consumers).
	CountRedeliveries bool
}

func (c *Config) setDefaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defD := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.Workers, DefaultWorkers)
	def(&c.BatchSize, DefaultBatchSize)
	def(&c.MaxAttempts, DefaultMaxAttempts)
	defD(&c.ScanInterval, DefaultScanInterval)
	defD(&c.Lease, DefaultLease)
	defD(&c.StatementTimeout, DefaultStatementTimeout)
	defD(&c.DrainTimeout, DefaultDrainTimeout)
	defD(&c.BackoffMax, DefaultBackoffMax)
	if c.HeadCheck == 0 {
		c.HeadCheck = DefaultHeadCheck
	}
	if c.Owner == "" {
		host, _ := os.Hostname()
		c.Owner = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
}

// Store is what the consumer needs from the database (orders.Store and
// its WithOutbox and DryRun variants).
type Store interface {
	// Settle closes the pending orders among serials and says which of the
	// others are settled and which it cannot answer for; fence is asked
	// before the commit (see orders.Fence). With the reference schema's
	// statements that is one statement; with custom ones, the close
	// statement alone (everything not closed is Unknown).
	Settle(ctx context.Context, serials []string, fence orders.Fence) (orders.Outcome, error)
	// Lookup returns the serials that have a row and whether each is
	// still pending: asked after the commit about Settle's Unknown.
	Lookup(ctx context.Context, serials []string) ([]orders.Found, error)
}

// Consumer claims and closes due orders. Build it with New; run it with Run.
type Consumer struct {
	cfg   Config
	rdb   redis.UniversalClient
	store Store
	q     *queue.Store // the queue's Redis data (cfg.Keys)
	h     handler      // what it does with the queue, chosen from cfg in New
	m     *metrics.Metrics
	log   *zap.Logger
	now   func() time.Time
	seq   atomic.Uint64
	// nonce makes this process's lease tokens its own even when another
	// replica has the same Owner (host name and PID: containers are PID 1).
	nonce  string
	beat   atomic.Int64 // Unix ns of the scan loop's last heartbeat
	pgBack *backoff.ExponentialBackOff
	pgMu   sync.Mutex
	// stopping is closed when shutdown begins; it cuts backoff waits.
	stopping <-chan struct{}
	// bookEnd is when every bookkeeping call's deadline ends, Unix ns:
	// BookkeepingTimeout after the drain's cut (0 before it; bookkeeping).
	bookEnd atomic.Int64
	// batches counts the claims being processed (scan's workers), for
	// Run's cut: it warns only when it cuts one.
	batches atomic.Int64
	limiter *rate.Limiter // nil: unlimited
	// wake carries deadlines (Unix ms) the scanner should wake for:
	// producers' (via pub/sub) and this replica's own retries.
	wake chan int64
	// Dry-run cursor (scan loop only): the last deadline read and the
	// members read at exactly that deadline.
	peekFrom int64
	peekSeen map[string]struct{}
	// List queues (scan loop only): the ready list was full (Forward.MaxLen)
	// on the last pass while tasks were due.
	listFull bool
	// Stream queues (scan loop only): when the consumer groups were last
	// swept (Redis ms) and, per group, where the next sweep continues.
	streamSwept int64
	pelCursor   map[string]string
}

// check refuses the configurations whose handler could not work — each
// would fail at the first due entry, the nil Store ones with a nil
// dereference in a worker: one handler at most of DryRun, Forward and
// Process; a Store for the two that close orders (the order queue and a
// dry run of it), which task queues do not need; a forward to a stream or
// a list; a worker budget with room for a batch.
func (c *Config) check(store Store) error {
	switch {
	case c.DryRun && c.Process != nil:
		return errors.New("consumer: DryRun with Process: a dry run reads the order queue through its Store; a task queue is not served in a dry run")
	case c.DryRun && c.Forward != nil:
		return errors.New("consumer: DryRun with Forward: a dry run reads the order queue through its Store; a task queue is not served in a dry run")
	case c.Forward != nil && c.Process != nil:
		return errors.New("consumer: Forward with Process: a queue forwards its due tasks or runs an action on them, not both")
	case c.Forward != nil && c.Forward.Kind != "stream" && c.Forward.Kind != "list":
		return fmt.Errorf("consumer: Forward.Kind %q: want \"stream\" or \"list\"", c.Forward.Kind)
	case c.Forward == nil && c.Process == nil && store == nil:
		if c.DryRun {
			return errors.New("consumer: DryRun without a Store: a dry run rolls its closes back through the Store (orders.DryRun)")
		}
		return errors.New("consumer: no Store: the order queue closes orders through it (a task queue sets Process or Forward)")
	case c.Slots != nil && cap(c.Slots) == 0:
		return errors.New("consumer: Slots has no room: no batch could ever be claimed")
	}
	return nil
}

// New returns a Consumer, or an error naming the settings of cfg that
// cannot work together (see Config).
func New(cfg Config, rdb redis.UniversalClient, store Store, m *metrics.Metrics, log *zap.Logger) (*Consumer, error) {
	if err := cfg.check(store); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	c := &Consumer{cfg: cfg, rdb: rdb, store: store, m: m, log: log, now: time.Now, pgBack: newDependencyBackoff(cfg.BackoffMax)}
	c.q = queue.NewStore(rdb, cfg.Keys)
	c.h = newHandler(c)
	c.nonce = strconv.FormatUint(rand.Uint64(), 36)
	c.wake = make(chan int64, 64)
	if cfg.Limiter != nil {
		c.limiter = cfg.Limiter
	} else if cfg.MaxCloseRate > 0 {
		c.limiter = rate.NewLimiter(rate.Limit(cfg.MaxCloseRate), cfg.BatchSize)
	}
	c.beat.Store(time.Now().UnixNano())
	return c, nil
}

// newDependencyBackoff is the wait after a failed Redis or PostgreSQL call:
// from 100 ms, capped at dependencyBackoffMax or the configured BackoffMax,
// whichever is smaller — ORDERDELAY_BACKOFF_MAX caps every retry, so an
// order is retried within it after an outage ends.
func newDependencyBackoff(limit time.Duration) *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.MaxInterval = min(dependencyBackoffMax, max(limit, b.InitialInterval))
	return b
}

// Config returns the configuration in effect, defaults applied.
func (c *Consumer) Config() Config { return c.cfg }

// LastBeat is when the scan loop last showed it is alive. It beats while
// it waits for workers or backs off, so a slow dependency does not make a
// healthy process look dead.
func (c *Consumer) LastBeat() time.Time { return time.Unix(0, c.beat.Load()) }

func (c *Consumer) heartbeat() { c.beat.Store(c.now().UnixNano()) }

// item is one claimed entry.
type item struct {
	token    string // lease token of the claim that took it
	serial   string
	deadline int64 // Unix ms
	attempts int
	claimed  int // entries that claim leased as one batch (the order queue); 0: per member
}

type claimResult struct {
	now, nextQueue, nextExpiry int64
	items                      []item
	reclaimed                  int
	forwarded                  int
	paused                     bool
	dead                       map[string]int
}

// DrainTimeout is how long Run lets in-flight batches finish once its
// context ends (Config.DrainTimeout).
func (c *Consumer) DrainTimeout() time.Duration { return c.cfg.DrainTimeout }

// Run scans and closes until ctx is cancelled, then shuts down:
//
//  1. stop claiming (the scan loop returns once its Redis call in
//     progress, if any, has);
//  2. meanwhile, let in-flight batches finish, for at most DrainTimeout
//     from the moment ctx ends (however long step 1 takes);
//  3. cancel what is still running; each such batch, and a claim whose
//     reply came only after that, hands its claims back to the queue with
//     their true deadlines, on a fresh, bounded context;
//  4. return, once steps 1 to 3 are done.
//
// Closing Redis and PostgreSQL clients is the caller's job, after Run.
func (c *Consumer) Run(ctx context.Context) error {
	c.stopping = ctx.Done()
	c.bookEnd.Store(0)
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	var wg sync.WaitGroup
	wake := c.wake
	var subDone <-chan struct{}
	if c.cfg.SharedWake {
		closed := make(chan struct{})
		close(closed) // the Group subscribes for all its consumers
		subDone = closed
	} else {
		subDone = subscribe(ctx, c.rdb, map[string]chan int64{c.cfg.Keys.Wake: wake})
	}

	// The drain's time counts from the stop (step 2), not from the scan
	// loop's end: a scan loop in a Redis call when ctx ends returns only
	// when the call does (go-redis waits out its read timeout), and the
	// batches in flight are not given that time on top.
	drained, cutDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(cutDone)
		select {
		case <-ctx.Done():
		case <-drained:
			return
		}
		timer := time.NewTimer(c.cfg.DrainTimeout)
		defer timer.Stop()
		select {
		case <-drained:
		case <-timer.C:
			if c.batches.Load() > 0 {
				c.log.Warn("drain timeout passed; handing back unfinished claims", zap.Duration("drain_timeout", c.cfg.DrainTimeout))
			} else {
				// Only the scan loop's call is left: what it claimed
				// is handed back when its reply comes (processClaim).
				c.log.Info("drain timeout passed while the scan loop waits on Redis; what its claim took is handed back",
					zap.Duration("drain_timeout", c.cfg.DrainTimeout))
			}
			c.bookEnd.Store(time.Now().Add(BookkeepingTimeout).UnixNano())
			cancelWork()
		}
	}()
	c.scan(ctx, workCtx, &wg, wake)
	wg.Wait()
	close(drained)
	<-cutDone
	<-subDone
	return nil
}

// subscribe forwards deadlines published on each channel of wakes to its
// consumer's wake-up channel until ctx ends, on one connection. Dropped
// messages are harmless: the head check catches up.
func subscribe(ctx context.Context, rdb redis.UniversalClient, wakes map[string]chan int64) <-chan struct{} {
	done := make(chan struct{})
	channels := make([]string, 0, len(wakes))
	for ch := range wakes {
		channels = append(channels, ch)
	}
	ps := rdb.Subscribe(ctx, channels...)
	go func() {
		defer close(done)
		defer ps.Close()
		ch := ps.Channel()
		for {
			select {
			case <-ctx.Done():
				return
			case msg, ok := <-ch:
				if !ok {
					return
				}
				d, err := strconv.ParseInt(msg.Payload, 10, 64)
				wake, ok := wakes[msg.Channel]
				if err != nil || !ok {
					continue
				}
				select {
				case wake <- d:
				default:
				}
			}
		}
	}()
	return done
}

func (c *Consumer) scan(ctx, workCtx context.Context, wg *sync.WaitGroup, wake <-chan int64) {
	sem := c.cfg.Slots
	if sem == nil {
		sem = make(chan struct{}, c.cfg.Workers)
	}
	redisBack := newDependencyBackoff(c.cfg.BackoffMax)
	beat := time.NewTicker(time.Second)
	defer beat.Stop()
	for {
		c.heartbeat()
		// A claim never takes more than a free worker can close.
	acquire:
		for {
			select {
			case sem <- struct{}{}:
				break acquire
			case <-beat.C:
				c.heartbeat()
			case <-ctx.Done():
				return
			}
		}
		limit, ok := c.claimLimit(ctx)
		if !ok {
			<-sem
			return
		}
		// The lease begins when Redis runs the claim: after this, however
		// late its reply comes (processClaim counts the batch's time from
		// here).
		sent := time.Now()
		res, err := c.claim(ctx, limit)
		if err != nil {
			<-sem
			if ctx.Err() != nil {
				return
			}
			c.m.Errors.WithLabelValues(metrics.StageClaim).Inc()
			// A refusal is Redis answering: no outage to report, and its
			// own error line is the one log line it gets.
			refused := c.refused(err, metrics.StageClaim)
			c.m.SetUp(metrics.DepRedis, refused)
			d := redisBack.NextBackOff()
			if !refused {
				c.log.Warn("claim failed; backing off", zap.Error(err), zap.Duration("retry_in", d))
			}
			if !lifecycle.Sleep(ctx, d) {
				return
			}
			continue
		}
		redisBack.Reset()
		c.m.SetUp(metrics.DepRedis, true)
		c.m.LastScan.Set(float64(c.now().UnixNano()) / 1e9)
		if res.paused {
			<-sem
			c.m.Paused.Set(1)
			if !c.waitPaused(ctx, wake) {
				return
			}
			continue
		}
		c.m.Paused.Set(0)
		if c.limiter != nil {
			c.limiter.ReserveN(time.Now(), len(res.items))
		}
		if len(res.items) > 0 {
			wg.Add(1)
			c.batches.Add(1)
			go func() {
				defer func() { c.batches.Add(-1); <-sem; wg.Done() }()
				c.processClaim(workCtx, res.items, sent)
			}()
		} else {
			<-sem
		}
		next := earliest(res.nextQueue+c.cfg.CloseDelay.Milliseconds(), res.nextExpiry, res.nextQueue >= 0)
		if len(res.items)+res.forwarded == limit || (next >= 0 && next <= res.now) {
			continue // more is due now
		}
		if !c.wait(ctx, res.now, next, wake) {
			return
		}
	}
}

// claimLimit is how many entries the next claim may take: the batch size,
// or fewer when ORDERDELAY_MAX_CLOSE_RATE allows fewer right now (it waits
// until at least one is allowed). It reports false when ctx ended.
func (c *Consumer) claimLimit(ctx context.Context) (int, bool) {
	if c.limiter == nil {
		return c.cfg.BatchSize, true
	}
	for {
		tokens := c.limiter.Tokens()
		if tokens >= 1 {
			return min(int(tokens), c.cfg.BatchSize), true
		}
		c.m.CloseRateLimited.Inc()
		wait := time.Duration((1 - tokens) / float64(c.limiter.Limit()) * float64(time.Second))
		if !lifecycle.Sleep(ctx, max(wait, time.Millisecond)) {
			return 0, false
		}
		c.heartbeat()
	}
}

// waitPaused sleeps one scan interval, or until a wake-up (resume
// publishes one), so every replica sees a pause and a resume within one
// scan interval without polling faster than that.
func (c *Consumer) waitPaused(ctx context.Context, wake <-chan int64) bool {
	t := time.NewTimer(c.cfg.ScanInterval)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-wake:
	}
	return true
}

// earliest returns the smaller of two Unix-ms instants, -1 standing for
// "none"; q counts only if qValid.
func earliest(q, expiry int64, qValid bool) int64 {
	switch {
	case !qValid:
		return expiry
	case expiry < 0:
		return q
	default:
		return min(q, expiry)
	}
}

// wait sleeps until the Redis-clock instant next (or at most ScanInterval),
// waking earlier for a published deadline or one the head check finds.
// redisNow is Redis's clock when the last claim ran. It reports false when
// ctx ended.
func (c *Consumer) wait(ctx context.Context, redisNow, next int64, wake <-chan int64) bool {
	start := time.Now()
	sleepFor := func(target int64) time.Duration {
		if target < 0 {
			return c.cfg.ScanInterval
		}
		d := time.Duration(target-redisNow)*time.Millisecond - time.Since(start)
		return min(max(d, sleepFloor), c.cfg.ScanInterval)
	}
	timer := time.NewTimer(sleepFor(next))
	defer timer.Stop()
	var head <-chan time.Time
	if c.cfg.HeadCheck > 0 {
		head = time.After(jitter(c.cfg.HeadCheck))
	}
	for {
		select {
		case <-ctx.Done():
			return false
		case <-timer.C:
			return true
		case d := <-wake:
			if next < 0 || d+c.cfg.CloseDelay.Milliseconds() < next {
				next = d + c.cfg.CloseDelay.Milliseconds()
				timer.Reset(sleepFor(next))
			}
		case <-head:
			c.heartbeat()
			head = time.After(jitter(c.cfg.HeadCheck))
			hd, found, err := c.h.head(ctx)
			if err != nil && ctx.Err() == nil {
				// Redis went away while the scanner slept: say so now,
				// not at the next claim (at most one error per head check).
				c.m.Errors.WithLabelValues(metrics.StageClaim).Inc()
				c.m.SetUp(metrics.DepRedis, c.refused(err, metrics.StageClaim))
				continue
			}
			if !found {
				continue
			}
			d := hd + c.cfg.CloseDelay.Milliseconds()
			if next < 0 || d < next {
				next = d
				timer.Reset(sleepFor(next))
			}
		}
	}
}

// refused reports whether err is Redis refusing the daemon's user a
// command (queue.IsRefused: an ACL changed while the daemon runs, which
// the start-up check could not see), and if so says so where an operator
// looks: an error in the log naming the fix, and
// orderdelay_config_warning{check="redis_permissions"}. Nothing is lost
// (every script writes where an entry goes before removing it from where
// it was); the work waits, retried, until the ACL is mended. That error
// is the refusal's one log line: a caller that reports false logs its own
// warning, one that reports true logs nothing more. stage is the
// errors_total stage the caller counted the failure under.
func (c *Consumer) refused(err error, stage string) bool {
	if !queue.IsRefused(err) {
		return false
	}
	c.m.Warn(metrics.CheckRedisPermissions, true)
	c.log.Error("redis refused a command the daemon needs: its user lacks a permission (was the ACL changed while the daemon runs?); "+
		"nothing is lost and the work is retried, but no order closes until the user may run every command the daemon needs (README: Redis permissions)",
		zap.String("stage", stage), zap.Error(err))
	return true
}

// jitter spreads d by ±20% so replicas do not poll in lockstep.
func jitter(d time.Duration) time.Duration { return lifecycle.Jitter(d, 5) }

func (c *Consumer) token() string {
	return c.cfg.Owner + ":" + c.nonce + "." + strconv.FormatUint(c.seq.Add(1), 36)
}

// claim claims (or forwards, or in a dry run reads) at most limit due
// entries, as the handler does, and accounts for what it did.
func (c *Consumer) claim(ctx context.Context, limit int) (claimResult, error) {
	return c.h.claim(ctx, limit)
}

// claimAs claims once (queue.Store.Claim) under the lease token tok.
// batch leases the claim as one batch (the order queue); task queues lease
// per member, as their workers and polls extend, ack and check single
// tasks.
func (c *Consumer) claimAs(ctx context.Context, limit int, tok string, batch bool) (claimResult, error) {
	raw, err := c.q.Claim(ctx, queue.ClaimArgs{Limit: limit, Lease: c.cfg.Lease, Token: tok,
		CloseDelay: c.cfg.CloseDelay, CountRedeliveries: c.cfg.CountRedeliveries, Batch: batch})
	if err != nil {
		return claimResult{}, err
	}
	CountClaim(c.m, c.log, raw)
	res := fromStore(raw, tok)
	if batch {
		// The fence and the finish of a batch no script has changed
		// since need not read its records back (queue.Store.FenceBatch).
		for i := range res.items {
			res.items[i].claimed = len(res.items)
		}
	}
	c.m.Inflight.Add(float64(len(res.items)))
	return res, nil
}

// CountClaim accounts for what a claim did: the entries it leased, those
// re-claimed after a replica's lease expired, and the malformed ones it
// dead-lettered (logged). The scan loop counts its claims so, and a poll
// its (tasks.PollStore, which also counts what the poll buried).
func CountClaim(m *metrics.Metrics, log *zap.Logger, r queue.ClaimResult) {
	m.Claimed.Add(float64(len(r.Items)))
	m.Reclaimed.Add(float64(r.Reclaimed))
	for reason, n := range r.Dead {
		m.DeadLettered.WithLabelValues(reason).Add(float64(n))
		log.Warn("dead-lettered malformed entries", zap.String("reason", reason), zap.Int("count", n))
	}
}

var errReply = errors.New("unexpected reply")

// fromStore is the scan loop's form of a claim's result, each item
// carrying the token it was leased under.
func fromStore(r queue.ClaimResult, tok string) claimResult {
	out := claimResult{now: r.Now, nextQueue: r.NextQueue, nextExpiry: r.NextExpiry,
		reclaimed: r.Reclaimed, paused: r.Paused, dead: r.Dead, items: make([]item, len(r.Items))}
	for i, it := range r.Items {
		out.items[i] = item{token: tok, serial: it.Serial, deadline: it.Deadline, attempts: it.Attempts}
	}
	return out
}
