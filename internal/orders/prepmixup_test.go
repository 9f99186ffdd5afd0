package orders_test

import (
	"fmt"
	"testing"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// preparedHere is a statement the store prepared in the pool's session:
// its protocol-level name (lib/pq's "1", "2", …), its text and its
// parameter types.
type preparedHere struct {
	name, statement string
	types           []string
}

func preparedInSession(t *testing.T, db *sqlx.DB) []preparedHere {
	t.Helper()
	rows, err := db.Query(`SELECT name, statement, parameter_types::text[] FROM pg_prepared_statements
		WHERE NOT from_sql ORDER BY name`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []preparedHere
	for rows.Next() {
		var p preparedHere
		if err := rows.Scan(&p.name, &p.statement, (*pq.StringArray)(&p.types)); err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// PgBouncer in transaction pooling before 1.21 (or without
// max_prepared_statements) hands a transaction to any server session, and
// lib/pq names its statements "1", "2", … on every connection: the name a
// batch binds can stand, in the session it lands on, for another replica's
// statement. If that statement takes the same parameters, PostgreSQL runs
// it without complaint — a lookup bound to another replica's close would
// close orders outside any fenced transaction (an order its producer just
// rescheduled, closed before its new deadline), and a close bound to a
// lookup would report closed the orders it only read. So no two statements
// the store prepares take the same number of parameters: a mix-up is a
// bind error (08P01), the store falls back to unprepared statements, and
// the call runs again, right.
//
// Simulated on a real server: the store's own session (a pool of one) gets,
// under the name of each statement it prepared, each other one of them
// instead, exactly as PostgreSQL has them; then the call that binds that
// name runs.
func TestPreparedStatementMixUpBehindAPoolerIsAnErrorNotAnotherStatement(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		// Learn the statements of this path, as one batch prepares them.
		db := oneConn(t)
		batch(t, ctx, db, orders.NewStore(db, p.stmts), "learn")
		all := preparedInSession(t, db)
		if len(all) != p.prepared {
			t.Fatalf("%s: %d statements prepared, want %d: %+v", p.name, len(all), p.prepared, all)
		}
		for _, victim := range all {
			for _, impostor := range all {
				if impostor.statement == victim.statement {
					continue
				}
				name := fmt.Sprintf("%s: %.30q bound to %.30q", p.name, victim.statement, impostor.statement)
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					mixUp(t, ctxT(t), p.stmts, victim, impostor)
				})
			}
		}
	}
}

// Another client's statement under the name of the one statement, taking
// the same parameter but returning fewer columns: lib/pq asks for the one
// statement's transaction id in binary, so its Bind lists a format per
// column, and PostgreSQL refuses it from PortalSetResultFormat (08P01),
// not from exec_bind_message. That is the same mix-up: the store falls
// back. Before, the error reached the caller as the database's (class 08),
// and the batch backed off for as long as the pooler kept mixing them up.
func TestPreparedStatementBoundToFewerColumnsFallsBack(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := oneConn(t)
	s := orders.NewStore(db, orders.Statements{})
	logs := warnings(s)
	batch(t, ctx, db, s, "warm")
	if _, err := db.ExecContext(ctx, `DEALLOCATE ALL; PREPARE "1"(text[]) AS SELECT x, x FROM unnest($1) x`); err != nil {
		t.Fatal(err)
	}
	batch(t, ctx, db, s, "mixed")
	checkFellBack(t, db, logs, "08P01")
}

// A custom lookup that PostgreSQL refuses in the shaped form (here a
// data-modifying WITH, allowed only at the top level) still works: it runs
// unprepared, said once at Info, and is not offered to PostgreSQL again on
// every batch.
func TestLookupThatCannotBeShapedRunsUnprepared(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := oneConn(t)
	lookup := `WITH touched AS (UPDATE orders SET status = status WHERE false RETURNING 1)
SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1);`
	s := orders.NewStore(db, orders.Statements{Lookup: lookup})
	core, logs := observer.New(zap.InfoLevel)
	s.SetLogger(zap.New(core))
	for i := range 3 {
		batch(t, ctx, db, s, fmt.Sprintf("b%d", i))
		pending := pendingOrders(t, db, fmt.Sprintf("p%d", i), 2)
		found, err := s.Lookup(ctx, append(pending, "no-row"))
		if err != nil || len(found) != 2 || !found[0].Pending || !found[1].Pending {
			t.Fatalf("Lookup = %+v, %v; want the two pending orders", found, err)
		}
	}
	if n := logs.FilterMessageSnippet("cannot be prepared").Len(); n != 1 {
		t.Errorf("%d notes that the lookup runs unprepared, want 1: %v", n, logs.All())
	}
	if got := preparedCounts(t, db, lookup); got[0] != "0/0" {
		t.Errorf("the lookup is prepared/ran %s in the session, want 0/0", got[0])
	}
}
