package orders_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A batch whose context ends at any point of its transaction — before,
// while or after a statement is prepared on the connection, between
// Tx.StmtContext and the query, while database/sql's watcher rolls the
// transaction back and closes the transaction's statements — fails with
// an error that says so (Transient), never one the consumer would take for
// this batch's data and split or bury. Randomised (seed printed), bounded.
func TestAdvPrepContextEndsAnywhereInABatch(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	const rounds = 100
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db, _ := testenv.Postgres(t)
			db.SetMaxOpenConns(3)
			db.SetMaxIdleConns(3)
			s := orders.NewStore(db, p.stmts)
			serials := pendingOrders(t, db, "ctx", 20)
			var mu sync.Mutex
			var bad []string
			var wg sync.WaitGroup
			for w := range 2 {
				delays := make([]time.Duration, rounds)
				for i := range delays {
					delays[i] = time.Duration(rng.IntN(3000)) * time.Microsecond
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i, d := range delays {
						ctx, cancel := context.WithTimeout(context.Background(), d)
						_, err := s.Settle(ctx, serials[w*10:w*10+10], nil)
						if err == nil {
							_, err = s.Lookup(ctx, serials[w*10:w*10+10])
						}
						cancel()
						if err != nil && !orders.Transient(err) {
							mu.Lock()
							bad = append(bad, fmt.Sprintf("round %d (after %v): %T %v", i, d, err, err))
							mu.Unlock()
						}
						if i%50 == 0 {
							// Pending again, so the close has work to do.
							if _, err := db.Exec(`UPDATE orders SET status = 'pending' WHERE serial_no LIKE 'ctx-%'`); err != nil {
								mu.Lock()
								bad = append(bad, err.Error())
								mu.Unlock()
								return
							}
						}
					}
				}()
			}
			wg.Wait()
			if len(bad) > 0 {
				t.Fatalf("%d errors a context's end caused that are not Transient (split or buried by the consumer), e.g.:\n%v", len(bad), bad[:min(len(bad), 5)])
			}
		})
	}
}

// Workers closing batches on a pool of several connections while a
// migration keeps changing the type of a column the statements return:
// each 0A000 makes one worker reset the statements while the others'
// transactions still use their copies (database/sql closes a connection's
// statement only when no transaction uses it). Every order closes exactly
// once, and no batch fails with an error the consumer would split or bury.
func TestAdvPrepResetWhileOtherWorkersUseTheirCopies(t *testing.T) {
	t.Parallel()
	const workers, batches, alters = 4, 30, 12
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t) // its own: a parallel subtest may wait for a slot
			db, _ := testenv.Postgres(t)
			db.SetMaxOpenConns(workers)
			db.SetMaxIdleConns(workers)
			other := otherSession(t, db)
			s := orders.NewStore(db, p.stmts)
			var mu sync.Mutex
			closed := map[string]int{}
			var bad []string
			var all [][]string
			var wg sync.WaitGroup
			done := make(chan struct{}, workers*batches)
			for w := range workers {
				var mine [][]string
				for b := range batches {
					mine = append(mine, pendingOrders(t, db, fmt.Sprintf("w%d-b%02d", w, b), 5))
				}
				all = append(all, mine...)
				wg.Add(1)
				go func() {
					defer wg.Done()
					for _, serials := range mine {
						for try := 0; ; try++ {
							out, err := s.Settle(ctx, serials, nil)
							if err == nil {
								_, err = s.Lookup(ctx, out.Unknown)
							}
							mu.Lock()
							for _, sn := range out.Closed {
								closed[sn]++
							}
							if err != nil && (!orders.Transient(err) || try > 20) {
								bad = append(bad, fmt.Sprintf("%v: %v", serials, err))
							}
							mu.Unlock()
							if err == nil || try > 20 {
								break
							}
						}
						done <- struct{}{}
					}
				}()
			}
			types := []string{"varchar(128)", "text"}
			for i := range alters {
				// Spread over the run: after every few batches.
				for range workers * batches / (alters + 1) {
					<-done
				}
				if _, err := other.ExecContext(ctx, `ALTER TABLE orders ALTER COLUMN serial_no TYPE `+types[i%2]); err != nil {
					t.Fatal(err)
				}
			}
			wg.Wait()
			if len(bad) > 0 {
				t.Fatalf("%d batches failed: %v", len(bad), bad[:min(5, len(bad))])
			}
			n := 0
			for _, b := range all {
				for _, sn := range b {
					n++
					if closed[sn] != 1 {
						t.Errorf("%s reported closed %d times, want once", sn, closed[sn])
					}
				}
			}
			var pending int
			if err := db.Get(&pending, `SELECT count(*) FROM orders WHERE status <> 'closed'`); err != nil || pending != 0 {
				t.Fatalf("%d orders not closed (%v)", pending, err)
			}
			t.Logf("%d orders closed once", n)
		})
	}
}

// A statement first prepared inside a close transaction that then rolls
// back (the fence dropped a serial, and the close runs again without it)
// stays prepared in the session: PostgreSQL does not roll prepared
// statements back, so database/sql's record of it stays true and the
// run again binds it, with no 26000 (which would turn prepared statements
// off for good) and no second Parse.
func TestAdvPrepStatementPreparedInARolledBackTransactionStays(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := oneConn(t)
	s := orders.NewStore(db, orders.Statements{})
	logs := warnings(s)
	serials := pendingOrders(t, db, "rb", 3)
	drops := 0
	out, err := s.Settle(ctx, serials, func(_ context.Context, closed []string) ([]string, error) {
		if drops++; drops == 1 {
			return closed[:1], nil
		}
		return nil, nil
	})
	if err != nil || len(out.Closed) != 2 || drops != 2 {
		t.Fatalf("Settle = %+v, %v after %d fence calls; want 2 closed, the fence asked twice", out, err, drops)
	}
	if got := preparedCounts(t, db, orders.ShapedSettleSQL); got[0] != "1/2" {
		t.Errorf("settle statement prepared/ran in the session: %s, want 1/2", got[0])
	}
	if logs.Len() != 0 {
		t.Errorf("fell back to unprepared statements: %v", logs.All())
	}
}
