package orders_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The close's context ends around its fence: inside it (the answer comes
// after the deadline), just after it answered in time (between the close's
// check and Tx.Commit, where database/sql's own check or its rollback on
// ctx.Done wins), or while the COMMIT is on the wire (lib/pq's watchCancel
// fires). Whatever the interleaving, what the close reports must match
// what the database holds, so that the consumer neither removes an order
// that did not close nor hands back, as not closed, one that did:
//
//   - nil: every order closed, with one outbox event each;
//   - a FenceError (nothing committed): every order pending, no event, none
//     in doubt, and the error carries the context's;
//   - an InDoubtError: all closed with their events, or none;
//   - any other error: nothing committed, and the error is the context's or
//     Transient (never taken for the orders' fault: split, dead-lettered).
//
// A second close then settles what the first did: it closes exactly what
// the first did not commit, so each order closes once and has one event.
// Every store path (one statement, close statement with its txid query,
// custom close) with and without the outbox; the context ended by
// cancellation (shutdown) or by its deadline. Randomised: the seed is
// printed.
func TestAdvContextEndingAroundTheFenceNeverMisreportsTheCommit(t *testing.T) {
	t.Parallel()
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	stores := []struct {
		name  string
		stmts orders.Statements
	}{
		{"one statement", orders.Statements{}},
		{"close statement", orders.Statements{Lookup: orders.DefaultLookupSQL + " "}},
		{"custom close", orders.Statements{Close: orders.DefaultCloseSQL + " "}},
	}
	const rounds = 30
	for i, st := range stores {
		for _, outbox := range []bool{false, true} {
			for _, deadline := range []bool{false, true} {
				name := fmt.Sprintf("%s, outbox %v, deadline %v", st.name, outbox, deadline)
				rng := rand.New(rand.NewPCG(uint64(seed), uint64(i*4+btoi(outbox)*2+btoi(deadline))))
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					db, _ := testenv.Postgres(t)
					db.SetMaxOpenConns(2)
					db.SetMaxIdleConns(2)
					s := orders.NewStore(db, st.stmts)
					s.SetCommitStatusWait(10 * time.Second)
					settle := s.Settle
					if outbox {
						settle = orders.WithOutbox{Store: s}.Settle
					}
					outcomes := map[string]int{}
					toFence := 2 * time.Millisecond // learnt: how long a close takes to reach its fence
					for r := range rounds {
						serials := pendingOrders(t, db, fmt.Sprintf("r%02d", r), 3)
						// The context ends inside the fence (a quarter of the
						// cancelled rounds) or 0-120 µs after it answered; by
						// deadline, around when the last round's close reached it.
						jitter := time.Duration(rng.IntN(120)) * time.Microsecond
						inside := !deadline && rng.IntN(4) == 0 // cancelled before the fence answers
						var ctx context.Context
						var cancel context.CancelFunc
						start := time.Now()
						if deadline {
							ctx, cancel = context.WithDeadline(ctxT(t), start.Add(toFence-30*time.Microsecond+jitter))
						} else {
							ctx, cancel = context.WithCancel(ctxT(t))
						}
						var timer *time.Timer
						fenced := false
						out, err := settle(ctx, serials, func(context.Context, []string) ([]string, error) {
							fenced = true
							toFence = (toFence + time.Since(start)) / 2
							switch {
							case inside:
								cancel()
							case !deadline:
								timer = time.AfterFunc(jitter, cancel)
							}
							return nil, nil
						})
						if timer != nil {
							timer.Stop()
						}
						cancel()
						pending, events := closeState(t, db, serials)
						kind := reported(t, err, out, serials, pending, events, outbox)
						if !fenced {
							kind = "ended before the fence"
							toFence += 100 * time.Microsecond
						}
						if outcomes[kind]++; outcomes[kind] == 1 && err != nil {
							t.Logf("first %s: %v", kind, err)
						}
						// The retry the consumer makes of what was not
						// reported closed (a second close of those).
						if err != nil {
							out2, err2 := settle(ctxT(t), serials, nil)
							if err2 != nil {
								t.Fatalf("round %d: the second close: %v", r, err2)
							}
							if len(out2.Closed) != pending {
								t.Errorf("round %d: the second close closed %d, want the %d the first left pending", r, len(out2.Closed), pending)
							}
						}
						if p, ev := closeState(t, db, serials); p != 0 || (outbox && ev != len(serials)) {
							t.Errorf("round %d: after the second close %d pending, %d events; want 0 and %d", r, p, ev, len(serials)*btoi(outbox))
						}
					}
					t.Logf("outcomes: %v", outcomes)
				})
			}
		}
	}
}

// reported checks Settle's report (err, out) against the database (pending
// orders among serials, outbox events for them) and names the outcome.
func reported(t *testing.T, err error, out orders.Outcome, serials []string, pending, events int, outbox bool) string {
	t.Helper()
	n := len(serials)
	wantEvents := func(closed int) int {
		if outbox {
			return closed
		}
		return 0
	}
	var fe *orders.FenceError
	switch {
	case err == nil:
		if pending != 0 || len(out.Closed) != n || events != wantEvents(n) {
			t.Errorf("Settle reported %d closed, nil error; the database holds %d pending, %d events", len(out.Closed), pending, events)
		}
		return "committed"
	case orders.InDoubt(err) > 0:
		if (pending != 0 && pending != n) || events != wantEvents(n-pending) {
			t.Errorf("in doubt (%v): %d pending, %d events; want all or none closed, one event each", err, pending, events)
		}
		return "in doubt"
	case errors.As(err, &fe):
		if pending != n || events != 0 {
			t.Errorf("FenceError (%v): %d of %d pending, %d events; nothing may have committed", err, pending, n, events)
		}
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("FenceError %v does not carry the context's error", err)
		}
		return "fence error"
	default:
		if pending != n || events != 0 {
			t.Errorf("error %v (%T) with %d of %d pending, %d events; an error that is no InDoubtError says nothing committed", err, err, pending, n, events)
		}
		if !orders.Transient(err) {
			t.Errorf("error %v (%T) after the context ended is not Transient: taken for the orders' fault", err, err)
		}
		return "other error"
	}
}

// closeState counts the pending orders among serials and the outbox events
// recorded for them.
func closeState(t *testing.T, db interface {
	GetContext(ctx context.Context, dest any, query string, args ...any) error
}, serials []string) (pending, events int) {
	t.Helper()
	if err := db.GetContext(ctxT(t), &pending, `SELECT count(*) FROM orders WHERE status = 'pending' AND serial_no = ANY($1)`,
		orders.TextArrayForTest(serials)); err != nil {
		t.Fatal(err)
	}
	if err := db.GetContext(ctxT(t), &events, `SELECT count(*) FROM `+orders.OutboxTable+` WHERE serial_no = ANY($1)`,
		orders.TextArrayForTest(serials)); err != nil {
		t.Fatal(err)
	}
	return pending, events
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// The fence answers in time and the COMMIT goes out, but its answer is
// held (the proxy stalls) while the server commits; the close's context
// then ends (lib/pq's watchCancel fires during the COMMIT) and the
// connection is cut, losing the answer. The close's check of the context
// after its fence must not have turned this into "nothing committed": the
// COMMIT was sent, so the server is asked (txid_status) and the close
// reports the orders closed, though its context ended.
func TestAdvLostCommitAnswerAfterTheContextEndedIsAskedAbout(t *testing.T) {
	t.Parallel()
	for _, path := range closePaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			db, viaProxy, _, px := testenv.PostgresViaProxy(t)
			insert(t, db, order{"a", "pending", -time.Hour}, order{"b", "pending", -time.Hour})
			s := orders.NewStore(viaProxy, orders.Statements{})
			ctx, cancel := context.WithCancel(ctxT(t))
			defer cancel()
			cut := make(chan struct{})
			got, err := path.close(ctx, s, []string{"a", "b"}, func(context.Context, []string) ([]string, error) {
				px.Stall(30 * time.Second)
				go func() {
					defer close(cut)
					// Once the server has committed: the context ends,
					// then the cut loses the held answer, and the stall's
					// end lets the store's question through.
					defer func() { px.Down(); px.Stall(0); px.Up() }()
					for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
						var st string
						if db.Get(&st, "SELECT status FROM orders WHERE serial_no = 'a'") == nil && st == "closed" {
							cancel()
							return
						}
					}
				}()
				return nil, nil
			})
			<-cut
			if st := status(t, db, "a"); st != "closed" {
				t.Fatalf("the server did not commit (%s): the test proved nothing", st)
			}
			if ctx.Err() == nil {
				t.Fatal("the context did not end during the COMMIT: the test proved nothing")
			}
			var fe *orders.FenceError
			if errors.As(err, &fe) {
				t.Fatalf("close = %v: a FenceError (nothing committed) for a COMMIT that landed", err)
			}
			if err != nil || !slices.Equal(sorted(got), []string{"a", "b"}) {
				t.Fatalf("close = %v, %v; want [a b]: the commit landed, only its answer was lost", got, err)
			}
		})
	}
}
