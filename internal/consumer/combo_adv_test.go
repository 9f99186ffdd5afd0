package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/durabletier"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// A seeded random workload over the scripts merged from several branches
// at once (producer put/batch put/delete with max_pending, poll claim/ack,
// the worker's extend/retry/bury/hand-back, the task requeue and purge,
// the retention purge), with the invariants of docs/tasks.md checked
// after every step: no payload orphaned or missing, the lease companions
// agree, a new task never exceeds the cap, an existing one is never
// refused, nothing is claimed early or by two holders at once.
func TestAdvComboRandomWorkload(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for round := range 10 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			comboRun(t, seed+uint64(round), 400)
		})
	}
}

func comboRun(t *testing.T, seed uint64, steps int) {
	e := newRedisEnv(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 7))
	k := e.Keys
	cap := int64(6)
	if err := e.RDB.HSet(ctx, k.Meta, queue.MetaMaxPending, cap).Err(); err != nil {
		t.Fatal(err)
	}
	ids := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	type hold struct{ tok string }
	held := map[string]hold{}    // id -> the token our model believes holds it
	stale := map[string]string{} // id -> a token whose lease ran out
	requeued := false            // a requeue or a lowered cap may leave the queue past the cap (documented)
	durable := false
	snapshot := func() string {
		return fmt.Sprint(e.RDB.ZRangeWithScores(ctx, k.Queue, 0, -1).Val(), e.RDB.HGetAll(ctx, k.Payload).Val(),
			e.RDB.HGetAll(ctx, k.Lease).Val(), e.RDB.ZRange(ctx, k.Dead, 0, -1).Val())
	}
	pending := func() int64 {
		return e.RDB.ZCard(ctx, k.Queue).Val() + e.RDB.ZCard(ctx, k.Inflight).Val()
	}
	live := func(id string) bool {
		_, err := e.RDB.ZScore(ctx, k.Queue, id).Result()
		return err == nil || e.RDB.HExists(ctx, k.Lease, id).Val()
	}
	check := func(step int, what string) {
		t.Helper()
		q := e.RDB.ZRange(ctx, k.Queue, 0, -1).Val()
		lease := e.RDB.HKeys(ctx, k.Lease).Val()
		infl := e.RDB.ZRange(ctx, k.Inflight, 0, -1).Val()
		dls := e.RDB.ZRange(ctx, k.Deadlines, 0, -1).Val()
		dead := e.RDB.ZRange(ctx, k.Dead, 0, -1).Val()
		info := e.RDB.HKeys(ctx, k.DeadInfo).Val()
		pay := e.RDB.HKeys(ctx, k.Payload).Val()
		slices.Sort(lease)
		slices.Sort(infl)
		slices.Sort(dls)
		slices.Sort(dead)
		slices.Sort(info)
		fail := func(f string, a ...any) {
			t.Fatalf("seed %d step %d (%s): %s\nqueue %v lease %v inflight %v dead %v payload %v",
				seed, step, what, fmt.Sprintf(f, a...), q, lease, infl, dead, pay)
		}
		if !slices.Equal(lease, infl) || !slices.Equal(lease, dls) {
			fail("lease companions disagree: lease %v inflight %v deadlines %v", lease, infl, dls)
		}
		if !slices.Equal(dead, info) {
			fail("dead letters %v vs records %v", dead, info)
		}
		has := map[string]bool{}
		for _, p := range pay {
			has[p] = true
		}
		owner := map[string]bool{}
		for _, l := range [][]string{q, lease, dead} {
			for _, s := range l {
				owner[s] = true
				if !has[s] {
					fail("%s has no payload", s)
				}
			}
		}
		for _, p := range pay {
			if !owner[p] {
				fail("payload of %s orphaned", p)
			}
		}
		if !requeued && pending() > cap {
			fail("pending %d over the cap %d without a requeue", pending(), cap)
		}
	}
	now := func() time.Time { return e.RedisNow() }
	dcl := durabletier.Writer(e.cl).(*client.Client) // the daemon's durable tier
	for step := range steps {
		id := ids[rng.IntN(len(ids))]
		pc := e.cl
		if durable {
			pc = dcl
		}
		var what string
		if durable && rng.IntN(3) > 0 { // writes of the Go client on a durable queue: refused, nothing written
			before := snapshot()
			var err error
			if rng.IntN(2) == 0 {
				_, _, err = e.cl.PutTask(ctx, id, json.RawMessage(`{}`), now(), client.Reschedule)
			} else {
				_, err = e.cl.DeleteTasks(ctx, id)
			}
			if !errors.Is(err, client.ErrDurableQueue) {
				t.Fatalf("seed %d step %d: a client write on a durable queue: %v, want ErrDurableQueue", seed, step, err)
			}
			if after := snapshot(); after != before {
				t.Fatalf("seed %d step %d: a refused write changed the queue:\n%s\n%s", seed, step, before, after)
			}
			continue
		}
		switch op := rng.IntN(16); op {
		case 14: // the daemon's file flips durable
			durable = !durable
			what = fmt.Sprint("durable ", durable)
			if err := e.RDB.HSet(ctx, k.Meta, queue.MetaDurable, map[bool]string{true: "1", false: "0"}[durable]).Err(); err != nil {
				t.Fatal(err)
			}
		case 15: // the cap changes (a lower one may leave the queue above it)
			cap = int64(2 + rng.IntN(6))
			what = fmt.Sprint("cap ", cap)
			if err := e.RDB.HSet(ctx, k.Meta, queue.MetaMaxPending, cap).Err(); err != nil {
				t.Fatal(err)
			}
			if pending() > cap {
				requeued = true
			}
		case 0, 1, 2: // put, one of three modes
			mode := []client.Mode{client.Create, client.Reschedule, client.OnlyLater}[rng.IntN(3)]
			due := now().Add(time.Duration(rng.IntN(3)-2) * time.Second)
			existed := live(id)
			before := pending()
			what = fmt.Sprintf("put %s mode %d existed %v pending %d", id, mode, existed, before)
			res, _, err := pc.PutTask(ctx, id, json.RawMessage(fmt.Sprintf(`{"s":%d}`, step)), due, mode)
			var full *client.QueueFullError
			switch {
			case errors.As(err, &full):
				if existed {
					t.Fatalf("seed %d step %d: %s: existing task refused: %v", seed, step, what, err)
				}
			case err != nil:
				t.Fatal(err)
			case res == client.Created && before >= cap:
				t.Fatalf("seed %d step %d: %s: new task created at the cap", seed, step, what)
			}
			if res == client.Moved {
				delete(held, id) // a reschedule drops the lease
			}
		case 3: // batch put
			n := 1 + rng.IntN(4)
			items := make([]client.TaskItem, n)
			for i := range items {
				items[i] = client.TaskItem{ID: ids[rng.IntN(len(ids))], Payload: json.RawMessage(`{"b":1}`), Deadline: now().Add(-time.Second)}
			}
			what = fmt.Sprintf("batch %v", items)
			was := map[string]bool{}
			for _, it := range items {
				was[it.ID] = live(it.ID)
			}
			before := pending()
			res, err := pc.PutTasks(ctx, items, client.Create)
			var full *client.QueueFullError
			switch {
			case errors.As(err, &full):
				for _, i := range full.Refused {
					if was[items[i].ID] {
						t.Fatalf("seed %d step %d: %s: item %d (%s) existed and was refused", seed, step, what, i, items[i].ID)
					}
				}
			case err != nil:
				t.Fatal(err)
			}
			created := int64(0)
			for _, r := range res {
				if r == client.Created {
					created++
				}
			}
			if created > 0 && before+created > cap {
				t.Fatalf("seed %d step %d: %s: %d created from %d pending, over the cap %d", seed, step, what, created, before, cap)
			}
		case 4: // poll claim
			what = "claim"
			ts, tok, err := pollTasks(ctx, e.RDB, k, 1+rng.IntN(3), 0, time.Minute, 3)
			if err != nil {
				t.Fatal(err)
			}
			rn := now()
			for _, tk := range ts {
				if h, ok := held[tk.ID]; ok {
					t.Fatalf("seed %d step %d: %s claimed while %s holds its lease", seed, step, tk.ID, h.tok)
				}
				if tk.Deadline.After(rn) {
					t.Fatalf("seed %d step %d: %s claimed early (due %v, now %v)", seed, step, tk.ID, tk.Deadline, rn)
				}
				held[tk.ID] = hold{tok}
				if old, ok := stale[tk.ID]; ok {
					delete(stale, tk.ID)
					if n, err := queue.NewStore(e.RDB, k).RetryTasks(ctx, old, 0, "late", []string{tk.ID}); err != nil || n != 0 {
						t.Fatalf("seed %d step %d: the expired holder of %s still settles: %d, %v", seed, step, tk.ID, n, err)
					}
					if m, _, _ := queue.NewStore(e.RDB, k).AckTasks(ctx, old, []string{tk.ID}); len(m) != 1 {
						t.Fatalf("seed %d step %d: the expired holder of %s acked it", seed, step, tk.ID)
					}
				}
			}
		case 5, 6, 7, 8, 9: // settle a held task
			var hid string
			for h := range held {
				hid = h
				break
			}
			if hid == "" {
				continue
			}
			tok := held[hid].tok
			var n int
			var err error
			switch op {
			case 5:
				what = "ack " + hid
				var missed []string
				missed, _, err = queue.NewStore(e.RDB, k).AckTasks(ctx, tok, []string{hid})
				n = 1 - len(missed)
			case 6:
				what = "retry " + hid
				n, err = queue.NewStore(e.RDB, k).RetryTasks(ctx, tok, 0, "boom", []string{hid})
			case 7:
				what = "bury " + hid
				n, err = queue.NewStore(e.RDB, k).BuryTasks(ctx, tok, ReasonFailed, "boom", []string{hid})
			case 8:
				what = "hand back " + hid
				n, err = queue.NewStore(e.RDB, k).ReleaseTasks(ctx, tok, []string{hid})
			case 9:
				what = "extend " + hid
				var lost []string
				lost, err = queue.NewStore(e.RDB, k).ExtendTasks(ctx, tok, time.Minute, []string{hid})
				n = 1 - len(lost)
			}
			if err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Fatalf("seed %d step %d: %s: lease not found though the model holds it", seed, step, what)
			}
			if op != 9 {
				delete(held, hid)
			}
		case 10: // requeue a dead letter
			what = "requeue " + id
			outs, err := e.st.RequeueTasks(ctx, []string{id})
			if err != nil {
				t.Fatal(err)
			}
			if outs[0] == queue.RequeueDone {
				requeued = true
			}
		case 11: // purge: by id, or everything by retention
			if rng.IntN(2) == 0 {
				what = "purge " + id
				if _, err := e.st.PurgeTasks(ctx, []string{id}); err != nil {
					t.Fatal(err)
				}
			} else {
				what = "retention purge"
				if _, err := e.st.PurgeDead(ctx, 0, 1); err != nil {
					t.Fatal(err)
				}
			}
		case 13: // a held lease runs out: its holder's settles must fail
			for h, v := range held {
				what = "expire " + h
				if err := e.RDB.ZAddXX(ctx, k.Inflight, redis.Z{Score: 1, Member: h}).Err(); err != nil {
					t.Fatal(err)
				}
				stale[h] = v.tok
				delete(held, h)
				break
			}
		case 12:
			what = "delete " + id
			if _, err := pc.DeleteTasks(ctx, id); err != nil {
				t.Fatal(err)
			}
			delete(held, id)
		}
		check(step, what)
	}
}

// The same for a reliable list with a small max_len: put, forward (with
// recovery of unacknowledged items), Take (skipping ids taken already),
// Ack, an item's ack_timeout running out, requeue, purge and delete.
// Invariants: no payload orphaned or missing (a queued task and a dead
// letter have one; a forwarded item carries its own), the taken records
// match the processing list, an id is never held by two consumers, and
// every item of the ready and processing lists is accounted for.
func TestAdvComboReliableListWorkload(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for round := range 10 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			comboListRun(t, seed+uint64(round), 400)
		})
	}
}

func comboListRun(t *testing.T, seed uint64, steps int) {
	e := newRedisEnv(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 11))
	k := e.Keys
	cfg := reliableList(time.Hour, 3)
	cfg.Forward.MaxLen = 3
	ids := []string{"a", "b", "c", "d", "e"}
	held := map[string]client.ListItem{}
	var late []client.ListItem // deliveries the recovery returned while their consumers held them
	check := func(step int, what string) {
		t.Helper()
		q := e.RDB.ZRange(ctx, k.Queue, 0, -1).Val()
		dead := e.RDB.ZRange(ctx, k.Dead, 0, -1).Val()
		pay := e.RDB.HKeys(ctx, k.Payload).Val()
		proc := e.RDB.LRange(ctx, k.Processing, 0, -1).Val()
		ready := e.RDB.LRange(ctx, k.Ready, 0, -1).Val()
		taken := e.RDB.HGetAll(ctx, k.Taken).Val()
		unacked := e.RDB.ZRange(ctx, k.Unacked, 0, -1).Val()
		fail := func(f string, a ...any) {
			t.Fatalf("seed %d step %d (%s): %s\nqueue %v dead %v payload %v ready %v processing %v taken %v",
				seed, step, what, fmt.Sprintf(f, a...), q, dead, pay, ready, proc, taken)
		}
		has := map[string]bool{}
		for _, p := range pay {
			has[p] = true
		}
		owner := map[string]bool{}
		for _, l := range [][]string{q, dead} {
			for _, s := range l {
				owner[s] = true
				if !has[s] {
					fail("%s has no payload", s)
				}
			}
		}
		for _, p := range pay {
			if !owner[p] {
				fail("payload of %s orphaned", p)
			}
		}
		if len(taken) != len(proc) || len(unacked) != len(taken) {
			fail("%d taken records, %d unacked, %d items processing", len(taken), len(unacked), len(proc))
		}
		for _, body := range proc {
			var it client.ListItem
			if err := json.Unmarshal([]byte(body), &it); err != nil {
				fail("processing item %q: %v", body, err)
			}
			if taken[it.ID] != body {
				fail("processing item %q is not the one taken for %s (%q)", body, it.ID, taken[it.ID])
			}
		}
		for id := range held {
			if _, ok := taken[id]; !ok {
				fail("model holds %s but it is not taken", id)
			}
		}
	}
	for step := range steps {
		id := ids[rng.IntN(len(ids))]
		var what string
		switch rng.IntN(9) {
		case 0, 1:
			what = "put " + id
			mode := []client.Mode{client.Create, client.Reschedule}[rng.IntN(2)]
			if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(fmt.Sprintf(`{"s":%d}`, step)), e.RedisNow().Add(-time.Second), mode); err != nil {
				t.Fatal(err)
			}
		case 2:
			what = "forward"
			e.forwardOnce(cfg)
		case 3:
			what = "take"
			it, err := e.cl.Take(ctx)
			if errors.Is(err, client.ErrNotFound) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := held[it.ID]; ok {
				t.Fatalf("seed %d step %d: %s taken while a consumer holds it", seed, step, it.ID)
			}
			held[it.ID] = it
		case 4:
			if len(late) > 0 && rng.IntN(2) == 0 {
				// A consumer slower than ack_timeout acks at last: whatever
				// became of the item since (taken again, by a delivery of
				// the same task or of a newer one, or dead), it acknowledges
				// nothing, and a later delivery stays taken.
				i := rng.IntN(len(late))
				it := late[i]
				late = slices.Delete(late, i, i+1)
				what = "late ack " + it.ID + " #" + it.Delivery
				if err := e.cl.Ack(ctx, it); !errors.Is(err, client.ErrNotFound) {
					t.Fatalf("seed %d step %d: late ack of %s delivery %s: %v, want ErrNotFound", seed, step, it.ID, it.Delivery, err)
				}
				break
			}
			for h, it := range held {
				what = "ack " + h
				if err := e.cl.Ack(ctx, it); err != nil {
					t.Fatalf("seed %d step %d: ack %s: %v", seed, step, h, err)
				}
				delete(held, h)
				break
			}
		case 5:
			for h, it := range held {
				what = "time out " + h
				e.takenAgo(h, 2*time.Hour)
				e.forwardOnce(cfg) // recovery: back to the ready list, or dead
				delete(held, h)
				late = append(late, it)
				break
			}
		case 6:
			what = "requeue " + id
			if _, err := e.st.RequeueTasks(ctx, []string{id}); err != nil {
				t.Fatal(err)
			}
		case 7:
			if rng.IntN(2) == 0 {
				what = "purge " + id
				if _, err := e.st.PurgeTasks(ctx, []string{id}); err != nil {
					t.Fatal(err)
				}
			} else {
				what = "retention purge"
				if _, err := e.st.PurgeDead(ctx, 0, 1); err != nil {
					t.Fatal(err)
				}
			}
		case 8:
			what = "delete " + id
			if _, err := e.cl.DeleteTasks(ctx, id); err != nil {
				t.Fatal(err)
			}
		}
		check(step, what)
	}
}

// A task a producer re-added with a raw ZADD while a daemon's action ran
// it is live again (queued): when the action succeeds, the finish must
// leave it its payload, as a poll's ack does. Before the fix the sql and
// webhook actions' finish removed it, and the re-added task ran with a
// null payload.
func TestAdvFinishKeepsThePayloadOfARawReAdd(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	ctx := context.Background()
	e.putDue("x", `{"v":1}`)
	later := e.RedisNow().Add(time.Hour).UnixMilli()
	ids := e.runPass(Config{MaxAttempts: 3, Process: func(_ context.Context, ts []Task) []error {
		if err := e.RDB.ZAdd(ctx, e.Keys.Queue, redis.Z{Score: float64(later), Member: "x"}).Err(); err != nil {
			t.Fatal(err)
		}
		return make([]error, len(ts))
	}})
	if len(ids) != 1 {
		t.Fatalf("ran %q, want x", ids)
	}
	if _, err := e.RDB.ZScore(ctx, e.Keys.Queue, "x").Result(); err != nil {
		t.Fatalf("the re-added x is gone: %v", err)
	}
	if p := e.payloadOf("x"); p != `{"v":1}` {
		t.Fatalf("the re-added, queued x has payload %q after the first run finished, want {\"v\":1}", p)
	}
}

// A daemon action (sql, webhook) whose tasks producers and operators
// touch while it runs: inside the action, random re-puts (every mode),
// raw ZADDs, deletes, requeues and purges of the ids it holds; the action
// then succeeds, fails (an attempt, dead-lettered at the last) or asks
// for a later retry at random. After every pass: no payload orphaned or
// missing, the lease companions agree, and nothing the producer wrote
// during the run is lost.
func TestAdvComboDaemonActionWorkload(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			comboActionRun(t, seed+uint64(round), 120)
		})
	}
}

func comboActionRun(t *testing.T, seed uint64, steps int) {
	e := newRedisEnv(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 13))
	k := e.Keys
	ids := []string{"a", "b", "c", "d", "e"}
	check := func(step int, what string) {
		t.Helper()
		q := e.RDB.ZRange(ctx, k.Queue, 0, -1).Val()
		lease := e.RDB.HKeys(ctx, k.Lease).Val()
		infl := e.RDB.ZRange(ctx, k.Inflight, 0, -1).Val()
		dead := e.RDB.ZRange(ctx, k.Dead, 0, -1).Val()
		pay := e.RDB.HKeys(ctx, k.Payload).Val()
		slices.Sort(lease)
		slices.Sort(infl)
		fail := func(f string, a ...any) {
			t.Fatalf("seed %d step %d (%s): %s\nqueue %v lease %v dead %v payload %v",
				seed, step, what, fmt.Sprintf(f, a...), q, lease, dead, pay)
		}
		if !slices.Equal(lease, infl) {
			fail("lease %v vs inflight %v", lease, infl)
		}
		has := map[string]bool{}
		for _, p := range pay {
			has[p] = true
		}
		owner := map[string]bool{}
		for _, l := range [][]string{q, lease, dead} {
			for _, s := range l {
				owner[s] = true
				if !has[s] {
					fail("%s has no payload", s)
				}
			}
		}
		for _, p := range pay {
			if !owner[p] {
				fail("payload of %s orphaned", p)
			}
		}
	}
	past := func() time.Time { return e.RedisNow().Add(-time.Second) }
	for step := range steps {
		var what string
		switch rng.IntN(4) {
		case 0:
			id := ids[rng.IntN(len(ids))]
			what = "put " + id
			if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(fmt.Sprintf(`{"s":%d}`, step)), past(), client.Create); err != nil {
				t.Fatal(err)
			}
		case 1:
			id := ids[rng.IntN(len(ids))]
			what = "requeue/purge " + id
			if rng.IntN(2) == 0 {
				if _, err := e.st.RequeueTasks(ctx, []string{id}); err != nil {
					t.Fatal(err)
				}
			} else if _, err := e.st.PurgeTasks(ctx, []string{id}); err != nil {
				t.Fatal(err)
			}
		default:
			what = "action pass"
			var touched []string
			e.runPass(Config{MaxAttempts: 2, Process: func(_ context.Context, ts []Task) []error {
				errs := make([]error, len(ts))
				for i, tk := range ts {
					switch rng.IntN(8) {
					case 0:
						_, _, err := e.cl.PutTask(ctx, tk.ID, json.RawMessage(`{"moved":1}`), past().Add(time.Duration(rng.IntN(2))*time.Hour), client.Reschedule)
						if err != nil {
							t.Error(err)
						}
						touched = append(touched, "moved "+tk.ID)
					case 1:
						if _, err := e.cl.DeleteTasks(ctx, tk.ID); err != nil {
							t.Error(err)
						}
						touched = append(touched, "deleted "+tk.ID)
					case 2:
						if _, err := e.st.RequeueTasks(ctx, []string{tk.ID}); err != nil {
							t.Error(err)
						}
						if _, err := e.st.PurgeTasks(ctx, []string{tk.ID}); err != nil {
							t.Error(err)
						}
						touched = append(touched, "requeue+purge "+tk.ID)
					case 3: // a raw producer re-adds the id
						if err := e.RDB.ZAdd(ctx, k.Queue, redis.Z{Score: float64(past().UnixMilli()), Member: tk.ID}).Err(); err != nil {
							t.Error(err)
						}
						touched = append(touched, "raw ZADD "+tk.ID)
					}
					switch rng.IntN(3) {
					case 1:
						errs[i] = errors.New("boom")
					case 2:
						errs[i] = Later(errors.New("not yet"))
					}
				}
				return errs
			}})
			what += fmt.Sprint(" ", touched)
		}
		check(step, what)
	}
}

// A stream queue: put, forward, a group reads, acknowledges or leaves
// entries idle past ack_timeout with their deliveries used up, the sweep
// dead-letters them, and requeue, purge and delete run in between. No
// payload is orphaned or missing after any step.
func TestAdvComboStreamWorkload(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			comboStreamRun(t, seed+uint64(round), 250)
		})
	}
}

func comboStreamRun(t *testing.T, seed uint64, steps int) {
	e := newRedisEnv(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 17))
	k := e.Keys
	cfg := Config{MaxAttempts: 2, BatchSize: 100, Forward: &Forward{Kind: "stream", Queue: "s", MaxLen: 1000, AckTimeout: time.Minute}}
	sweeper := e.consumer(cfg)
	if err := e.RDB.XGroupCreateMkStream(ctx, k.Stream, "g", "0").Err(); err != nil {
		t.Fatal(err)
	}
	ids := []string{"a", "b", "c", "d"}
	buried := 0
	defer func() { t.Logf("%d entries dead-lettered by the sweep", buried) }()
	check := func(step int, what string) {
		t.Helper()
		q := e.RDB.ZRange(ctx, k.Queue, 0, -1).Val()
		dead := e.RDB.ZRange(ctx, k.Dead, 0, -1).Val()
		pay := e.RDB.HKeys(ctx, k.Payload).Val()
		has := map[string]bool{}
		for _, p := range pay {
			has[p] = true
		}
		owner := map[string]bool{}
		for _, l := range [][]string{q, dead} {
			for _, s := range l {
				owner[s] = true
				if !has[s] {
					t.Fatalf("seed %d step %d (%s): %s has no payload; queue %v dead %v payload %v", seed, step, what, s, q, dead, pay)
				}
			}
		}
		for _, p := range pay {
			if !owner[p] {
				t.Fatalf("seed %d step %d (%s): payload of %s orphaned; queue %v dead %v", seed, step, what, p, q, dead)
			}
		}
	}
	for step := range steps {
		id := ids[rng.IntN(len(ids))]
		var what string
		switch rng.IntN(8) {
		case 0, 1:
			what = "put " + id
			if _, _, err := e.cl.PutTask(ctx, id, json.RawMessage(fmt.Sprintf(`{"s":%d}`, step)), e.RedisNow().Add(-time.Second), client.Create); err != nil {
				t.Fatal(err)
			}
		case 2:
			what = "forward"
			e.forwardOnce(cfg)
		case 3:
			what = "read"
			if err := e.RDB.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "c", Streams: []string{k.Stream, ">"}, Count: 1, Block: -1}).Err(); err != nil && !errors.Is(err, redis.Nil) {
				t.Fatal(err)
			}
		case 4: // ack one pending entry, or let one use up its deliveries
			p, err := e.RDB.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: k.Stream, Group: "g", Start: "-", End: "+", Count: 1}).Result()
			if err != nil || len(p) == 0 {
				break
			}
			if rng.IntN(2) == 0 {
				what = "ack " + p[0].ID
				e.RDB.XAck(ctx, k.Stream, "g", p[0].ID)
			} else {
				what = "exhaust " + p[0].ID
				if err := e.RDB.Do(ctx, "XCLAIM", k.Stream, "g", "c", 0, p[0].ID, "IDLE", 2*time.Minute.Milliseconds(), "RETRYCOUNT", 5).Err(); err != nil {
					t.Fatal(err)
				}
				sw, err := sweeper.sweepStreamOnce(ctx)
				if err != nil {
					t.Fatal(err)
				}
				buried += sw.DeadLettered
			}
		case 5:
			what = "requeue " + id
			if _, err := e.st.RequeueTasks(ctx, []string{id}); err != nil {
				t.Fatal(err)
			}
		case 6:
			what = "purge"
			if rng.IntN(2) == 0 {
				if _, err := e.st.PurgeTasks(ctx, []string{id}); err != nil {
					t.Fatal(err)
				}
			} else if _, err := e.st.PurgeDead(ctx, 0, 1); err != nil {
				t.Fatal(err)
			}
		case 7:
			what = "delete " + id
			if _, err := e.cl.DeleteTasks(ctx, id); err != nil {
				t.Fatal(err)
			}
		}
		check(step, what)
	}
}
