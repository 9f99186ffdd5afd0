package orders_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestCheckoutCreatePayCount: the demo checkout's three statements; a
// second payment of the same order changes nothing.
func TestCheckoutCreatePayCount(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := context.Background()
	for i := range 3 {
		if err := orders.Create(ctx, db, fmt.Sprintf("co-%d", i), time.Now().Add(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	if err := orders.Create(ctx, db, "co-0", time.Now()); err == nil {
		t.Error("a second order with the same serial was created")
	}
	for i, want := range []bool{true, false} {
		if paid, err := orders.Pay(ctx, db, "co-1"); err != nil || paid != want {
			t.Errorf("payment %d: %v %v, want %v", i+1, paid, err, want)
		}
	}
	got, err := orders.CountByStatus(ctx, db, "co-")
	if err != nil {
		t.Fatal(err)
	}
	if want := []orders.StatusCount{{"paid", 1}, {"pending", 2}}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("counts %v, want %v", got, want)
	}
}

// TestEnsureDatabaseTwice: the second call finds the database there.
func TestEnsureDatabaseTwice(t *testing.T) {
	t.Parallel()
	name := "od_ensure_" + testenv.Name(t)
	admin, _ := testenv.Postgres(t)
	t.Cleanup(func() { admin.Exec("DROP DATABASE IF EXISTS " + name) })
	for range 2 {
		if err := orders.EnsureDatabase(context.Background(), testenv.AdminURL(), name); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := admin.Get(&n, "SELECT count(*) FROM pg_database WHERE datname = $1", name); err != nil || n != 1 {
		t.Fatalf("%d databases named %s (%v), want 1", n, name, err)
	}
}
