package orders_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// sessionExec runs q (no parameters: the simple protocol, several
// statements allowed) on conn itself.
func sessionExec(ctx context.Context, conn driver.Conn, q string) error {
	_, err := conn.(driver.ExecerContext).ExecContext(ctx, q, nil)
	return err
}

// preparedName is the name lib/pq gave q on conn when it last prepared it
// (pg_prepared_statements): the session also keeps the copies a reset
// dropped, unused; lib/pq numbers a connection's statements 1, 2, ….
func preparedName(ctx context.Context, conn driver.Conn, q string) (string, error) {
	rows, err := conn.(driver.QueryerContext).QueryContext(ctx,
		`SELECT name FROM pg_prepared_statements WHERE name ~ '^[0-9]+$' AND statement = `+pq.QuoteLiteral(q)+
			` ORDER BY name::bigint DESC LIMIT 1`, nil)
	if err != nil {
		return "", err
	}
	defer rows.Close()
	v := make([]driver.Value, 1)
	if err := rows.Next(v); err != nil {
		if errors.Is(err, io.EOF) {
			return "", fmt.Errorf("%.40q is not prepared on this session", q)
		}
		return "", err
	}
	switch n := v[0].(type) {
	case string:
		return n, nil
	case []byte:
		return string(n), nil
	}
	return "", fmt.Errorf("prepared statement name %T", v[0])
}

// A lookup whose prepared statement goes bad on every run — the table
// altered between each Parse and its Bind (0A000, a stale plan), the
// session losing it (26000), another client's statement under its name
// (22P02 from the Bind: suspect, probed once unprepared) — runs at most
// once plus maxCures (2) cures plus one probe: four runs, never more, and
// then returns the last error (transient: the consumer backs off without
// spending an attempt); a run that gets through after its cures returns
// the rows as the table has them. Every case starts with the lookup's
// statement prepared and then made stale (its first run fails); the
// faults list what happens right after each later Parse of the lookup.
// After an error the next Lookup, without faults, answers right: the
// store recovers.
func TestLookupRunsAtMostOncePlusItsCuresAndAProbe(t *testing.T) {
	t.Parallel()
	const (
		stale = "stale" // another session alters the column the lookup returns
		lost  = "lost"  // the session deallocates it
		mixed = "mixed" // another client's statement, of other parameter types, under its name
	)
	lookup := orders.ShapeLookup(orders.DefaultLookupSQL)
	for _, c := range []struct {
		faults     []string
		prepared   int    // runs of the prepared lookup
		unprepared int    // runs sent unprepared (after a fallback or as the probe)
		err        string // the SQLSTATE Lookup returns, "" for the rows
	}{
		{[]string{stale, stale}, 3, 0, "0A000"},
		{[]string{stale, lost}, 3, 0, "26000"},
		{[]string{stale, mixed}, 3, 1, ""}, // the probe runs unprepared and gets through: fallen back
		{[]string{stale}, 3, 0, ""},
		{[]string{lost}, 2, 1, ""},
		{[]string{mixed}, 2, 1, ""},
		{nil, 2, 0, ""},
	} {
		t.Run(fmt.Sprint(c.faults), func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			direct, dsn := testenv.Postgres(t)
			db, h := testenv.CountingPool(t, dsn, 1)
			insert(t, direct,
				order{"lk-pending", "pending", -time.Hour},
				order{"lk-paid", "paid", -time.Hour},
				order{"lk-closed", "closed", -time.Hour})
			serials := []string{"lk-closed", "lk-missing", "lk-paid", "lk-pending"}
			want := []orders.Found{{Serial: "lk-closed"}, {Serial: "lk-paid"}, {Serial: "lk-pending", Pending: true}}
			s := orders.NewStore(db, orders.Statements{})
			if found, err := s.Lookup(ctx, serials); err != nil || fmt.Sprint(sortedFound(found)) != fmt.Sprint(want) {
				t.Fatalf("warm-up Lookup = %+v, %v; want %+v", found, err, want)
			}
			types := []string{"text", "varchar(128)"} // the first flip takes it off text
			flips := 0
			flip := func() error {
				flips++
				_, err := direct.ExecContext(ctx, `ALTER TABLE orders ALTER COLUMN serial_no TYPE `+types[flips%2])
				return err
			}
			if err := flip(); err != nil { // the warm-up's statement is stale now
				t.Fatal(err)
			}
			var hookErr error
			next := 0
			h.AfterPrepare(func(ctx context.Context, conn driver.Conn, q string) {
				if q != lookup || next >= len(c.faults) {
					return
				}
				f := c.faults[next]
				next++
				var err error
				switch f {
				case stale:
					err = flip()
				case lost, mixed:
					var name string
					if name, err = preparedName(ctx, conn, q); err != nil {
						break
					}
					impostor := ""
					if f == mixed {
						impostor = fmt.Sprintf(`; PREPARE %s(int8, int8) AS SELECT $1 + $2`, pq.QuoteIdentifier(name))
					}
					err = sessionExec(ctx, conn, `DEALLOCATE `+pq.QuoteIdentifier(name)+impostor)
				}
				if err != nil && hookErr == nil {
					hookErr = fmt.Errorf("fault %d (%s): %w", next, f, err)
				}
			})
			runs0 := h.Ran(lookup)
			plain0 := h.Ran(orders.DefaultLookupSQL)
			found, err := s.Lookup(ctx, serials)
			h.AfterPrepare(nil)
			if hookErr != nil {
				t.Fatal(hookErr)
			}
			if next != len(c.faults) {
				t.Fatalf("%d of the %d faults happened: the lookup was prepared only %d times", next, len(c.faults), next)
			}
			runs := h.Ran(lookup)
			plain := h.Ran(orders.DefaultLookupSQL)
			if runs-runs0 != c.prepared || plain-plain0 != c.unprepared {
				t.Errorf("Lookup ran %d times prepared and %d unprepared, want %d and %d (at most 1 + maxCures + 1 probe = 4 in all)",
					runs-runs0, plain-plain0, c.prepared, c.unprepared)
			}
			if c.err == "" {
				if err != nil || fmt.Sprint(sortedFound(found)) != fmt.Sprint(want) {
					t.Errorf("Lookup = %+v, %v; want %+v", found, err, want)
				}
			} else {
				var pqErr *pq.Error
				if !errors.As(err, &pqErr) || string(pqErr.Code) != c.err || !orders.Transient(err) || found != nil {
					t.Errorf("Lookup = %+v, %v (transient %v); want nothing and a transient %s once its cures ran out",
						found, err, orders.Transient(err), c.err)
				}
			}
			// No faults now: the store answers, whatever its last call met.
			if found, err := s.Lookup(ctx, serials); err != nil || fmt.Sprint(sortedFound(found)) != fmt.Sprint(want) {
				t.Errorf("Lookup without faults afterwards = %+v, %v; want %+v", found, err, want)
			}
		})
	}
}
