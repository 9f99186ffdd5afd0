package orders_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// previousOneStatement is the one statement of the release before the
// aggregated one: one row per serial (serial, closed, pending, xid,
// server). It takes one text[], as the new one does unshaped, and returns
// five columns, the fourth an int8 that lib/pq asks for in binary — the
// same Bind as the new one's would be, so PostgreSQL would refuse neither
// in place of the other: the new one is prepared with four parameters
// (orders.ShapedSettleSQL).
const previousOneStatement = `WITH closed AS (
  UPDATE orders
  SET status = 'closed', closed_at = now(), close_reason = 'timeout',
      closed_by = current_setting('application_name')
  WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[])))
    AND status = 'pending'
  RETURNING serial_no, txid_current() AS xid)
SELECT serial_no, true, true, xid, (SELECT extract(epoch FROM pg_postmaster_start_time())::text) FROM closed
UNION ALL
SELECT serial_no, false, status = 'pending', NULL, NULL FROM orders
WHERE serial_no = ANY(ARRAY(SELECT unnest($1::text[]) EXCEPT SELECT serial_no FROM closed))`

// A rolling upgrade from the per-row one statement to the aggregated one,
// behind a transaction pooler that mixes prepared statements up (lib/pq
// names them "1", "2", … on every connection): a new replica's batch
// binds the name of its one statement in a session where an old replica
// prepared the old one statement under it. The design (prepared.go,
// shapeLookup's comment) demands that every statement a replica prepares
// take a number of parameters no other statement of the fleet takes, "the
// release before this one" included, so that a mix-up is a Bind error and
// the store falls back. The two one statements take the same parameter and
// return as many columns with the same formats, so PostgreSQL runs the old
// statement under the new name: the batch must still close what it says
// it closed (or fall back and run again) — not fail for its data.
//
// It failed before the new statement was shaped: Settle returned
// ErrBadResult (the old rows do not decode as the new columns), which is
// neither a pooler's mix-up (no fallback) nor transient, so the consumer
// split the batch and dead-lettered its orders one by one.
func TestAdvSettleAggPreviousReleasesOneStatementUnderTheNewName(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := oneConn(t)
	batch(t, ctx, db, orders.NewStore(db, orders.Statements{}), "learn")
	var victim preparedHere
	for _, h := range preparedInSession(t, db) {
		if h.statement == orders.ShapedSettleSQL {
			victim = h
		}
	}
	if victim.name == "" {
		t.Fatal("the one statement is not prepared in the session")
	}
	impostor := preparedHere{name: "previous release", statement: previousOneStatement, types: []string{"text[]"}}
	if fmt.Sprint(victim.types) != fmt.Sprint(impostor.types) {
		t.Logf("the new one statement takes %v, the old one %v: a mix-up is refused at Bind", victim.types, impostor.types)
	}
	mixUp(t, ctx, orders.Statements{}, victim, impostor)
}

// previousAnswer runs the previous release's per-row one statement on
// serials in a transaction it rolls back, and reads its rows as that
// release did (serial trimmed when the column is char(n)): what the old
// statement would have answered from the same rows.
func previousAnswer(t *testing.T, ctx context.Context, db *sqlx.DB, serials []string) (orders.Outcome, error) {
	t.Helper()
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	rows, err := tx.QueryContext(ctx, previousOneStatement, orders.TextArrayForTest(serials))
	if err != nil {
		return orders.Outcome{}, err
	}
	defer rows.Close()
	cols, err := rows.ColumnTypes()
	if err != nil {
		t.Fatal(err)
	}
	pad := cols[0].DatabaseTypeName() == "BPCHAR"
	seen := map[string]bool{}
	var out orders.Outcome
	for rows.Next() {
		var sn string
		var closed, pending bool
		var id sql.NullInt64
		var server sql.NullString
		if err := rows.Scan(&sn, &closed, &pending, &id, &server); err != nil {
			return orders.Outcome{}, err
		}
		if pad {
			sn = strings.TrimRight(sn, " ")
		}
		if seen[sn] {
			return orders.Outcome{}, fmt.Errorf("%q twice", sn)
		}
		seen[sn] = true
		switch {
		case closed:
			out.Closed = append(out.Closed, sn)
		case pending:
			out.Unknown = append(out.Unknown, sn)
		default:
			out.Settled = append(out.Settled, sn)
		}
	}
	if err := rows.Err(); err != nil {
		return orders.Outcome{}, err
	}
	for _, sn := range serials {
		if !seen[sn] {
			seen[sn] = true
			out.Unknown = append(out.Unknown, sn)
		}
	}
	return out, nil
}

// settleRounds settles two rounds of awkward serials on db's orders table
// and compares each answer with the per-row statement's on the same rows;
// between the rounds it runs later on another session (a migration under
// the store's prepared statement).
func settleRounds(t *testing.T, ctx context.Context, db *sqlx.DB, later []string) {
	t.Helper()
	other := otherSession(t, db)
	s := orders.NewStore(db, orders.Statements{})
	for round := range 2 {
		p := fmt.Sprintf("r%d-", round)
		var rows []order
		var ask []string
		for i, sn := range []string{"a b", `a"b`, `c\d`, "{x}", "x,y", "NULL", "null", " lead", "订单-🛒", "plain"} {
			st := []string{"pending", "paid", "closed"}[i%3]
			rows = append(rows, order{p + sn, st, -time.Minute})
			ask = append(ask, p+sn)
		}
		rows = append(rows, order{p + "trail", "pending", -time.Minute})
		insert(t, db, rows...)
		ask = append(ask, p+"plain", p+"a b", p+"missing", p+"missing", p+"trail ")
		want, err := previousAnswer(t, ctx, db, ask)
		if err != nil {
			t.Fatalf("round %d: the per-row statement: %v", round, err)
		}
		got, err := s.Settle(ctx, ask, nil)
		if err != nil {
			t.Fatalf("round %d: Settle: %v (the per-row statement answered %q)", round, err, sortedOutcome(want))
		}
		if g, w := sortedOutcome(got), sortedOutcome(want); !equalOutcome(g, w) {
			t.Errorf("round %d: Settle = %q\nthe per-row statement: %q", round, g, w)
		}
		if round == 0 {
			for _, d := range later {
				if _, err := other.ExecContext(ctx, d); err != nil {
					t.Fatalf("%s: %v", d, err)
				}
			}
		}
	}
}

// The aggregated one statement answers as the per-row one did, serial for
// serial, on a reference table whose serial column is text, varchar or
// char(n), and after that column is changed under the store's prepared
// statement, including in ways that keep the aggregated result's type
// (char(24) to char(30), varchar(128) to varchar(100): array_agg's result
// has no typmod, so PostgreSQL replans without the 0A000 the per-row
// statement got) — with pending, paid, closed, missing, duplicated and
// array-quoted serials, and a blank-padded look-alike.
//
// It covers column types and a silent replan no other test tried.
func TestAdvSettleAggAnswersAsThePerRowStatementAcrossColumnTypes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		ddl   []string // before the first batch
		later []string // under the prepared statement, between the rounds
	}{
		{"text to varchar", nil, []string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`}},
		{"varchar", []string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`},
			[]string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(100)`}},
		{"char", []string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(24)`},
			[]string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(30)`}},
		{"text to char", nil, []string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(24)`}},
		{"char to text", []string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(24)`},
			[]string{`ALTER TABLE orders ALTER COLUMN serial_no TYPE text`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := oneConn(t)
			for _, d := range c.ddl {
				db.MustExec(d)
			}
			settleRounds(t, ctxT(t), db, c.later)
		})
	}
}

// A reference table whose serial column is a domain over text or varchar
// (CREATE DOMAIN … AS text; a shop's constraint on its serials): the
// per-row one statement returned the column as its base type (PostgreSQL's
// RowDescription sends a domain's base type), so Verify passed and the
// daemon started. An array_agg of the column itself is an array of the
// domain (od_serial[], an OID lib/pq has no name for): Verify refused the
// default statements and the daemon exited 2 at start — after an upgrade,
// on a table the previous release ran on — until the statement cast the
// serials to text.
func TestAdvSettleAggVerifyAcceptsADomainSerialColumn(t *testing.T) {
	t.Parallel()
	for _, base := range []string{"text", "varchar(128)"} {
		t.Run(base, func(t *testing.T) {
			t.Parallel()
			db := oneConn(t)
			db.MustExec(`CREATE DOMAIN od_serial AS ` + base + ` CHECK (VALUE <> '')`)
			db.MustExec(`ALTER TABLE orders ALTER COLUMN serial_no TYPE od_serial`)
			if err := orders.NewStore(db, orders.Statements{}).Verify(ctxT(t)); err != nil {
				t.Fatalf("Verify: %v", err)
			}
			settleRounds(t, ctxT(t), db, nil)
		})
	}
}

// The serial column changed under a running daemon to a domain over
// char(n) (Verify at start would refuse such a table on either release —
// the close statement's parameter is character[] — but the daemon that
// runs is not asked again): the per-row statement's column was the
// domain's base type, bpchar, and its serials were trimmed. An array_agg
// of the column itself is od_serial[], whose type name says nothing of
// padding: every batch was ErrBadResult ("serial \"…   \" was not asked
// about"), split and dead-lettered order by order, until the statement
// cast the serials to text (which trims them).
func TestAdvSettleAggDomainOverCharChangedUnderTheDaemon(t *testing.T) {
	t.Parallel()
	db := oneConn(t)
	db.MustExec(`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(24)`)
	settleRounds(t, ctxT(t), db, []string{
		`CREATE DOMAIN od_serial AS char(24)`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE od_serial`,
	})
}
