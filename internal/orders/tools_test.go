package orders_test

import (
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestExtendPendingMovesOnlyPendingRows: admin's extend moves the deadline
// of the pending orders it names, by whole milliseconds, and counts them;
// paid and closed orders, orders not named and serials without a row stay.
func TestExtendPendingMovesOnlyPendingRows(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db,
		order{"x-p1", "pending", -time.Minute},
		order{"x-p2", "pending", time.Hour},
		order{"x-paid", "paid", -time.Minute},
		order{"x-closed", "closed", -time.Minute},
		order{"x-other", "pending", -time.Minute},
	)
	before := expiries(t, db)
	n, err := orders.ExtendPending(ctx, db, []string{"x-p1", "x-p2", "x-paid", "x-closed", "x-missing"}, 90*time.Second+700*time.Microsecond)
	if err != nil || n != 2 {
		t.Fatalf("ExtendPending = %d, %v; want 2 rows", n, err)
	}
	after := expiries(t, db)
	for serial, want := range map[string]time.Duration{"x-p1": 90 * time.Second, "x-p2": 90 * time.Second,
		"x-paid": 0, "x-closed": 0, "x-other": 0} {
		if got := after[serial].Sub(before[serial]); got != want {
			t.Errorf("%s moved by %s, want %s", serial, got, want)
		}
	}
	if n, err := orders.ExtendPending(ctx, db, nil, time.Minute); err != nil || n != 0 {
		t.Errorf("ExtendPending of no serials = %d, %v; want 0", n, err)
	}
}

func expiries(t *testing.T, db interface {
	Select(dest any, query string, args ...any) error
}) map[string]time.Time {
	t.Helper()
	var rows []orders.PendingOrder
	if err := db.Select(&rows, "SELECT serial_no, expires_at FROM orders"); err != nil {
		t.Fatal(err)
	}
	out := map[string]time.Time{}
	for _, r := range rows {
		out[r.Serial] = r.ExpiresAt
	}
	return out
}

// TestPendingPageWalksPendingOrdersBySerial: admin's resync pages through
// every pending order once, in serial order, skipping settled ones, and an
// empty page ends the walk.
func TestPendingPageWalksPendingOrdersBySerial(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	var want []string
	for i := range 7 {
		s := fmt.Sprintf("r-%02d", i)
		st := "pending"
		if i == 2 || i == 5 {
			st = []string{"paid", "closed"}[i/5]
		} else {
			want = append(want, s)
		}
		insert(t, db, order{s, st, time.Duration(i) * time.Minute})
	}
	var got []string
	after, pages := "", 0
	for {
		page, err := orders.PendingPage(ctx, db, after, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			break
		}
		if len(page) > 2 {
			t.Fatalf("page of %d, limit 2", len(page))
		}
		pages++
		for _, o := range page {
			got = append(got, o.Serial)
			if o.ExpiresAt.IsZero() {
				t.Errorf("%s: no deadline", o.Serial)
			}
		}
		after = page[len(page)-1].Serial
	}
	if fmt.Sprint(got) != fmt.Sprint(want) || pages != 3 {
		t.Errorf("walked %v in %d pages, want %v in 3", got, pages, want)
	}
}

// TestGetRowReadsTheRowOrSaysThereIsNone: the order report's row, with
// its nullable columns; sql.ErrNoRows for a serial without a row.
func TestGetRowReadsTheRowOrSaysThereIsNone(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db, order{"g-pending", "pending", time.Hour}, order{"g-paid", "paid", -time.Minute})
	if _, err := db.Exec(`UPDATE orders SET status = 'closed', closed_at = now(), close_reason = 'timeout', closed_by = 'test'
		WHERE serial_no = 'g-pending'`); err != nil {
		t.Fatal(err)
	}
	row, err := orders.GetRow(ctx, db, "g-pending")
	if err != nil {
		t.Fatal(err)
	}
	if row.Status != "closed" || row.ClosedAt == nil || row.CloseReason == nil || *row.CloseReason != "timeout" ||
		row.ClosedBy == nil || *row.ClosedBy != "test" || row.PaidAt != nil || row.ExpiresAt.IsZero() || row.CreatedAt.IsZero() {
		t.Errorf("closed row: %+v", row)
	}
	row, err = orders.GetRow(ctx, db, "g-paid")
	if err != nil || row.Status != "paid" || row.PaidAt == nil || row.ClosedAt != nil || row.CloseReason != nil || row.ClosedBy != nil {
		t.Errorf("paid row: %+v, %v", row, err)
	}
	if _, err := orders.GetRow(ctx, db, "g-missing"); !errors.Is(err, sql.ErrNoRows) {
		t.Errorf("missing row: %v, want sql.ErrNoRows", err)
	}
}
