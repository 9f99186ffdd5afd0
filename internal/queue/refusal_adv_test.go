package queue_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A script's writes stay when a later command of it fails, and Redis
// refuses a command mid-script when an ACL tightened while the daemon runs
// no longer allows it (the start-up permission check cannot see that), or
// a key holds a foreign type. These tests refuse, in turn, each command a
// script sends after its first write, on a private server, and ask
// whether every entry the script was moving is still somewhere a claim, a
// recovery or an operator finds it: the scripts write the new place before
// they clear the old one, so the old place stays the judge until the new
// one is written.

type refusalEnv struct {
	t   *testing.T
	ctx context.Context
	rdb *redis.Client
	k   queue.Keys
	st  *queue.Store
}

func newRefusalEnv(t *testing.T) *refusalEnv {
	t.Helper()
	rdb, _ := testenv.PrivateRedis(t) // its ACL is changed by refused
	k := queue.NewKeys("refuse:q")
	return &refusalEnv{t: t, ctx: context.Background(), rdb: rdb, k: k, st: queue.NewStore(rdb, k)}
}

// refused runs f while the server refuses cmd to the default user, lets
// it run cmd again, and requires f to have met the refusal.
func (e *refusalEnv) refused(cmd string, f func() error) {
	e.t.Helper()
	if err := e.rdb.Do(e.ctx, "ACL", "SETUSER", "default", "-"+cmd).Err(); err != nil {
		e.t.Fatal(err)
	}
	err := f()
	if err := e.rdb.Do(e.ctx, "ACL", "SETUSER", "default", "+"+cmd).Err(); err != nil {
		e.t.Fatal(err)
	}
	if !queue.IsRefused(err) {
		e.t.Fatalf("refused %s: %v; want the script to meet the refusal", cmd, err)
	}
}

// refusedExcept is refused, with cmd given back on the keys allowed (an
// ACL selector): a script meets the refusal at cmd on any other key.
func (e *refusalEnv) refusedExcept(cmd string, allowed []string, f func() error) {
	e.t.Helper()
	sel := "(+" + cmd
	for _, k := range allowed {
		sel += " ~" + k
	}
	sel += ")"
	if err := e.rdb.Do(e.ctx, "ACL", "SETUSER", "default", "-"+cmd, sel).Err(); err != nil {
		e.t.Fatal(err)
	}
	err := f()
	if err := e.rdb.Do(e.ctx, "ACL", "SETUSER", "default", "+"+cmd, "clearselectors").Err(); err != nil {
		e.t.Fatal(err)
	}
	if !queue.IsRefused(err) {
		e.t.Fatalf("refused %s but on %v: %v; want the script to meet the refusal", cmd, allowed, err)
	}
}

// due adds serials to the queue key, due a minute ago (one ms apart).
func (e *refusalEnv) due(serials ...string) {
	e.t.Helper()
	now, err := e.st.Now(e.ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	base := queue.DeadlineMillis(now.Add(-time.Minute))
	zs := make([]redis.Z, len(serials))
	for i, s := range serials {
		zs[i] = redis.Z{Score: float64(base + int64(i)), Member: s}
	}
	if err := e.rdb.ZAdd(e.ctx, e.k.Queue, zs...).Err(); err != nil {
		e.t.Fatal(err)
	}
}

// claim leases every due entry under token, as one batch or per member.
func (e *refusalEnv) claim(token string, batch bool, want int) queue.ClaimResult {
	e.t.Helper()
	res, err := e.st.Claim(e.ctx, queue.ClaimArgs{Limit: 100, Lease: time.Minute, Token: token, Batch: batch})
	if err != nil || len(res.Items) != want {
		e.t.Fatalf("claim: %d items, %v; want %d", len(res.Items), err, want)
	}
	return res
}

// where says where serial is for a claim, a recovery or an operator to
// find it: the queue key; {q}:inflight (per-member leases and backoffs:
// the claim re-takes them when they expire); a batch lease the claim
// re-takes when it expires (its token in {q}:leases, the serial in its
// member list, its lease record carrying the token); the dead-letter set;
// a stream entry or ready-list item; a reliable list's taken item that
// its recovery returns ({q}:unacked and {q}:taken). "" is nowhere: a
// lease record alone is found by no claim, and the reconciler takes it for
// a lease and leaves the order alone.
func (e *refusalEnv) where(s string) string {
	e.t.Helper()
	k := e.k
	has := func(key string) bool {
		err := e.rdb.ZScore(e.ctx, key, s).Err()
		if err != nil && err != redis.Nil {
			e.t.Fatal(err)
		}
		return err == nil
	}
	switch {
	case has(k.Queue):
		return "queue"
	case has(k.Inflight):
		return "inflight"
	case has(k.Dead):
		return "dead"
	}
	if rec, err := e.rdb.HGet(e.ctx, k.Lease, s).Result(); err == nil {
		if r, ok := queue.ParseLeaseRecord(rec); ok && e.rdb.ZScore(e.ctx, k.Leases, r.Token).Err() == nil {
			list, _ := e.rdb.HGet(e.ctx, k.LeaseBatch, r.Token).Result()
			if slices.Contains(strings.Split(list, "\n"), s) {
				return "batch " + r.Token
			}
		}
	}
	if has(k.Unacked) && e.rdb.HExists(e.ctx, k.Taken, s).Val() {
		return "taken"
	}
	items, _ := e.rdb.LRange(e.ctx, k.Ready, 0, -1).Result()
	for _, it := range items {
		if strings.Contains(it, `"id":"`+s+`"`) {
			return "ready"
		}
	}
	ents, _ := e.rdb.XRange(e.ctx, k.Stream, "-", "+").Result()
	for _, x := range ents {
		if x.Values["id"] == s {
			return "stream"
		}
	}
	return ""
}

// check requires every serial to be somewhere (where), and every batch
// lease to count at least the members whose records carry its token: a
// count below them drops the batch while members still carry it (the
// holder's last finish, retry or hand-back of the count's members), and
// a member left so is in no place a claim reads.
func (e *refusalEnv) check(what string, serials ...string) {
	e.t.Helper()
	for _, s := range serials {
		if w := e.where(s); w == "" {
			rec, _ := e.rdb.HGet(e.ctx, e.k.Lease, s).Result()
			e.t.Errorf("%s: %s is in no place a claim or recovery finds it (lease record %q)", what, s, rec)
		}
	}
	toks, err := e.rdb.ZRange(e.ctx, e.k.Leases, 0, -1).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	recs, err := e.rdb.HGetAll(e.ctx, e.k.Lease).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	for _, tok := range toks {
		carry := 0
		for _, rec := range recs {
			if r, ok := queue.ParseLeaseRecord(rec); ok && r.Token == tok {
				carry++
			}
		}
		n, _ := strconv.Atoi(e.rdb.HGet(e.ctx, e.k.LeaseBatch, "#"+tok).Val())
		if n < carry {
			e.t.Errorf("%s: batch %s counts %d members, %d records carry its token", what, tok, n, carry)
		}
	}
}

func serials(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}

func leaseMode(batch bool) string {
	if batch {
		return "batch"
	}
	return "per-member"
}

// A retry whose backoff writes are refused keeps each entry in its lease
// (a batch's members in their batch) or in its backoff.
func TestRefusedRetryKeepsEveryEntry(t *testing.T) {
	for _, batch := range []bool{true, false} {
		cmds := []string{"hset", "zadd"} // a per-member lease is no batch to release
		if batch {
			cmds = append(cmds, "hdel", "zrem", "hincrby")
		}
		for _, cmd := range cmds {
			t.Run(leaseMode(batch)+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				ss := serials("R", 3)
				e.due(ss...)
				e.claim("r:1", batch, 3)
				e.refused(cmd, func() error {
					_, err := e.st.Retry(e.ctx, queue.RetryArgs{Token: "r:1", Serials: ss, Delay: time.Minute, Spend: true, LastError: "boom"})
					return err
				})
				e.check("retry refused "+cmd, ss...)
			})
		}
	}
}

// A dead-lettering whose writes are refused keeps each entry leased, or
// dead-letters it.
func TestRefusedBuryKeepsEveryEntry(t *testing.T) {
	for _, batch := range []bool{true, false} {
		cmds := []string{"zadd", "hset", "hdel", "zrem"}
		if batch {
			cmds = append(cmds, "hincrby")
		}
		for _, cmd := range cmds {
			t.Run(leaseMode(batch)+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				ss := serials("B", 3)
				e.due(ss...)
				e.claim("b:1", batch, 3)
				e.refused(cmd, func() error {
					_, err := e.st.Bury(e.ctx, queue.BuryArgs{Token: "b:1", Serials: ss, Reason: queue.ReasonFailed, LastError: "boom", CountRun: true})
					return err
				})
				e.check("bury refused "+cmd, ss...)
			})
		}
	}
}

// A hand-back whose writes are refused keeps each entry leased, or puts it
// back into the queue key.
func TestRefusedHandBackKeepsEveryEntry(t *testing.T) {
	for _, batch := range []bool{true, false} {
		cmds := []string{"zadd", "hdel", "zrem"}
		if batch {
			cmds = append(cmds, "hincrby")
		}
		for _, cmd := range cmds {
			t.Run(leaseMode(batch)+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				ss := serials("H", 3)
				e.due(ss...)
				e.claim("h:1", batch, 3)
				e.refused(cmd, func() error {
					_, err := e.st.HandBack(e.ctx, "h:1", ss)
					return err
				})
				e.check("hand-back refused "+cmd, ss...)
			})
		}
	}
}

// A producer's reschedule of held entries whose writes are refused keeps
// each where it was (leased, backing off) or puts it into the queue key
// at its new deadline: the lease is dropped only once the queue key holds
// it.
func TestRefusedRescheduleKeepsEveryEntry(t *testing.T) {
	for _, held := range []string{"batch of 1", "batch of 2", "backoff"} {
		cmds := []string{"zadd", "hdel", "zrem"}
		if held != "backoff" {
			cmds = append(cmds, "hincrby")
		}
		for _, cmd := range cmds {
			t.Run(held+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				n := 2
				if held == "batch of 1" {
					n = 1
				}
				ss := serials("E", n)
				e.due(ss...)
				res := e.claim("e:1", held != "backoff", n)
				if held == "backoff" {
					if r, err := e.st.Retry(e.ctx, queue.RetryArgs{Token: "e:1", Serials: ss, Delay: time.Minute}); err != nil || r.Moved != n {
						t.Fatalf("retry: %+v, %v", r, err)
					}
				}
				items := make([]queue.EnqueueItem, n)
				for i, it := range res.Items {
					items[i] = queue.EnqueueItem{Serial: it.Serial, Deadline: it.Deadline + 1} // still due
				}
				e.refused(cmd, func() error {
					_, err := e.st.Enqueue(e.ctx, queue.ModeReschedule, items)
					return err
				})
				e.check("reschedule refused "+cmd, ss...)
			})
		}
	}
}

// A cancel refused before it dropped the lease record leaves the batch
// counting that member: the holder's finish of it must not drop the batch
// under the members it still holds.
func TestRefusedCancelKeepsTheBatchCount(t *testing.T) {
	for _, cmd := range []string{"hdel", "hexists", "hincrby"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			ss := serials("C", 2)
			e.due(ss...)
			e.claim("c:1", true, 2)
			e.refused(cmd, func() error {
				_, err := e.st.Cancel(e.ctx, ss[0])
				return err
			})
			e.check("cancel refused "+cmd, ss[1])
			// The cancel failed; its order is still the holder's to close.
			if _, err := e.st.Finish(e.ctx, "c:1", ss[:1], false); err != nil {
				t.Fatal(err)
			}
			e.check("finish after the refused cancel", ss[1])
		})
	}
}

// A requeue of dead letters whose writes are refused keeps each in the
// dead-letter set or puts it into the queue key.
func TestRefusedRequeueKeepsEveryDeadLetter(t *testing.T) {
	for _, cmd := range []string{"zadd", "hdel", "zrem"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			ss := serials("D", 3)
			e.due(ss...)
			e.claim("d:1", true, 3)
			if n, err := e.st.Bury(e.ctx, queue.BuryArgs{Token: "d:1", Serials: ss, Reason: queue.ReasonFailed, CountRun: true}); err != nil || n != 3 {
				t.Fatalf("bury: %d, %v", n, err)
			}
			e.refused(cmd, func() error {
				_, err := e.st.Requeue(e.ctx, ss...)
				return err
			})
			e.check("requeue refused "+cmd, ss...)
		})
	}
}

// putTasks adds tasks due a minute ago, each with payload {"n":i}.
func (e *refusalEnv) putTasks(ids ...string) {
	e.t.Helper()
	now, err := e.st.Now(e.ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	for i, id := range ids {
		p, err := e.st.PutTask(e.ctx, queue.ModeCreate, queue.WriterClient, queue.TaskWrite{ID: id,
			DeadlineMS: queue.DeadlineMillis(now.Add(-time.Minute)) + int64(i), Payload: fmt.Sprintf(`{"n":%d}`, i)})
		if err != nil || p.Result != queue.ResultCreated {
			e.t.Fatalf("put %s: %+v, %v", id, p, err)
		}
	}
}

// poll leases every due task under a poll's token.
func (e *refusalEnv) poll(want int) string {
	e.t.Helper()
	p, err := e.st.PollTasks(e.ctx, queue.PollArgs{Limit: 100, Lease: time.Minute, MaxAttempts: 10})
	if err != nil || len(p.Tasks) != want {
		e.t.Fatalf("poll: %d tasks, %v; want %d", len(p.Tasks), err, want)
	}
	return p.Token
}

// payloads requires each queued, leased or dead task to have its payload
// (a dead letter keeps it for a requeue).
func (e *refusalEnv) payloads(what string, want map[string]string) {
	e.t.Helper()
	for id, p := range want {
		switch e.where(id) {
		case "queue", "inflight", "dead":
			if got, _ := e.st.Payload(e.ctx, id); got != p {
				e.t.Errorf("%s: %s (%s) has payload %q, want %q", what, id, e.where(id), got, p)
			}
		}
	}
}

// A requeue of dead tasks whose writes are refused keeps each in the
// dead-letter set or puts it into the queue key, with its payload.
func TestRefusedRequeueTasksKeepsEveryDeadLetter(t *testing.T) {
	for _, cmd := range []string{"zadd", "hdel", "zrem"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			ids := serials("T", 3)
			e.putTasks(ids...)
			tok := e.poll(3)
			if n, err := e.st.BuryTasks(e.ctx, tok, queue.ReasonFailed, "boom", ids); err != nil || n != 3 {
				t.Fatalf("bury: %d, %v", n, err)
			}
			e.refused(cmd, func() error {
				_, err := e.st.RequeueTasks(e.ctx, ids)
				return err
			})
			e.check("requeue tasks refused "+cmd, ids...)
			e.payloads("requeue tasks refused "+cmd, map[string]string{"T-0": `{"n":0}`, "T-1": `{"n":1}`, "T-2": `{"n":2}`})
		})
	}
}

// A forward whose writes are refused keeps each due task in the queue key
// or delivers it (a malformed one: dead-letters it).
func TestRefusedForwardKeepsEveryTask(t *testing.T) {
	for _, kind := range []string{"stream", "list"} {
		target := map[string]string{"stream": "xadd", "list": "lpush"}[kind]
		for _, cmd := range []string{target, "hget", "zrem", "hdel", "zscore", "zadd"} {
			t.Run(kind+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				ids := serials("F", 3)
				e.putTasks(ids...)
				// A raw producer's score that is no integer: dead-lettered.
				if err := e.rdb.ZAdd(e.ctx, e.k.Queue, redis.Z{Score: 1.7e12 + 0.5, Member: "F-bad"}).Err(); err != nil {
					t.Fatal(err)
				}
				e.refused(cmd, func() error {
					_, err := e.st.Forward(e.ctx, queue.ForwardArgs{Kind: kind, Limit: 10, MaxLen: 1000, Queue: "refuse:q"})
					return err
				})
				e.check("forward refused "+cmd, append(ids, "F-bad")...)
				e.payloads("forward refused "+cmd, map[string]string{"F-0": `{"n":0}`, "F-1": `{"n":1}`, "F-2": `{"n":2}`})
			})
		}
	}
}

// A dead-lettering of exhausted stream entries whose writes are refused
// keeps each entry pending in its group, or dead-letters its task with
// its payload.
func TestRefusedStreamBuryKeepsTheEntry(t *testing.T) {
	for _, cmd := range []string{"zadd", "hset", "hsetnx", "xrange", "xack"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			id, err := e.rdb.XAdd(e.ctx, &redis.XAddArgs{Stream: e.k.Stream, Values: []any{"id", "S-1", "deadline", "1700000000000", "payload", `{"n":1}`}}).Result()
			if err != nil {
				t.Fatal(err)
			}
			if err := e.rdb.XGroupCreate(e.ctx, e.k.Stream, "g", "0").Err(); err != nil {
				t.Fatal(err)
			}
			if err := e.rdb.XReadGroup(e.ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{e.k.Stream, ">"}}).Err(); err != nil {
				t.Fatal(err)
			}
			e.refused(cmd, func() error {
				_, err := e.st.BuryStreamEntries(e.ctx, "g", 0, 1, []string{id})
				return err
			})
			pend, err := e.st.StreamPending(e.ctx, "g", 0, "-", 10)
			if err != nil {
				t.Fatal(err)
			}
			dead := e.rdb.ZScore(e.ctx, e.k.Dead, "S-1").Err() == nil
			if len(pend) == 0 && !dead {
				t.Errorf("stream bury refused %s: S-1's entry was acknowledged and its task not dead-lettered", cmd)
			}
			if p, _ := e.st.Payload(e.ctx, "S-1"); len(pend) == 0 && p != `{"n":1}` {
				t.Errorf("stream bury refused %s: S-1 acknowledged, dead-lettered with payload %q, want its entry's", cmd, p)
			}
		})
	}
}

// A put whose writes are refused keeps the task where it was (leased) or
// queues it, and a retry of the put, once the refusal is lifted, leaves it
// with the put's payload.
func TestRefusedPutTaskKeepsTheTaskAndItsPayload(t *testing.T) {
	for _, held := range []string{"new", "queued", "leased"} {
		// Only a leased task has a lease to drop; a put publishes a deadline
		// earlier than the queue's head (the moved task is behind its own).
		cmds := map[string][]string{"new": {"zadd", "hset", "zrange", "publish"}, "queued": {"zadd", "hset", "zrange"},
			"leased": {"zadd", "hset", "zrange", "hdel", "zrem", "publish"}}[held]
		for _, cmd := range cmds {
			t.Run(held+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				now, err := e.st.Now(e.ctx)
				if err != nil {
					t.Fatal(err)
				}
				mode := queue.ModeReschedule
				if held == "new" {
					mode = queue.ModeCreate
				} else {
					e.putTasks("P-0")
				}
				if held == "leased" {
					e.poll(1)
				}
				put := queue.TaskWrite{ID: "P-0", DeadlineMS: queue.DeadlineMillis(now.Add(-time.Second)), Payload: `{"v":2}`}
				e.refused(cmd, func() error {
					_, err := e.st.PutTask(e.ctx, mode, queue.WriterClient, put)
					return err
				})
				if held != "new" {
					e.check("put refused "+cmd, "P-0")
				}
				if _, err := e.st.PutTask(e.ctx, mode, queue.WriterClient, put); err != nil {
					t.Fatal(err)
				}
				e.check("put retried after refused "+cmd, "P-0")
				e.payloads("put retried after refused "+cmd, map[string]string{"P-0": `{"v":2}`})
			})
		}
	}
}

// A hand-back of never-started polled tasks whose writes are refused keeps
// each leased or puts it back into the queue key.
func TestRefusedReleaseTasksKeepsEveryTask(t *testing.T) {
	for _, cmd := range []string{"zadd", "hdel", "zrem"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			ids := serials("L", 3)
			e.putTasks(ids...)
			tok := e.poll(3)
			e.refused(cmd, func() error {
				_, err := e.st.ReleaseTasks(e.ctx, tok, ids)
				return err
			})
			e.check("release refused "+cmd, ids...)
		})
	}
}

// listed puts task id and forwards it into a reliable ready list with
// maxAttempts, and returns the forward's arguments (ack timeout a minute).
func (e *refusalEnv) listed(id string, maxAttempts int) queue.ForwardArgs {
	e.t.Helper()
	e.putTasks(id)
	fwd := queue.ForwardArgs{Kind: "list", Limit: 10, Queue: "refuse:q", Reliable: true, AckTimeout: time.Minute, MaxAttempts: maxAttempts}
	if res, err := e.st.Forward(e.ctx, fwd); err != nil || res.Forwarded != 1 {
		e.t.Fatalf("forward: %+v, %v", res, err)
	}
	return fwd
}

// A take from a reliable list whose writes are refused keeps the item in
// the ready list or takes it whole (what recovery returns: {q}:unacked and
// {q}:taken).
func TestRefusedTakeKeepsTheItem(t *testing.T) {
	for _, cmd := range []string{"time", "zadd", "hset", "hincrby", "lmove"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			e.listed("K-0", 3)
			e.refused(cmd, func() error {
				_, err := e.st.Take(e.ctx)
				return err
			})
			e.check("take refused "+cmd, "K-0")
		})
	}
}

// A purge of dead letters refused after its first write leaves each
// letter either gone whole or still in the dead-letter set, where the
// next purge finds it: never a record without its dead-set entry (an
// inspect would call the serial dead, and no purge would reach it).
func TestRefusedPurgeLeavesNoRecordNoPurgeReaches(t *testing.T) {
	for _, cmd := range []string{"hdel", "zrem", "zscore", "hexists"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			ss := serials("P", 3)
			e.due(ss...)
			e.claim("p:1", true, 3)
			if n, err := e.st.Bury(e.ctx, queue.BuryArgs{Token: "p:1", Serials: ss, Reason: queue.ReasonFailed, CountRun: true}); err != nil || n != 3 {
				t.Fatalf("bury: %d, %v", n, err)
			}
			e.refused(cmd, func() error {
				_, err := e.st.PurgeDead(e.ctx, time.Nanosecond, 0)
				return err
			})
			for _, s := range ss {
				inDead := e.rdb.ZScore(e.ctx, e.k.Dead, s).Err() == nil
				hasInfo := e.rdb.HExists(e.ctx, e.k.DeadInfo, s).Val()
				if hasInfo && !inDead {
					t.Errorf("%s: a dead-letter record without its dead-set entry", s)
				}
			}
			if _, err := e.st.PurgeDead(e.ctx, time.Nanosecond, 0); err != nil {
				t.Fatal(err)
			}
			for _, k := range []string{e.k.Dead, e.k.DeadInfo} {
				if n := e.rdb.Exists(e.ctx, k).Val(); n != 0 {
					t.Errorf("%s left after the purge once the ACL is mended", k)
				}
			}
		})
	}
}

// A take refused at any of its commands neither copies its item nor
// spends a delivery on it: the consumer got an error, not the item. After
// the refusal and a recovery of everything taken (ack timeout 0, as once
// the timeout has passed), the item is once in the ready or processing
// list, not dead-lettered even with max_attempts 1, and the next take
// hands it out as its first delivery.
func TestRefusedTakeNeitherCopiesNorDeadLettersTheItem(t *testing.T) {
	for _, cmd := range []string{"time", "zadd", "hset", "hincrby", "lmove"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("K-0", 1)
			e.refused(cmd, func() error {
				_, err := e.st.Take(e.ctx)
				return err
			})
			fwd.AckTimeout = 0
			if _, err := e.st.Forward(e.ctx, fwd); err != nil {
				t.Fatal(err)
			}
			copies := 0
			for _, l := range []string{e.k.Ready, e.k.Processing} {
				items, err := e.rdb.LRange(e.ctx, l, 0, -1).Result()
				if err != nil {
					t.Fatal(err)
				}
				for _, it := range items {
					if strings.Contains(it, `"id":"K-0"`) {
						copies++
					}
				}
			}
			if copies != 1 {
				t.Errorf("take refused %s, then a recovery: %d copies of K-0 in the ready and processing lists, want 1", cmd, copies)
			}
			if e.rdb.ZScore(e.ctx, e.k.Dead, "K-0").Err() == nil {
				t.Errorf("take refused %s, then a recovery: K-0 dead-lettered (max_attempts 1), though no take delivered it", cmd)
			}
			it, err := e.st.Take(e.ctx)
			if err != nil || it.ID != "K-0" || it.Attempts != 0 {
				t.Errorf("take after the recovery: %+v, %v; want K-0 on its first delivery", it, err)
			}
		})
	}
}

// An ack refused halfway never leaves a {q}:taken record without its
// {q}:unacked entry: recovery walks the entries and would never reach the
// record, and every take would pass the id over — the next task of the
// id would wait for good. After the refusal, a recovery and a new task of
// the same id, a take hands out the id.
func TestRefusedAckLeavesNoRecordNoRecoveryReaches(t *testing.T) {
	for _, cmd := range []string{"lrem", "zrem", "hdel"} {
		t.Run("-"+cmd, func(t *testing.T) {
			e := newRefusalEnv(t)
			fwd := e.listed("A-0", 3)
			it, err := e.st.Take(e.ctx)
			if err != nil || it.ID != "A-0" {
				t.Fatalf("take: %+v, %v", it, err)
			}
			e.refused(cmd, func() error {
				_, err := e.st.AckTaken(e.ctx, "A-0", it.Delivery)
				return err
			})
			if e.rdb.HExists(e.ctx, e.k.Taken, "A-0").Val() && e.rdb.ZScore(e.ctx, e.k.Unacked, "A-0").Err() != nil {
				t.Errorf("ack refused %s: A-0 recorded as taken with no {q}:unacked entry: no recovery reaches it", cmd)
			}
			fwd.AckTimeout = 0
			if _, err := e.st.Forward(e.ctx, fwd); err != nil {
				t.Fatal(err)
			}
			e.putTasks("A-0")
			if _, err := e.st.Forward(e.ctx, fwd); err != nil {
				t.Fatal(err)
			}
			if it, err := e.st.Take(e.ctx); err != nil || it.ID != "A-0" {
				t.Errorf("ack refused %s, a recovery, A-0 put again: take %+v, %v; want A-0", cmd, it, err)
			}
		})
	}
}

// A purge of dead tasks refused after its first write leaves each letter
// either gone whole or still in the dead-letter set, where the next purge
// finds it: never a record, or a payload, without its dead-set entry (an
// inspect would call the id dead, and no purge would reach either; no
// live task owns the payload).
func TestRefusedPurgeTasksLeavesNothingNoPurgeReaches(t *testing.T) {
	for _, by := range []string{"ids", "before"} {
		for _, cmd := range []string{"hdel", "zrem", "zscore", "hexists"} {
			t.Run(by+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				ids := serials("P", 3)
				e.putTasks(ids...)
				tok := e.poll(3)
				if n, err := e.st.BuryTasks(e.ctx, tok, queue.ReasonFailed, "boom", ids); err != nil || n != 3 {
					t.Fatalf("bury: %d, %v", n, err)
				}
				purge := func() error {
					if by == "ids" {
						_, err := e.st.PurgeTasks(e.ctx, ids)
						return err
					}
					_, err := e.st.PurgeTasksBefore(e.ctx, time.Time{})
					return err
				}
				e.refused(cmd, purge)
				for _, id := range ids {
					if e.rdb.ZScore(e.ctx, e.k.Dead, id).Err() == nil {
						continue
					}
					if e.rdb.HExists(e.ctx, e.k.DeadInfo, id).Val() {
						t.Errorf("purge refused %s: %s has a dead-letter record without its dead-set entry", cmd, id)
					}
					if e.rdb.HExists(e.ctx, e.k.Payload, id).Val() {
						t.Errorf("purge refused %s: %s has a payload and is neither dead nor live", cmd, id)
					}
				}
				if err := purge(); err != nil {
					t.Fatal(err)
				}
				for _, k := range []string{e.k.Dead, e.k.DeadInfo, e.k.Payload} {
					if n := e.rdb.Exists(e.ctx, k).Val(); n != 0 {
						t.Errorf("%s left after the purge once the ACL is mended", k)
					}
				}
			})
		}
	}
}

// A forward refused after it delivered a task leaves no payload behind
// but where no command can remove it: a refused read (ZSCORE of the dead
// set, asked whether a dead letter of the id keeps the payload) comes
// before the task's first write. A refused HDEL cannot remove the payload
// at all, and the task is delivered with it before (the other orders
// would queue the task without its payload, or lose it): one field is
// left for the one task the script stopped at, with no task; a later put
// of the id writes its own.
func TestRefusedForwardLeavesAPayloadOnlyWhereHdelIsRefused(t *testing.T) {
	for _, kind := range []string{"stream", "list"} {
		for _, cmd := range []string{"zscore", "hdel"} {
			t.Run(kind+"/-"+cmd, func(t *testing.T) {
				e := newRefusalEnv(t)
				ids := serials("F", 3)
				e.putTasks(ids...)
				e.refused(cmd, func() error {
					_, err := e.st.Forward(e.ctx, queue.ForwardArgs{Kind: kind, Limit: 10, MaxLen: 1000, Queue: "refuse:q"})
					return err
				})
				var stray []string
				for _, id := range ids {
					if e.where(id) != "queue" && e.rdb.HExists(e.ctx, e.k.Payload, id).Val() {
						stray = append(stray, id)
					}
				}
				if max := map[string]int{"zscore": 0, "hdel": 1}[cmd]; len(stray) > max {
					t.Errorf("forward refused %s: payloads of delivered tasks left behind: %v (want at most %d)", cmd, stray, max)
				}
				for _, id := range stray {
					if w := e.where(id); w != kind && !(kind == "list" && w == "ready") {
						t.Errorf("forward refused %s: %s's payload is left, the task is in %q, not delivered", cmd, id, w)
					}
					now, err := e.st.Now(e.ctx)
					if err != nil {
						t.Fatal(err)
					}
					put := queue.TaskWrite{ID: id, DeadlineMS: queue.DeadlineMillis(now.Add(time.Hour)), Payload: `{"v":2}`}
					if p, err := e.st.PutTask(e.ctx, queue.ModeCreate, queue.WriterClient, put); err != nil || p.Result != queue.ResultCreated {
						t.Fatalf("put %s again: %+v, %v", id, p, err)
					}
					if got, _ := e.st.Payload(e.ctx, id); got != `{"v":2}` {
						t.Errorf("forward refused %s, %s put again: payload %q, want the put's", cmd, id, got)
					}
				}
			})
		}
	}
}
