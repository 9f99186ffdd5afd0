package consumer

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// A custom close statement may return rows it was not asked about (one
// that also closes child orders, or trims char(n) serials); the reference
// schema's one statement refuses them. The fence of a batch closed by a
// custom statement checks every serial against its lease record
// (queue.Store.FenceBatch trusts a batch only for serials its claim
// leased), and drops one whose record is another claim's.
func TestFenceChecksASerialTheBatchDidNotClaim(t *testing.T) {
	t.Parallel()
	custom := orders.DefaultStatements()
	custom.Close = "/* custom */ " + custom.Close
	e := newEnv(t, custom)
	if e.Store.OneStatement() {
		t.Fatal("the statements are the reference schema's: the test needs a custom close")
	}
	ctx := context.Background()
	past := e.RedisNow().Add(-time.Second)
	mine := e.Orders("fbm", 2, past)
	e.Enqueue(mine, past)
	a := e.consumer(Config{Owner: "A"})
	resA, err := a.claimBatch(ctx)
	if err != nil || len(resA.items) != 2 {
		t.Fatalf("A claim: %v, %d items", err, len(resA.items))
	}
	other := e.Orders("fbo", 1, past)
	e.Enqueue(other, past)
	b := e.consumer(Config{Owner: "B"})
	resB, err := b.claimBatch(ctx)
	if err != nil || len(resB.items) != 1 {
		t.Fatalf("B claim: %v, %d items", err, len(resB.items))
	}
	fence, _ := a.fence(resA.items)
	drop, err := fence(ctx, []string{mine[0], other[0]})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(drop, other) {
		t.Errorf("A's fence of %v dropped %v, want %v: B's order is not A's to close", []string{mine[0], other[0]}, drop, other)
	}
	drop, err = fence(ctx, mine)
	if err != nil || len(drop) != 0 {
		t.Errorf("A's fence of its own %v dropped %v (%v), want none", mine, drop, err)
	}
}
