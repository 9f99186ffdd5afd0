package orders_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// closePaths are the two ways a batch is closed: the close statement alone
// (custom statements, Close) and the one statement of the reference schema
// (Settle). The fence, the drop-and-redo loop and the lost-COMMIT
// resolution must hold on both.
var closePaths = []struct {
	name  string
	close func(ctx context.Context, s *orders.Store, serials []string, fence orders.Fence) ([]string, error)
}{
	{"close statement", func(ctx context.Context, s *orders.Store, serials []string, fence orders.Fence) ([]string, error) {
		return s.Close(ctx, serials, fence)
	}},
	{"one statement", func(ctx context.Context, s *orders.Store, serials []string, fence orders.Fence) ([]string, error) {
		if !s.OneStatement() {
			return nil, errors.New("the store does not run the one statement")
		}
		out, err := s.Settle(ctx, serials, fence)
		return out.Closed, err
	}},
}

func TestSettleAnswersForEverySerial(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	insert(t, db,
		order{"p1", "pending", -time.Minute},
		order{"p2", "pending", -time.Second},
		order{"paid", "paid", -time.Minute},
		order{"closed", "closed", -time.Hour},
		order{"other", "pending", -time.Minute}, // not asked for
	)
	s := orders.NewStore(db, orders.Statements{})
	if !s.OneStatement() {
		t.Fatal("the default statements do not run as one statement")
	}
	out, err := s.Settle(ctxT(t), []string{"p1", "paid", "missing", "closed", "p2"}, nil)
	if err != nil {
		t.Fatalf("Settle: %v", err)
	}
	want := orders.Outcome{Closed: []string{"p1", "p2"}, Settled: []string{"closed", "paid"}, Unknown: []string{"missing"}}
	if got := sortedOutcome(out); !equalOutcome(got, want) {
		t.Errorf("Settle = %+v, want %+v", got, want)
	}
	for serial, st := range map[string]string{"p1": "closed", "p2": "closed", "paid": "paid", "closed": "closed", "other": "pending"} {
		if got := status(t, db, serial); got != st {
			t.Errorf("status of %s = %q, want %q", serial, got, st)
		}
	}
	// Again: nothing left to close, everything settled.
	out, err = s.Settle(ctxT(t), []string{"p1", "p2"}, nil)
	if err != nil || len(out.Closed) != 0 || !slices.Equal(sorted(out.Settled), []string{"p1", "p2"}) || len(out.Unknown) != 0 {
		t.Errorf("second Settle = %+v, %v; want both settled", out, err)
	}
	if out, err := s.Settle(ctxT(t), nil, nil); err != nil || len(out.Closed)+len(out.Settled)+len(out.Unknown) != 0 {
		t.Errorf("Settle(nil) = %+v, %v; want nothing", out, err)
	}
}

// The one statement answers with arrays of serials: a serial that the
// array syntax quotes (white space, quotes, backslashes, braces, commas, a
// serial spelled NULL in any case) comes back as it is, beside plain ones,
// closed or settled as its row says — all valid serials (queue.ValidateSerial).
func TestSettleSerialsTheArraySyntaxQuotes(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	odd := []string{"a b", `a"b`, `c\d`, `\"`, "{x}", "a,b", "NULL", "null", "Null", " lead", "trail ", "订单-🛒", "'; --", "ORD-1"}
	var rows []order
	var wantClosed, wantSettled []string
	for i, sn := range odd {
		if i%3 == 2 {
			rows = append(rows, order{sn, "paid", -time.Minute})
			wantSettled = append(wantSettled, sn)
		} else {
			rows = append(rows, order{sn, "pending", -time.Minute})
			wantClosed = append(wantClosed, sn)
		}
	}
	insert(t, db, rows...)
	s := orders.NewStore(db, orders.Statements{})
	out, err := s.Settle(ctxT(t), append(slices.Clone(odd), "missing one"), nil)
	want := orders.Outcome{Closed: sorted(wantClosed), Settled: sorted(wantSettled), Unknown: []string{"missing one"}}
	if got := sortedOutcome(out); err != nil || !equalOutcome(got, want) {
		t.Errorf("Settle = %+v, %v; want %+v", got, err, want)
	}
	for _, sn := range wantClosed {
		if st := status(t, db, sn); st != "closed" {
			t.Errorf("%q is %s, want closed", sn, st)
		}
	}
}

// A custom close or lookup statement keeps the close statement alone:
// Settle then knows only what it closed, and everything else is Unknown
// (the caller asks the lookup).
func TestSettleWithCustomStatementsIsTheCloseStatement(t *testing.T) {
	t.Parallel()
	for _, stmts := range []orders.Statements{
		{Close: orders.DefaultCloseSQL + " "},
		{Lookup: `SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1::text[])`},
	} {
		db, _ := testenv.Postgres(t)
		insert(t, db, order{"p1", "pending", -time.Minute}, order{"paid", "paid", -time.Minute})
		s := orders.NewStore(db, stmts)
		if s.OneStatement() {
			t.Fatalf("%+v: custom statements must not run as the built-in one statement", stmts)
		}
		out, err := s.Settle(ctxT(t), []string{"p1", "paid", "missing"}, nil)
		want := orders.Outcome{Closed: []string{"p1"}, Unknown: []string{"missing", "paid"}}
		if got := sortedOutcome(out); err != nil || !equalOutcome(got, want) {
			t.Errorf("%+v: Settle = %+v, %v; want %+v", stmts, got, err, want)
		}
	}
}

// A payment that commits while the one statement waits for the row's lock
// wins: the update re-checks the newest row and leaves it alone. The row
// was pending in the statement's snapshot, so it cannot say it is settled:
// it is Unknown, and the caller's lookup (a new snapshot) sees it paid.
func TestSettlePaidWhileWaitingIsUnknownNotClosed(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	ctx := ctxT(t)
	insert(t, db, order{"race", "pending", -time.Minute}, order{"free", "pending", -time.Minute})
	s := orders.NewStore(db, orders.Statements{})
	pay, payPID := payInTx(t, db, "race")
	type result struct {
		out orders.Outcome
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := s.Settle(ctx, []string{"race", "free"}, nil)
		done <- result{out, err}
	}()
	waitBlockedBy(t, db, payPID)
	if err := pay.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	want := orders.Outcome{Closed: []string{"free"}, Unknown: []string{"race"}}
	if got := sortedOutcome(r.out); r.err != nil || !equalOutcome(got, want) {
		t.Fatalf("Settle = %+v, %v; want %+v", got, r.err, want)
	}
	if got := status(t, db, "race"); got != "paid" {
		t.Errorf("status = %q, want paid", got)
	}
	found, err := s.Lookup(ctx, r.out.Unknown)
	if err != nil || len(found) != 1 || found[0].Pending {
		t.Errorf("Lookup after the commit = %+v, %v; want it settled (not pending)", found, err)
	}
}

// payInTx pays serial in an open transaction and returns it with its
// backend's pid.
func payInTx(t *testing.T, db *sqlx.DB, serial string) (*sqlx.Tx, int) {
	t.Helper()
	pay, err := db.BeginTxx(ctxT(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pay.Rollback() }) //nolint:errcheck
	if _, err := pay.Exec(`UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = $1`, serial); err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := pay.Get(&pid, `SELECT pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	return pay, pid
}

// A reference table whose serial column was made char(n): the one
// statement's serials come back blank-padded and are trimmed, as the close
// and lookup statements' are.
func TestSettleBlankPaddedSerials(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	if _, err := db.Exec(`ALTER TABLE orders ALTER COLUMN serial_no TYPE char(24)`); err != nil {
		t.Fatal(err)
	}
	insert(t, db, order{"c1", "pending", -time.Minute}, order{"p1", "paid", -time.Minute})
	s := orders.NewStore(db, orders.Statements{})
	out, err := s.Settle(ctxT(t), []string{"c1", "p1", "gone"}, nil)
	want := orders.Outcome{Closed: []string{"c1"}, Settled: []string{"p1"}, Unknown: []string{"gone"}}
	if got := sortedOutcome(out); err != nil || !equalOutcome(got, want) {
		t.Errorf("Settle = %+v, %v; want %+v (padding trimmed)", got, err, want)
	}
}

// The one statement's result is checked before the fence and COMMIT:
// anything it must not return is ErrBadResult, and nothing commits.
func TestSettleMalformedResults(t *testing.T) {
	t.Parallel()
	// Rows are (closed, pending, serials, transaction id, server).
	tests := []struct{ name, sql string }{
		{"NULL closed flag", `SELECT NULL::bool, true, array_agg(s), NULL::bigint, NULL::text FROM unnest($1::text[]) s`},
		{"NULL pending flag", `SELECT false, NULL::bool, array_agg(s), NULL::bigint, NULL::text FROM unnest($1::text[]) s`},
		{"flag not a boolean", `SELECT 'maybe'::text, true, array_agg(s), NULL::bigint, NULL::text FROM unnest($1::text[]) s`},
		{"four columns", `SELECT false, true, array_agg(s), NULL::bigint FROM unnest($1::text[]) s`},
		{"one row per serial", `SELECT s, false, true, NULL::bigint, NULL::text FROM unnest($1::text[]) s`},
		{"NULL list", `SELECT false, false, NULL::text[], NULL::bigint, NULL::text WHERE cardinality($1::text[]) > 0`},
		{"empty list", `SELECT false, false, '{}'::text[], NULL::bigint, NULL::text WHERE cardinality($1::text[]) > 0`},
		{"NULL element", `SELECT false, false, array_agg(s) || NULL::text, NULL::bigint, NULL::text FROM unnest($1::text[]) s`},
		{"NULL element beside a quoted one", `SELECT false, false, ARRAY['a b', NULL, 'a'], NULL::bigint, NULL::text WHERE cardinality($1::text[]) > 0`},
		{"list not an array", `SELECT false, false, array_to_string($1::text[], ','), NULL::bigint, NULL::text`},
		{"two-dimensional list", `SELECT false, false, ARRAY[$1::text[]], NULL::bigint, NULL::text`},
		{"closed but not pending", `SELECT true, false, array_agg(s), txid_current(), 'srv' FROM unnest($1::text[]) s`},
		{"closed without a transaction id", `WITH c AS (UPDATE orders SET status = 'closed' WHERE serial_no = ANY($1) RETURNING serial_no)
			SELECT true, true, array_agg(serial_no), NULL::bigint, NULL::text FROM c`},
		{"closed without a server", `WITH c AS (UPDATE orders SET status = 'closed' WHERE serial_no = ANY($1) RETURNING serial_no)
			SELECT true, true, array_agg(serial_no), txid_current(), NULL::text FROM c`},
		{"two transaction ids", `WITH c AS (UPDATE orders SET status = 'closed' WHERE serial_no = ANY($1) RETURNING serial_no)
			SELECT true, true, ARRAY[serial_no], txid_current() + row_number() OVER (), 'srv' FROM c`},
		{"a serial not asked about", `SELECT false, false, ARRAY['other'], NULL::bigint, NULL::text WHERE cardinality($1::text[]) > 0`},
		{"a quoted serial not asked about", `SELECT false, false, ARRAY['a', 'b c'], NULL::bigint, NULL::text WHERE cardinality($1::text[]) > 0`},
		{"a serial twice in a list", `SELECT false, false, $1::text[] || $1::text[], NULL::bigint, NULL::text`},
		{"a serial in two lists", `SELECT false, p, $1::text[], NULL::bigint, NULL::text FROM (VALUES (true), (false)) v(p)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db, _ := testenv.Postgres(t)
			insert(t, db, order{"a", "pending", -time.Minute}, order{"b", "pending", -time.Minute})
			s := orders.NewStore(db, orders.Statements{})
			orders.SetSettleSQL(s, tt.sql)
			fenced := false
			out, err := s.Settle(ctxT(t), []string{"a", "b"}, func(context.Context, []string) ([]string, error) {
				fenced = true
				return nil, nil
			})
			if !errors.Is(err, orders.ErrBadResult) {
				t.Fatalf("Settle = %+v, %v; want ErrBadResult", out, err)
			}
			if fenced {
				t.Error("the fence was asked about a malformed result")
			}
			for _, sn := range []string{"a", "b"} {
				if st := status(t, db, sn); st != "pending" {
					t.Errorf("%s is %s after a malformed result: it committed", sn, st)
				}
			}
		})
	}
}

// DryRun and WithOutbox define Settle themselves: a promoted Store.Settle
// would commit a dry run, or close without recording the events.
func TestSettleDryRunAndOutbox(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"p1", "pending", -time.Minute}, order{"paid", "paid", -time.Minute})
	s := orders.NewStore(db, orders.Statements{})
	out, err := orders.DryRun{Store: s}.Settle(ctxT(t), []string{"p1", "paid"}, nil)
	if err != nil || !slices.Equal(out.Closed, []string{"p1"}) {
		t.Fatalf("DryRun.Settle = %+v, %v; want p1 reported as would-close", out, err)
	}
	if st := status(t, db, "p1"); st != "pending" {
		t.Fatalf("a dry run closed p1 (%s)", st)
	}
	out, err = orders.WithOutbox{Store: s}.Settle(ctxT(t), []string{"p1", "paid"}, nil)
	if err != nil || !slices.Equal(out.Closed, []string{"p1"}) || !slices.Equal(out.Settled, []string{"paid"}) {
		t.Fatalf("WithOutbox.Settle = %+v, %v", out, err)
	}
	var events []string
	if err := db.Select(&events, `SELECT serial_no FROM `+orders.OutboxTable+` ORDER BY id`); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(events, []string{"p1"}) {
		t.Errorf("outbox %v, want one event for p1", events)
	}
}

func sortedOutcome(o orders.Outcome) orders.Outcome {
	return orders.Outcome{Closed: sorted(o.Closed), Settled: sorted(o.Settled), Unknown: sorted(o.Unknown)}
}

func equalOutcome(a, b orders.Outcome) bool {
	eq := func(x, y []string) bool { return len(x) == 0 && len(y) == 0 || slices.Equal(x, y) }
	return eq(a.Closed, b.Closed) && eq(a.Settled, b.Settled) && eq(a.Unknown, b.Unknown)
}

// The one statement locks rows in the order its update scans them. The
// update takes its serials from an array built by a subquery, which the
// planner cannot size: on a table of any real size it scans the primary
// key, which takes the array in index order — rows are locked in serial
// order at every batch size, as the dropped FOR UPDATE pass did.
func TestSettleUpdatesThroughThePrimaryKey(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	if _, err := db.Exec(`INSERT INTO orders (serial_no, status, expires_at)
		SELECT format('S-%s', lpad(i::text, 8, '0')), CASE WHEN i % 10 = 0 THEN 'paid' ELSE 'pending' END, now()
		FROM generate_series(1, 20000) i`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`ANALYZE orders`); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 500, 2000, 10000} {
		serials := make([]string, n)
		for i := range serials {
			serials[i] = fmt.Sprintf("S-%08d", 20000-i*2) // descending, every other one
		}
		var lines []string
		if err := db.Select(&lines, `EXPLAIN `+orders.DefaultSettleSQL, pq.Array(serials)); err != nil {
			t.Fatal(err)
		}
		plan := strings.Join(lines, "\n")
		upd := plan[strings.Index(plan, "Update on orders"):]
		if !strings.Contains(upd, "Index Scan using orders_pkey") || strings.Contains(upd, "Bitmap") || strings.Contains(upd, "Seq Scan on orders") {
			t.Errorf("%d serials: the update does not scan the primary key:\n%s", n, plan)
		}
	}
}

// Verify checks the built-in one statement against the table as well: a
// reference table changed under the default statements is refused at
// start, not on every batch.
func TestVerifyChecksTheOneStatement(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Postgres(t)
	s := orders.NewStore(db, orders.Statements{})
	if err := s.Verify(ctxT(t)); err != nil {
		t.Fatalf("Verify of the defaults: %v", err)
	}
	orders.SetSettleSQL(s, `SELECT true, true, array_agg(serial_no), 1::int4, 'x'::text FROM orders WHERE serial_no = ANY($1)`)
	err := s.Verify(ctxT(t))
	var se *orders.StatementError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), "one statement") || !strings.Contains(err.Error(), "transaction id") {
		t.Fatalf("Verify with a one statement returning int4 ids = %v, want a StatementError naming it", err)
	}
}
