package orders_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

func openPool(t *testing.T, dsn string, o orders.PoolOptions) *sqlx.DB {
	t.Helper()
	db, err := orders.Open(dsn, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func setting(t *testing.T, db *sqlx.DB, name string) string {
	t.Helper()
	var v string
	if err := db.Get(&v, "SELECT current_setting($1)", name); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return v
}

func TestOpenSetsServerTimeoutsOnEveryConnection(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	tests := []struct {
		o               orders.PoolOptions
		statement, lock string
	}{
		{orders.PoolOptions{MaxConns: 2, StatementTimeout: 10 * time.Second}, "10s", "2500ms"},
		{orders.PoolOptions{MaxConns: 2, StatementTimeout: 20 * time.Millisecond}, "20ms", "10ms"},  // MinLockTimeout
		{orders.PoolOptions{MaxConns: 2, StatementTimeout: 1500 * time.Microsecond}, "2ms", "10ms"}, // rounded up, never 0
		{orders.PoolOptions{MaxConns: 2, StatementTimeout: time.Second, LockTimeout: 300 * time.Millisecond}, "1s", "300ms"},
		{orders.PoolOptions{MaxConns: 2, StatementTimeout: time.Second, LockTimeout: -1}, "1s", "0"},
		{orders.PoolOptions{MaxConns: 2}, "0", "0"},
	}
	for _, tt := range tests {
		db := openPool(t, dsn, tt.o)
		// Two connections at once: both have the settings.
		ctx := ctxT(t)
		c1, err := db.Connx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		c2, err := db.Connx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i, c := range []*sqlx.Conn{c1, c2} {
			var st, lt string
			// With a timeout of 2 ms, a busy machine can cut even this
			// query: the cut proves the setting too, so ask again.
			for try := 0; ; try++ {
				err := c.QueryRowxContext(ctx, "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')").Scan(&st, &lt)
				if err == nil {
					break
				}
				if !orders.TimedOut(err) || try == 1000 {
					t.Fatal(err)
				}
			}
			if st != tt.statement || lt != tt.lock {
				t.Errorf("%+v: connection %d has statement_timeout %s, lock_timeout %s; want %s, %s", tt.o, i, st, lt, tt.statement, tt.lock)
			}
		}
		c1.Close()
		c2.Close()
		if got := db.Stats().MaxOpenConnections; got != 2 {
			t.Errorf("MaxOpenConnections %d, want 2", got)
		}
	}
}

// A DSN that sets the same keys is overridden: the order pool's timeouts
// are the daemon's contract with the consumer's deadlines.
func TestOpenOverridesTimeoutsInTheDSN(t *testing.T) {
	t.Parallel()
	_, dsn := testenv.Postgres(t)
	db := openPool(t, dsn+"&statement_timeout=0&lock_timeout=0", orders.PoolOptions{MaxConns: 1, StatementTimeout: time.Second})
	if st, lt := setting(t, db, "statement_timeout"), setting(t, db, "lock_timeout"); st != "1s" || lt != "250ms" {
		t.Errorf("statement_timeout %s, lock_timeout %s; want 1s, 250ms", st, lt)
	}
}

// TestPoolStatementTimeoutIsTheServers: a close that runs past the pool's
// statement timeout is cancelled by the server (57014, nothing committed)
// while the caller's own deadline is still far away.
func TestPoolStatementTimeoutIsTheServers(t *testing.T) {
	t.Parallel()
	admin, dsn := testenv.Postgres(t)
	insert(t, admin, order{"slow", "pending", -time.Minute})
	admin.MustExec(`CREATE FUNCTION orders_slow() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(30); RETURN NEW; END $$`)
	admin.MustExec(`CREATE TRIGGER orders_slow BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION orders_slow()`)
	db := openPool(t, dsn, orders.PoolOptions{MaxConns: 2, StatementTimeout: 300 * time.Millisecond})
	s := orders.NewStore(db, orders.Statements{})
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second) // the client's deadline: later
	defer cancel()
	for _, store := range []interface {
		Close(context.Context, []string, orders.Fence) ([]string, error)
	}{s, orders.WithOutbox{Store: s}, settleAsClose{s}, settleAsClose{orders.WithOutbox{Store: s}}} {
		_, err := store.Close(ctx, []string{"slow"}, nil)
		var pqErr *pq.Error
		if !errors.As(err, &pqErr) || pqErr.Code != "57014" || !strings.Contains(pqErr.Message, "statement timeout") {
			t.Fatalf("%T.Close past the statement timeout: %v (%T), want *pq.Error 57014 from the statement timeout", store, err, err)
		}
		if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("the client's deadline fired: %v", err)
		}
		if !orders.Transient(err) {
			t.Errorf("Transient(%v) = false", err)
		}
		if got := status(t, admin, "slow"); got != "pending" {
			t.Fatalf("status %q after the server cancelled the close, want pending", got)
		}
	}
}

// TestPoolLockTimeoutFailsFast: a close waiting on a row someone holds gets
// 55P03 after lock_timeout, not 57014 after the whole statement timeout.
func TestPoolLockTimeoutFailsFast(t *testing.T) {
	t.Parallel()
	admin, dsn := testenv.Postgres(t)
	insert(t, admin, order{"held", "pending", -time.Minute}, order{"free", "pending", -time.Minute})
	holdRow(t, admin, "held")
	// statement_timeout 4s, lock_timeout 1s: if the lock wait were cut by
	// the statement timeout the code would say 57014.
	db := openPool(t, dsn, orders.PoolOptions{MaxConns: 1, StatementTimeout: 4 * time.Second})
	s := orders.NewStore(db, orders.Statements{})
	start := time.Now()
	_, err := s.Close(ctxT(t), []string{"free", "held"}, nil)
	elapsed := time.Since(start)
	if !orders.RowLocked(err) || !orders.Transient(err) {
		t.Fatalf("close of a held row: %v (%T), want 55P03 lock_not_available", err, err)
	}
	t.Logf("55P03 after %s (lock_timeout 1s)", elapsed.Round(time.Millisecond))
	if elapsed < time.Second {
		t.Errorf("failed after %s, before lock_timeout (1s)", elapsed)
	}
	if got := status(t, admin, "free"); got != "pending" {
		t.Errorf("status of free %q, want pending (the statement failed as a whole)", got)
	}
}

// TestOpenConnectErrorIsTransient: nothing about an order stops a
// connection opening, whatever the server says (here 3D000, which would
// be permanent in a statement).
func TestOpenConnectErrorIsTransient(t *testing.T) {
	t.Parallel()
	db := openPool(t, testenv.DatabaseURL("odtest_no_such_database"), orders.PoolOptions{MaxConns: 1, StatementTimeout: time.Second})
	_, err := orders.NewStore(db, orders.Statements{}).Close(ctxT(t), []string{"a"}, nil)
	var ce *orders.ConnectError
	var pqErr *pq.Error
	if !errors.As(err, &ce) || !errors.As(err, &pqErr) || pqErr.Code != "3D000" {
		t.Fatalf("close on a missing database: %v (%T), want a *ConnectError around 3D000", err, err)
	}
	if !orders.Transient(err) {
		t.Errorf("Transient(%v) = false", err)
	}
}

// settleAsClose runs a store's Settle (the one statement) where a test
// calls Close.
type settleAsClose struct {
	s interface {
		Settle(context.Context, []string, orders.Fence) (orders.Outcome, error)
	}
}

func (a settleAsClose) Close(ctx context.Context, serials []string, fence orders.Fence) ([]string, error) {
	out, err := a.s.Settle(ctx, serials, fence)
	return out.Closed, err
}
