package maintain

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// Adversarial review (advnarrow) of 4feab47, the narrowing of a page that
// fails twice.

// killOnClose makes closing serial end its own session (the fixture of
// TestReconcilerWalkPassesByAPageThatFailsEveryPass).
func killOnClose(t *testing.T, e *env, serial string) {
	t.Helper()
	e.CloseTrigger("kill_close", "NEW.serial_no = '"+serial+"'", "PERFORM pg_terminate_backend(pg_backend_pid())")
}

// Invariant "poison never blocks" (its bound as 4feab47 states it: "down
// to the one row that fails it, which alone is passed by; then pages are
// full again. About log2(page) more passes"). failed() keeps narrow.size
// at 1 once the row is passed by, so the rest of the region — up to
// PageSize-1 rows, 499 by default — is read one row per page, at most
// maxPagesPerRun a pass: ceil((PageSize-1)/20) more passes (25 by
// default), not log2. With PageSize 64 and the session-ending poison first
// of its page: 2 failures, 6 halvings (32..1), the row passed by at pass
// 8; pass 9 with full pages closes every lost order.
func TestAdvNarrowAfterThePoisonRowPagesAreFullAgain(t *testing.T) {
	e := newEnv(t, orderStatements())
	const pageSize = 64
	poison := e.Orders("p", 1, time.Now().Add(-3*time.Hour))[0]
	mates := e.Orders("m", pageSize-1, time.Now().Add(-2*time.Hour))
	behind := e.Orders("z", 10, time.Now().Add(-time.Hour))
	killOnClose(t, e, poison)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
	const passes = 2 + 6 + 1 + 1 // + 1 of slack
	failures := 0
	for range passes {
		if _, err := r.RunOnce(context.Background()); err != nil {
			failures++
		}
	}
	if failures < 2 {
		t.Fatalf("%d passes failed: the poisonous order's close never ended its session, the test proved nothing", failures)
	}
	if st := e.Status(poison); st != "pending" {
		t.Fatalf("the poisonous order is %s, want pending", st)
	}
	var pending []string
	for _, s := range append(mates, behind...) {
		if e.Status(s) != "closed" {
			pending = append(pending, s)
		}
	}
	if len(pending) > 0 {
		t.Fatalf("after %d passes (%d failed) %d of %d lost orders around a session-ending poison are still pending (first %s): "+
			"the rest of the narrowed page is read one row per page after the poison is passed by",
			passes, failures, len(pending), len(mates)+len(behind), pending[0])
	}
}

// Invariant "poison never blocks" (its cost), for a database outage in the
// middle of a narrowing: the narrowed page fails twice before its rows are
// known, and failed() starts the walk again from the beginning — with
// narrow still set. The narrowing of the poison's page is then spent on
// the pages at the beginning of the walk, read at the narrowed size (here
// one row a page, maxPagesPerRun a pass), and the poison's page, reached
// again in full, starts its narrowing over. With a backlog of one page
// (still in Redis) ahead of the poison's page, the first pass after the
// outage should read it in one page and fail on the poison's.
func TestAdvNarrowOutageResetDoesNotCarryTheNarrowingToTheBeginning(t *testing.T) {
	e, proxy := newProxiedEnv(t)
	const pageSize = 64
	backlog := e.Orders("b", pageSize, time.Now().Add(-4*time.Hour))
	e.Enqueue(backlog, e.RedisNow().Add(24*time.Hour))
	poison := e.Orders("p", 1, time.Now().Add(-3*time.Hour))[0]
	e.Orders("m", pageSize-1, time.Now().Add(-2*time.Hour))
	killOnClose(t, e, poison)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
	ctx := context.Background()
	// Pass 1 fails on the poison's page, pass 2 too (narrowing starts),
	// passes 3..7 halve it down to one row: 32, 16, 8, 4, 2 fail.
	for i := range 7 {
		if _, err := r.RunOnce(ctx); err == nil {
			t.Fatalf("pass %d did not fail: the poison's page was not narrowed as expected, the test proves nothing", i+1)
		}
	}
	if r.narrow == nil || r.narrow.size != 1 {
		t.Fatalf("after 7 passes narrow is %+v, want size 1", r.narrow)
	}
	proxy.Down()
	for i := range 2 { // fails before its rows are known, twice: the walk starts again
		if _, err := r.RunOnce(ctx); err == nil {
			t.Fatalf("outage pass %d did not fail", i+1)
		}
	}
	proxy.Up()
	_, err := r.RunOnce(ctx)
	if err == nil {
		t.Fatalf("the first pass after the outage did not reach the poison's page behind one page of backlog (narrow now %+v): "+
			"the narrowing was carried to the beginning of the walk, whose pages are read one row each", r.narrow)
	}
}

// Invariants "nothing lost", "poison never blocks", "never paid": random
// walks (bounded, seeded) over lost orders mixed with session-ending
// poisons, poisons whose error the server answers as a transient one
// (53200, isolated only on a suspect page), orders still in Redis, and
// orders paid between passes. Every lost order that is neither poison nor
// paid must close within the passes given; none of the others may.
func TestAdvNarrowRandomRegionsCloseEveryLostOrder(t *testing.T) {
	for round := range 4 {
		seed := uint64(time.Now().UnixNano()) + uint64(round)
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, seed))
			e := newEnv(t, orderStatements())
			pageSize := 2 + rng.IntN(15)
			n := 20 + rng.IntN(100)
			base := time.Now().Add(-5 * time.Hour)
			var all []string
			for i := range n {
				all = append(all, e.Orders(fmt.Sprintf("o%03d", i), 1, base.Add(time.Duration(rng.IntN(n/3+1))*time.Minute))[0])
			}
			kind := map[string]string{}
			var killers, answered, queued []string
			for _, s := range all {
				switch x := rng.IntN(100); {
				case x < 4:
					kind[s], killers = "kill", append(killers, s)
				case x < 7:
					kind[s], answered = "answered", append(answered, s)
				case x < 15:
					kind[s], queued = "queued", append(queued, s)
				}
			}
			if len(killers) == 0 {
				s := all[rng.IntN(n)]
				kind[s], killers = "kill", append(killers, s)
			}
			quote := func(ss []string) string {
				if len(ss) == 0 {
					return "ARRAY[]::text[]"
				}
				return "ARRAY['" + strings.Join(ss, "','") + "']"
			}
			e.CloseTrigger("kill_close", "NEW.serial_no = ANY("+quote(killers)+")", "PERFORM pg_terminate_backend(pg_backend_pid())")
			e.CloseTrigger("oom_close", "NEW.serial_no = ANY("+quote(answered)+")", "RAISE EXCEPTION 'oom' USING ERRCODE = '53200'")
			if len(queued) > 0 {
				e.Enqueue(queued, e.RedisNow().Add(24*time.Hour))
			}
			t.Logf("page %d, %d orders, killers %v, answered %v, %d queued", pageSize, n, killers, answered, len(queued))
			r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
				e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
			const passes = 300
			for range passes {
				if rng.IntN(10) == 0 { // a payment between passes
					s := all[rng.IntN(n)]
					if kind[s] == "" || kind[s] == "queued" {
						res, err := e.DB.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1 AND status = 'pending'`, s)
						if err != nil {
							t.Fatal(err)
						}
						if k, _ := res.RowsAffected(); k == 1 {
							kind[s] = "paid"
						}
					}
				}
				r.RunOnce(context.Background()) //nolint:errcheck // passes fail on the poisons
			}
			for _, s := range all {
				st := e.Status(s)
				want := "closed"
				switch kind[s] {
				case "kill", "answered", "queued":
					want = "pending"
				case "paid":
					want = "paid"
				}
				if st != want {
					t.Errorf("%s (%q) is %s after %d passes, want %s (narrow %+v, resume %+v)", s, kind[s], st, passes, want, r.narrow, r.resume)
				}
			}
		})
	}
}
