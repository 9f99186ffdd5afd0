package orders_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// pendingRows inserts n pending orders due long ago and returns their
// serials.
func pendingRows(tb testing.TB, db *sqlx.DB, n int) []string {
	tb.Helper()
	ss := make([]string, n)
	for i := range ss {
		ss[i] = fmt.Sprintf("ORD-%06d", i)
	}
	if _, err := db.Exec(`INSERT INTO orders (serial_no, status, expires_at)
		SELECT s, 'pending', now() - interval '1 hour' FROM unnest($1::text[]) s`, orders.TextArrayForTest(ss)); err != nil {
		tb.Fatal(err)
	}
	return ss
}

// A row of the lookup costs what the driver allocates for it (the serial's
// string, and the interface it hands it over in) and nothing of ours: the
// values it is scanned into live once per statement. (They escape to the
// heap through Scan; declared per row they cost two allocations a row.)
func TestLookupAllocatesOnlyTheDriversTwoPerRow(t *testing.T) {
	if testenv.RaceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	db, _ := testenv.Postgres(t)
	st := orders.NewStore(db, orders.Statements{})
	ss := pendingRows(t, db, 400)
	ctx := context.Background()
	lookup := func(n int) float64 {
		return testing.AllocsPerRun(20, func() {
			found, err := st.Lookup(ctx, ss[:n])
			if err != nil || len(found) != n {
				t.Fatalf("lookup of %d: %d found, %v", n, len(found), err)
			}
		})
	}
	lookup(400) // warm the pool's connection
	small, large := lookup(100), lookup(400)
	if perRow := (large - small) / 300; perRow > 2.5 {
		t.Fatalf("lookup: %.0f allocations for 100 rows, %.0f for 400: %.2f a row, want 2", small, large, perRow)
	}
}

func BenchmarkLookup500(b *testing.B) {
	db, _ := testenv.Postgres(b)
	st := orders.NewStore(db, orders.Statements{})
	ss := pendingRows(b, db, 500)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := st.Lookup(ctx, ss); err != nil {
			b.Fatal(err)
		}
	}
}
