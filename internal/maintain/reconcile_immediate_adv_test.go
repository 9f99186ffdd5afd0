package maintain

import (
	"context"
	"testing"
	"time"

	"github.com/lib/pq"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// Adversarial test of c9eb009's SET CONSTRAINTS ALL IMMEDIATE.

// Invariant "nothing lost", with close events (ReconcilerConfig.Outbox):
// the page's SET CONSTRAINTS ALL IMMEDIATE makes a shop's deferred
// constraint fire at the close statement, before the page writes the
// close events (orders.RecordClosed runs after the close). A shop that
// checks at the end of a transaction that every closed order has its close
// event — the check the fast path's close satisfies, as it writes both in
// one transaction before its COMMIT — now refuses every reconciler close:
// each order is isolated as poisonous, and no lost order is ever closed.
// Passes with the statement taken out (as before c9eb009).
func TestAdvPassByImmediateConstraintsKeepTheOutboxWorking(t *testing.T) {
	e := newEnv(t, orderStatements())
	ctx := context.Background()
	_, err := e.DB.Exec(`CREATE FUNCTION closed_has_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NOT EXISTS (SELECT 1 FROM ` + orders.OutboxTable + ` WHERE serial_no = NEW.serial_no) THEN
    RAISE EXCEPTION 'shop invariant: order % closed without a close event', NEW.serial_no USING ERRCODE = 'P0001';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER closed_has_event AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION closed_has_event();`)
	if err != nil {
		t.Fatal(err)
	}
	// The fast path's close, with its event, satisfies the shop's check.
	control := e.Orders("control", 1, time.Now().Add(-time.Hour))
	if done, err := (orders.WithOutbox{Store: e.Store}).Close(ctx, control, nil); err != nil || len(done) != 1 {
		t.Fatalf("the fast path's close with its event = %v, %v: the shop's check refuses it too, the test proves nothing", done, err)
	}
	lost := e.Orders("lost", 3, time.Now().Add(-time.Hour))
	r := NewReconciler(ReconcilerConfig{Keys: e.Keys, Grace: 5 * time.Minute, PageSize: 10, Outbox: true},
		e.RDB, e.Store, e.m, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel+1)))
	n, err := r.RunOnce(ctx)
	var pending []string
	for _, s := range lost {
		if e.Status(s) != "closed" {
			pending = append(pending, s)
		}
	}
	if len(pending) > 0 {
		t.Fatalf("the reconciler with close events left %v pending (RunOnce = %d, %v): the deferred check fired "+
			"at the close statement, before the page wrote the events", pending, n, err)
	}
	var events int
	if err := e.DB.Get(&events, `SELECT count(*) FROM `+orders.OutboxTable+` WHERE serial_no = ANY($1)`, pq.Array(lost)); err != nil {
		t.Fatal(err)
	}
	if events != len(lost) {
		t.Errorf("%d close events for %d reconciled orders", events, len(lost))
	}
}
