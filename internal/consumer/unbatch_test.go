package consumer

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Tests of queue.Store.UnbatchLeases against the real lease scripts: the
// rollback to a release that leases per member only. Such a release
// re-claims expired leases through {Q}:inflight alone (olderClaim stands
// for its claim) and finishes with the same compare-and-set on the lease
// record (finishScript with a token that names no batch).

// olderClaimScript is a per-member-only claim, as a release before batch
// leases makes one: the members of {Q}:inflight whose lease expired on
// Redis's clock get the claim's token and a new expiry, keeping their
// deadline and attempts. It never reads {Q}:leases.
//
//	KEYS[1] -> {Q}:inflight KEYS[2] -> {Q}:deadlines KEYS[3] -> {Q}:lease
//	ARGV[1] -> token; ARGV[2] -> lease, ms
//
// Returns serial, deadline pairs.
var olderClaimScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for _, s in ipairs(redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE')) do
  local rec = redis.call('HGET', KEYS[3], s) or ''
  local d, a = string.match(rec, '^([^|]*)|([^|]*)|')
  d = d or redis.call('ZSCORE', KEYS[2], s)
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), s)
  redis.call('ZADD', KEYS[2], d, s)
  redis.call('HSET', KEYS[3], s, d .. '|' .. (a or '0') .. '|' .. ARGV[1] .. '|')
  out[#out+1] = s; out[#out+1] = d
end
return out
`)

// olderClaim runs olderClaimScript with token tok and returns what it
// claimed, serial → deadline.
func (e *env) olderClaim(tok string) map[string]int64 {
	e.T.Helper()
	raw, err := olderClaimScript.Run(context.Background(), e.RDB, []string{e.Keys.Inflight, e.Keys.Deadlines, e.Keys.Lease},
		tok, time.Minute.Milliseconds()).StringSlice()
	if err != nil {
		e.T.Fatal(err)
	}
	out := map[string]int64{}
	for i := 0; i+1 < len(raw); i += 2 {
		d, err := strconv.ParseInt(raw[i+1], 10, 64)
		if err != nil {
			e.T.Fatalf("older claim: deadline %q: %v", raw[i+1], err)
		}
		out[raw[i]] = d
	}
	return out
}

// unbatch runs the conversion and checks it found no problem.
func (e *env) unbatch() queue.UnbatchResult {
	e.T.Helper()
	res, err := e.st.UnbatchLeases(context.Background(), 0)
	if err != nil || len(res.Problems) != 0 {
		e.T.Fatalf("unbatch: %+v, %v", res, err)
	}
	return res
}

// A pod is killed holding a batch: a per-member-only claim does not see
// it; once converted, that claim re-claims every member at its deadline,
// no batch is left, and the older holder's finish leaves nothing behind.
func TestUnbatchKilledHolderReclaimedByPerMemberClaim(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Minute)
	serials := []string{"ub-1", "ub-2", "ub-3"}
	e.Enqueue(serials, past)
	killed := e.consumer(Config{Owner: "killed"})
	if res, err := killed.claimBatch(ctx); err != nil || len(res.items) != 3 {
		t.Fatalf("claim: %v, %+v", err, res.items)
	}
	e.expire(serials[0]) // the batch's lease runs out: nobody hands it back
	if got := e.olderClaim("old:1.1"); len(got) != 0 {
		t.Fatalf("a per-member claim took %v of an unconverted batch", got)
	}
	res := e.unbatch()
	if res.Batches != 1 || res.Members != 3 || res.Remaining != 0 || e.card(e.Keys.Leases) != 0 {
		t.Fatalf("unbatch %+v, want 1 batch of 3 converted, none left", res)
	}
	if n, _ := e.RDB.HLen(ctx, e.Keys.LeaseBatch).Result(); n != 0 {
		t.Errorf("%d {Q}:leasebatch fields left, want 0", n)
	}
	if h := e.held(); h != 3 {
		t.Errorf("%d held after the conversion, want 3", h)
	}
	got := e.olderClaim("old:1.1")
	want := queue.DeadlineMillis(past)
	if len(got) != 3 || got["ub-1"] != want || got["ub-2"] != want || got["ub-3"] != want {
		t.Fatalf("a per-member claim after the conversion took %v, want each of %v at %d", got, serials, want)
	}
	older := e.consumer(Config{Owner: "old"})
	var items []item
	for _, s := range serials {
		items = append(items, item{token: "old:1.1", serial: s})
	}
	older.finish(items)
	e.assertNoLeaseKeys(t)
}

// The holder is alive: after the conversion it still finishes, retries
// and hands back its members by their records, and leaves no per-member
// entry behind but the backoff's; a per-member claim takes nothing before
// the batch's expiry.
func TestUnbatchLiveHolderFinishes(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	e.Enqueue([]string{"ul-1", "ul-2", "ul-3", "ul-4"}, past)
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 4 {
		t.Fatalf("claim: %v, %+v", err, res.items)
	}
	expiry, err := e.RDB.ZScore(ctx, e.Keys.Leases, res.items[0].token).Result()
	if err != nil {
		t.Fatal(err)
	}
	e.unbatch()
	for _, it := range res.items {
		if s, err := e.RDB.ZScore(ctx, e.Keys.Inflight, it.serial).Result(); err != nil || s != expiry {
			t.Errorf("%s in {Q}:inflight at %v (%v), want the batch's expiry %v", it.serial, s, err, expiry)
		}
		if s, err := e.RDB.ZScore(ctx, e.Keys.Deadlines, it.serial).Result(); err != nil || int64(s) != queue.DeadlineMillis(past) {
			t.Errorf("%s in {Q}:deadlines at %v (%v), want its deadline", it.serial, s, err)
		}
	}
	if got := e.olderClaim("old:1.1"); len(got) != 0 {
		t.Fatalf("a per-member claim took %v before the lease's expiry", got)
	}
	c.finish(res.items[:2])
	c.retry(res.items[2:3], time.Hour, true, "boom")
	c.handBack(res.items[3:])
	if n := e.card(e.Keys.Inflight) + e.card(e.Keys.Deadlines); n != 2 {
		t.Errorf("%d per-member entries, want 2 (the backoff's)", n)
	}
	got, err := e.cl.Get(ctx, "ul-3")
	if err != nil || got.State != client.StateBackoff || got.Attempts != 1 {
		t.Errorf("retried member %+v (%v), want backing off after 1 attempt", got, err)
	}
	if s, err := e.RDB.ZScore(ctx, e.Keys.Queue, "ul-4").Result(); err != nil || int64(s) != queue.DeadlineMillis(past) {
		t.Errorf("handed-back member at %v (%v), want its deadline", s, err)
	}
	if h := e.held(); h != 1 {
		t.Errorf("%d held, want 1 (the backoff)", h)
	}
	for _, s := range []string{"ul-1", "ul-2", "ul-4"} {
		if ok, _ := e.RDB.HExists(ctx, e.Keys.Lease, s).Result(); ok {
			t.Errorf("%s: lease record left behind", s)
		}
	}
}

// A live holder closes its converted batch through the whole close path
// (fence included): every order closes once and no lease key is left.
func TestUnbatchLiveHolderCloses(t *testing.T) {
	t.Parallel()
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := e.Orders("ub-close", 3, past)
	e.Enqueue(serials, past)
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 3 {
		t.Fatalf("claim: %v, %+v", err, res.items)
	}
	e.unbatch()
	c.process(ctx, res.items)
	for _, s := range serials {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s: %s, want closed", s, st)
		}
	}
	e.assertNoLeaseKeys(t)
}

// A daemon that leases per batch is still running when the conversion
// happens: its next claim re-claims the expired per-member leases into a
// batch of its own (their per-member entries go) and the killed holder's
// late finish changes nothing.
func TestUnbatchReclaimedByBatchDaemon(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := []string{"ur-1", "ur-2"}
	e.Enqueue(serials, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 2 {
		t.Fatalf("claim: %v, %+v", err, resA.items)
	}
	e.expire(serials[0])
	e.unbatch()
	b := e.consumer(Config{Owner: "B"})
	resB, err := b.claimBatch(ctx)
	var names []string
	for _, it := range resB.items {
		names = append(names, it.serial)
		if it.deadline != queue.DeadlineMillis(past) {
			t.Errorf("re-claimed %+v, want its deadline", it)
		}
	}
	slices.Sort(names)
	if err != nil || !slices.Equal(names, serials) {
		t.Fatalf("B re-claimed %v (%v), want %v", names, err, serials)
	}
	if n := e.card(e.Keys.Inflight) + e.card(e.Keys.Deadlines); n != 0 {
		t.Errorf("%d per-member entries after the re-claim into a batch, want 0", n)
	}
	a.finish(resA.items)
	if h := e.held(); h != 2 {
		t.Fatalf("%d held after the old holder's late finish, want B's 2", h)
	}
	b.finish(resB.items)
	e.assertNoLeaseKeys(t)
}

// A producer reschedules members before and after the conversion, through
// the client and with a raw ZADD: the producer's deadline wins every time,
// the holder's finish removes only what it still holds, and nothing is
// left in the lease keys.
func TestUnbatchProducerRescheduleWins(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	serials := []string{"up-before", "up-after", "up-raw"}
	e.Enqueue(serials, past)
	c := e.consumer(Config{})
	res, err := c.claimBatch(ctx)
	if err != nil || len(res.items) != 3 {
		t.Fatalf("claim: %v, %+v", err, res.items)
	}
	later := e.RedisNow().Add(time.Hour)
	if r, _, err := e.cl.Enqueue(ctx, "up-before", later, client.Reschedule); err != nil || r != client.Moved {
		t.Fatalf("reschedule before: %v, %v", r, err)
	}
	if u := e.unbatch(); u.Members != 2 || u.Departed != 1 {
		t.Errorf("unbatch %+v, want 2 converted and the rescheduled one passed over", u)
	}
	if _, err := e.RDB.ZScore(ctx, e.Keys.Inflight, "up-before").Result(); err != redis.Nil {
		t.Errorf("a member rescheduled before the conversion was given a lease (%v)", err)
	}
	if r, _, err := e.cl.Enqueue(ctx, "up-after", later, client.Reschedule); err != nil || r != client.Moved {
		t.Fatalf("reschedule after: %v, %v", r, err)
	}
	e.Enqueue([]string{"up-raw"}, later)
	c.finish(res.items)
	e.assertNoLeaseKeys(t)
	for _, s := range serials {
		if sc, err := e.RDB.ZScore(ctx, e.Keys.Queue, s).Result(); err != nil || int64(sc) != queue.DeadlineMillis(later) {
			t.Errorf("%s at %v (%v), want the producer's deadline", s, sc, err)
		}
	}
}
