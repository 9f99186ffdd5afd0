package maintain

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// Adversarial tests of the reconciler's resumed walk (099ef4a): a pass
// that fails on a page leaves the next pass to start at that page.

// refuseAtCommit makes the COMMIT of any close of an order matching when
// fail with a shop's error: a constraint trigger, deferred, as a shop
// checks its invariants at the end of a transaction. The close statement
// itself succeeds, so the page's isolation (closeIsolating) never sees the
// error; the page's COMMIT is refused, every time.
func (e *env) refuseAtCommit(when string) {
	e.T.Helper()
	_, err := e.DB.Exec(`CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND (` + when + `) THEN
    RAISE EXCEPTION 'shop trigger: order % cannot be closed', NEW.serial_no USING ERRCODE = 'P0001';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION refuse_at_commit();`)
	if err != nil {
		e.T.Fatal(err)
	}
}

// Invariant "nothing lost", with the resumed walk: a page that fails the
// same way every pass (an order whose close fails in a way the page does
// not isolate: its COMMIT refused by a shop's deferred trigger, or a
// row's close raising an error taken for the database's, as in
// TestReconcilerStopsThePassOnATransientError) keeps the walk at that
// page for good: every pass starts there and fails there. Before 099ef4a
// every pass started at the beginning, so an order lost ahead of that page
// was still closed by the next pass; now an order that becomes lost ahead
// of where the walk stopped (a checkout that commits an old order late and
// dies before its ZADD, an order Redis loses) is never closed.
func TestAdvReconcilerPageFailingEveryPassDoesNotPinTheWalk(t *testing.T) {
	for _, tc := range []struct {
		name   string
		poison func(e *env, serial string)
	}{
		{"refused at commit", func(e *env, s string) { e.refuseAtCommit("NEW.serial_no = '" + s + "'") }},
		{"a row's close raising 25006", func(e *env, s string) { e.FailClose(s, "25006") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, orderStatements())
			ctx := context.Background()
			const pageSize = 2
			// The first page: overdue orders still queued (their deadlines
			// extended in Redis only); the second: the poisonous one.
			queued := e.Orders("queued", pageSize, time.Now().Add(-4*time.Hour))
			e.Enqueue(queued, e.RedisNow().Add(24*time.Hour))
			poison := e.Orders("poison", 1, time.Now().Add(-2*time.Hour))[0]
			tc.poison(e, poison)
			r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
				e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
			// On main the first pass fails on the poisonous order's page; a
			// page that isolates the poison passes it and leaves it pending.
			n, err := r.RunOnce(ctx)
			t.Logf("first pass: closed %d, %v", n, err)
			if st := e.Status(poison); st != "pending" {
				t.Fatalf("the poisonous order is %s: its close did not fail, the test proved nothing", st)
			}
			// A checkout commits an old order late and dies before its ZADD:
			// lost, with a deadline ahead of every row the walk has read.
			late := e.Orders("late", 1, time.Now().Add(-5*time.Hour))[0]
			const passes = 3
			var errs []error
			for range passes {
				_, err := r.RunOnce(ctx)
				errs = append(errs, err)
			}
			if st := e.Status(late); st != "closed" {
				t.Fatalf("after %d more passes the lost order %s (a deadline ahead of the poisonous page) is %s: "+
					"every pass started at the page that failed the pass before and failed there again (%v)",
					passes, late, st, errs)
			}
			for _, s := range append(queued, poison) {
				if st := e.Status(s); st != "pending" {
					t.Errorf("%s is %s, want pending (queued, or its close refused)", s, st)
				}
			}
		})
	}
}

// Invariant "poison never blocks", reconciler: an order whose close a
// shop refuses at COMMIT (a deferred constraint trigger; the fast path
// dead-letters it as close_failed, so it stays pending and overdue for
// good) fails its whole page at the COMMIT, every pass: the page's
// isolation runs around the close statement, which succeeds. Every lost
// order on that page and behind it is never closed.
func TestAdvReconcilerOrderRefusedAtCommitDoesNotBlockTheOrdersBehindIt(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	poison := e.Orders("poison", 1, time.Now().Add(-2*time.Hour))[0]
	e.refuseAtCommit("NEW.serial_no LIKE 'poison-%'")
	lost := e.Orders("lost", 5, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 4},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	const passes = 3
	var errs []error
	for range passes {
		_, err := r.RunOnce(ctx)
		errs = append(errs, err)
	}
	if st := e.Status(poison); st != "pending" {
		t.Fatalf("the poisonous order is %s: its COMMIT was not refused, the test proved nothing", st)
	}
	var pending []string
	for _, s := range lost {
		if e.Status(s) != "closed" {
			pending = append(pending, s)
		}
	}
	if len(pending) > 0 {
		t.Fatalf("after %d passes %d of %d lost orders behind an order refused at COMMIT are pending (%v): "+
			"the refusal fails the page every pass (%v)", passes, len(pending), len(lost), pending, errs)
	}
}

// Invariant "a pause means nobody is closed" (README: pause stops closing
// on every replica within one scan interval): the reconciler asks about
// the pause once, at the start of its pass, and the pass then goes on page
// after page (up to maxPagesPerRun of them, within a five-minute pass
// timeout) closing orders after an operator paused closing. Here the pause
// is set while the first page closes; the two pages after it start after
// the pause and close anyway.
func TestAdvReconcilerPagesStartedAfterAPauseCloseNothing(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.Orders("lost", 3, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 1},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	paused := false
	r.afterClose = func(closed []string) {
		if !paused && len(closed) > 0 {
			paused = true
			if err := e.RDB.Set(ctx, e.Keys.Paused, "1|PSP outage", 0).Err(); err != nil {
				t.Error(err)
			}
		}
	}
	n, err := r.RunOnce(ctx)
	if !paused {
		t.Fatalf("RunOnce = %d, %v: no page closed, the test proved nothing", n, err)
	}
	var after []string
	for _, s := range lost[1:] {
		if e.Status(s) == "closed" {
			after = append(after, s)
		}
	}
	if len(after) > 0 {
		t.Fatalf("the pass closed %v on pages it started after closing was paused (RunOnce = %d, %v)", after, n, err)
	}
}

// Invariants "nothing lost" and "never closed early", across the resume
// cursor: between two passes producers move deadlines in the table across
// where the walk stopped. A lost order moved from ahead of the cursor to
// behind it (its deadline brought forward) and one moved from behind it to
// ahead (extended, still overdue) are both closed once the walk has come
// round; a lost order ahead of the cursor whose row a producer extended
// into the future (and died before its ZADD) is not closed by any of them.
func TestAdvReconcilerDeadlinesMovedAcrossTheCursorBetweenPasses(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	r, _, lost := queuedAheadOfALostOrder(t, e, 2) // 41 queued at -2h, one lost at -1h
	if n := runPass(t, r); n != 0 {
		t.Fatalf("the first pass closed %d, want 0 (it reads 40 queued orders)", n)
	}
	if r.resume.ExpiresAt.IsZero() {
		t.Fatalf("the first pass left no place to resume from: the test proved nothing")
	}
	behind := e.Orders("behind", 1, time.Now().Add(-3*time.Hour))[0] // behind the cursor
	future := e.Orders("future", 1, time.Now().Add(-90*time.Minute))[0]
	move := func(serial string, d time.Duration) {
		t.Helper()
		if _, err := e.DB.ExecContext(ctx, `UPDATE orders SET expires_at = $2 WHERE serial_no = $1`, serial, time.Now().Add(d)); err != nil {
			t.Fatal(err)
		}
	}
	move(lost, -4*time.Hour)      // ahead of the cursor to behind it
	move(behind, -30*time.Minute) // behind it to ahead, still overdue
	move(future, time.Hour)       // ahead of it, into the future
	closed := 0
	for range 3 { // the rest and the end, then from the beginning, one to spare
		closed += runPass(t, r)
	}
	for _, s := range []string{lost, behind} {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s is %s after the walk came round (closed %d)", s, st, closed)
		}
	}
	if st := e.Status(future); st != "pending" {
		t.Errorf("%s is %s: closed before its row's deadline, an hour from now", future, st)
	}
	if closed != 2 {
		t.Errorf("the passes closed %d, want 2", closed)
	}
}

// The walk passes by a page that fails every pass, to the orders behind
// it: a lost order with a later deadline than a poisonous one whose close
// ends the session (a shop's trigger that terminates its own backend, as a
// crashing extension would: no error the server answers, so not isolated
// even when the page is tried again) is closed once the page has failed
// twice, and the poisonous one is tried again when the walk comes round.
func TestReconcilerWalkPassesByAPageThatFailsEveryPass(t *testing.T) {
	e := newEnv(t, orderStatements())
	const pageSize = 1
	poison := e.Orders("poison", 1, time.Now().Add(-3*time.Hour))[0]
	killOnClose(t, e, poison)
	lost := e.Orders("lost", 1, time.Now().Add(-time.Hour))[0]
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: pageSize},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
	var errs []error
	for range 3 { // fails, fails again and is passed by, reaches the lost order
		_, err := r.RunOnce(context.Background())
		errs = append(errs, err)
	}
	if st := e.Status(lost); st != "closed" {
		t.Fatalf("after 3 passes the lost order behind a page that fails every pass is %s (%v)", st, errs)
	}
	if st := e.Status(poison); st != "pending" {
		t.Errorf("%s is %s, want pending (its close always fails)", poison, st)
	}
	if errs[0] == nil || errs[1] == nil {
		t.Errorf("the first two passes ended %v: the poisonous page did not fail, the test proved nothing", errs[:2])
	}
}
