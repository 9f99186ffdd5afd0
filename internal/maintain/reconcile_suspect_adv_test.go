package maintain

import (
	"context"
	"testing"
	"time"

	"github.com/lib/pq"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// Adversarial tests of 1dc9b0a (closeSuspect: a page tried again probes
// each half under orderdelay_reconcile_probe before isolating).

// Invariant "a row that fails alone does not hold back the lost orders of
// its page" (README: a poisonous order is skipped, the others close). A
// shop's trigger refuses the close of a frozen merchant's orders with
// 25006 (read_only_sql_transaction, taken for the database's). Two such
// orders on one page land, at some split, in different halves: both
// halves fail with 25006, which closeSuspect reads as the database's, and
// the page fails — every pass it comes round, for ever. Its six good lost
// orders are never closed by the safety net. At e830b14 the second pass
// isolated the two and closed the six.
func TestAdvSuspectTwoRowsAlikeStallTheirPage(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.Orders("lost", 8, time.Now().Add(-time.Hour))
	frozen := []string{lost[1], lost[6]}
	e.CloseTrigger("frozen_merchant", "NEW.serial_no = ANY('{"+frozen[0]+","+frozen[1]+"}')",
		`RAISE EXCEPTION 'merchant frozen: order % is read-only', NEW.serial_no USING ERRCODE = '25006'`)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 20},
		e.RDB, e.Store, e.m, zap.NewNop())
	var errs []error
	for range 6 {
		_, err := r.RunOnce(ctx)
		errs = append(errs, err)
	}
	t.Logf("six passes: %v", errs)
	for _, s := range frozen {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("the frozen order %s is %s: the test proved nothing", s, st)
		}
	}
	var stalled []string
	for _, s := range lost {
		if s != frozen[0] && s != frozen[1] && e.Status(s) != "closed" {
			stalled = append(stalled, s)
		}
	}
	if len(stalled) > 0 {
		t.Errorf("after six passes, %d good lost orders of a page with two rows refused alike (25006) are still pending: %v "+
			"(both halves of the page tried again fail with the same code, read as the database's)", len(stalled), stalled)
	}
}

// Invariant "a row failing on its own is reported once per pass" (the
// goal of 1dc9b0a: a pass reports no order as failing more often than it
// fails). A probe (suspect off) isolates a refused order (23514 from an
// AFTER trigger: Warn, errors_total +1), then its sibling row fails with
// 25006 (a deferred constraint trigger, at SET CONSTRAINTS IMMEDIATE): the
// probe fails and is rolled back, and the half is isolated again in
// suspect mode, reporting the refused order a second time. The other half
// fails with 53100 (a BEFORE trigger), so the codes differ and the page is
// isolated.
func TestAdvSuspectRolledBackProbeReportsARowTwice(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	base := time.Now().Add(-time.Hour)
	refused := e.Orders("b", 1, base)[0]
	readOnly := e.Orders("a", 1, base.Add(time.Minute))[0]
	full := e.Orders("c", 1, base.Add(2*time.Minute))[0]
	good := e.Orders("d", 1, base.Add(3*time.Minute))[0]
	_, err := e.DB.Exec(`
CREATE FUNCTION refuse_b() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + refused + `' THEN
    RAISE EXCEPTION 'shop check: % may not close', NEW.serial_no USING ERRCODE = '23514';
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER refuse_b AFTER UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION refuse_b();
CREATE FUNCTION readonly_a() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + readOnly + `' THEN
    RAISE EXCEPTION 'order % is read-only', NEW.serial_no USING ERRCODE = '25006';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER readonly_a AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION readonly_a();`)
	if err != nil {
		t.Fatal(err)
	}
	e.CloseTrigger("full_c", "NEW.serial_no = '"+full+"'",
		`RAISE EXCEPTION 'could not extend file: No space left on device' USING ERRCODE = '53100'`)
	core, logs := observer.New(zap.WarnLevel)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 20}, e.RDB, e.Store, e.m, zap.New(core))
	if _, err := r.RunOnce(ctx); err == nil {
		t.Fatal("the first pass did not fail: the test proved nothing")
	}
	logs.TakeAll()
	before := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile))
	n, err := r.RunOnce(ctx)
	counted := testutil.ToFloat64(e.m.Errors.WithLabelValues(metrics.StageReconcile)) - before
	if err != nil || n != 1 || e.Status(good) != "closed" {
		t.Fatalf("second pass: closed %d, %v; the good order is %s", n, err, e.Status(good))
	}
	per := map[string]int{}
	for _, l := range logs.TakeAll() {
		if s, ok := l.ContextMap()["serial"].(string); ok {
			per[s]++
		}
	}
	t.Logf("warnings per serial: %v; errors_total +%v", per, counted)
	if per[readOnly] != 1 || per[full] != 1 {
		t.Fatalf("the rows failing alone were reported %v: the test proved nothing", per)
	}
	if per[refused] != 1 || counted != 3 {
		t.Errorf("the refused order %s was reported %d times in one pass (errors_total +%v for 3 failing orders): "+
			"a probe's isolation, rolled back with the probe, is reported again by the suspect split", refused, per[refused], counted)
	}
}

// Invariant "every close the page commits was fenced and has exactly one
// close event" across a suspect page whose first probe closes (kept), whose
// second fails alone and is split, with the fence re-adding an order of
// the kept probe after the first round (rollback to pageSavepoint, rerun,
// in suspect mode again).
func TestAdvSuspectFenceRerunKeepsOnlyFencedClosesWithOneEvent(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	lost := e.Orders("lost", 8, time.Now().Add(-time.Hour))
	readOnly := lost[6]
	readded := lost[1] // in the first half, whose probe closes
	e.FailClose(readOnly, "25006")
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 20, Outbox: true},
		e.RDB, e.Store, e.m, zap.NewNop())
	if _, err := r.RunOnce(ctx); err == nil {
		t.Fatal("the first pass did not fail: the test proved nothing")
	}
	rounds := 0
	var fenced [][]string
	r.afterClose = func(closed []string) {
		rounds++
		fenced = append(fenced, append([]string(nil), closed...))
		if rounds == 1 {
			e.ZAdd(e.Keys.Queue, []string{readded}, time.Now().Add(time.Hour))
		}
	}
	n, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatalf("second pass: %v", err)
	}
	if rounds != 2 {
		t.Fatalf("the page closed %d times, want 2: the test proved nothing", rounds)
	}
	last := map[string]bool{}
	for _, s := range fenced[1] {
		last[s] = true
	}
	var closedRows []string
	if err := e.DB.Select(&closedRows, `SELECT serial_no FROM orders WHERE status = 'closed' ORDER BY serial_no`); err != nil {
		t.Fatal(err)
	}
	for _, s := range closedRows {
		if !last[s] {
			t.Errorf("%s committed closed but not in the fenced round's done %v", s, fenced[1])
		}
	}
	if len(closedRows) != n || n != len(last) || n != 6 {
		t.Errorf("committed %d closes, RunOnce said %d, the fence saw %d, want 6", len(closedRows), n, len(last))
	}
	var events []string
	if err := e.DB.Select(&events, `SELECT serial_no FROM `+orders.OutboxTable+` ORDER BY serial_no`); err != nil {
		t.Fatal(err)
	}
	if len(events) != len(closedRows) {
		t.Errorf("%d close events for %d closes: %v", len(events), len(closedRows), events)
	}
	var stray int
	if err := e.DB.Get(&stray, `SELECT count(*) FROM `+orders.OutboxTable+` WHERE serial_no = ANY($1)`, pq.Array([]string{readOnly, readded})); err != nil || stray != 0 {
		t.Errorf("events for orders not closed: %d (%v)", stray, err)
	}
}

// Invariant "a page spends at most maxCostly timeouts, and one slow row is
// that row's" (closeOneByOne). On a page tried again, a probe (suspect
// off) isolates a slow row (statement timeout: costly 1), then fails on a
// sibling's 25006 and is rolled back; closeSuspect keeps the probe's
// counters and splits the half again in suspect mode, where the same slow
// row costs its timeouts a second time: costly reaches maxCostly on one
// row, and the good orders after it in its half are left for the walk.
// Page (by deadline): slow S (AFTER trigger sleeping), G1, R (deferred
// 25006), G2 | G3, X (BEFORE 53100), G4, G5.
func TestAdvSuspectRolledBackProbeSpendsASlowRowTwice(t *testing.T) {
	e := newEnv(t, orderStatements())
	e.Store.SetTimeouts(300*time.Millisecond, 50*time.Millisecond)
	ctx := context.Background()
	base := time.Now().Add(-time.Hour)
	at := func(p string, i int) string { return e.Orders(p, 1, base.Add(time.Duration(i)*time.Minute))[0] }
	slow, g1, ro, g2 := at("s", 0), at("g1", 1), at("r", 2), at("g2", 3)
	g3, full, g4, g5 := at("g3", 4), at("x", 5), at("g4", 6), at("g5", 7)
	_, err := e.DB.Exec(`CREATE SEQUENCE slow_closes;
CREATE FUNCTION slow_s() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + slow + `' THEN
    PERFORM nextval('slow_closes');
    PERFORM pg_sleep(5);
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER slow_s AFTER UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION slow_s();
CREATE FUNCTION readonly_r() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + ro + `' THEN
    RAISE EXCEPTION 'order % is read-only', NEW.serial_no USING ERRCODE = '25006';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER readonly_r AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION readonly_r();`)
	if err != nil {
		t.Fatal(err)
	}
	e.CloseTrigger("full_x", "NEW.serial_no = '"+full+"'",
		`RAISE EXCEPTION 'could not extend file: No space left on device' USING ERRCODE = '53100'`)
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 20}, e.RDB, e.Store, e.m, zap.NewNop())
	if _, err := r.RunOnce(ctx); err == nil {
		t.Fatal("the first pass did not fail: the test proved nothing")
	}
	before := seqValue(t, e, "slow_closes")
	n, err := r.RunOnce(ctx)
	spent := seqValue(t, e, "slow_closes") - before
	t.Logf("second pass: closed %d, %v; %d statements reached the slow row", n, err, spent)
	for _, s := range []string{slow, ro, full} {
		if st := e.Status(s); st != "pending" {
			t.Fatalf("%s is %s: the test proved nothing", s, st)
		}
	}
	for _, s := range []string{g3, g4, g5} {
		if st := e.Status(s); st != "closed" {
			t.Fatalf("%s is %s: the test proved nothing", s, st)
		}
	}
	var left []string
	for _, s := range []string{g1, g2} {
		if e.Status(s) != "closed" {
			left = append(left, s)
		}
	}
	if len(left) > 0 {
		t.Errorf("good orders %v beside one slow row were left by the pass (%d statements timed out on that one row): "+
			"the rolled-back probe's timeout was counted, then spent again", left, spent)
	}
}
