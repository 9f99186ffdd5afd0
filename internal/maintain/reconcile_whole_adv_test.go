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
	killOnClose(t, e, poison)
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
	pageMatesClosed(t, e, poison, before, after, behind, passes, errs, "an order whose close ends the session")
}
