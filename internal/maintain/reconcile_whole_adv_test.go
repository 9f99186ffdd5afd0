package maintain

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// Adversarial review (advwhole) of everything since 5ead5a7.

// Invariants "poison never blocks" and "nothing lost", reconciler, for a
// poisonous order whose close ends the session rather than raising an
// error the server answers (a shop's trigger or extension that crashes its
// backend; an OOM kill of that backend): orders.Answered is false, so the
// page tried again (suspect) is not isolated, and failed() passes the page
// by whole. TestReconcilerWalkPassesByAPageThatFailsEveryPass tries this
// with PageSize 1, where the page holds the poison alone. With page mates
// — the lost orders next to it by deadline, up to PageSize-1 (499 by
// default) — the walk comes round to the same page, which fails twice and
// is passed by again: its lost page mates are never closed.
func TestAdvWholeSessionEndingPoisonPageMatesAreClosed(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	before := e.Orders("a", 2, time.Now().Add(-3*time.Hour))
	poison := e.Orders("p", 1, time.Now().Add(-2*time.Hour))[0]
	after := e.Orders("q", 1, time.Now().Add(-2*time.Hour))
	behind := e.Orders("z", 2, time.Now().Add(-time.Hour))
	if _, err := e.DB.Exec(`CREATE FUNCTION kill_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + poison + `' THEN
    PERFORM pg_terminate_backend(pg_backend_pid());
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER kill_close BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION kill_close();`); err != nil {
		t.Fatal(err)
	}
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 4},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
	const passes = 12 // the walk comes round four times at least
	var errs []string
	for range passes {
		if _, err := r.RunOnce(ctx); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) == 0 {
		t.Fatal("no pass failed: the poisonous order's close never ended its session, the test proved nothing")
	}
	if st := e.Status(poison); st != "pending" {
		t.Fatalf("the poisonous order is %s, want pending", st)
	}
	for _, s := range behind {
		if st := e.Status(s); st != "closed" {
			t.Errorf("%s (on the page behind the poisonous one) is %s", s, st)
		}
	}
	var pending []string
	for _, s := range append(before, after...) {
		if e.Status(s) != "closed" {
			pending = append(pending, s)
		}
	}
	if len(pending) > 0 {
		t.Fatalf("after %d passes the lost orders %v, on the page of an order whose close ends the session, are still pending: "+
			"the page is passed by whole every time the walk comes round (%d failed passes, last: %s)",
			passes, pending, len(errs), errs[len(errs)-1])
	}
}
