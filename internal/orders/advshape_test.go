package orders_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// fleetStatements are the statements a replica prepares with each
// configuration a fleet may run side by side during a rolling change: the
// reference schema's (the one statement), a custom lookup (the close
// statement alone), a custom close with the default lookup; and, for a
// rolling upgrade, the lookup and close statements of the previous
// release, which prepared them as they are (one text[] parameter).
func fleetStatements(t *testing.T, ctx context.Context) []preparedHere {
	t.Helper()
	seen := map[string]bool{}
	var all []preparedHere
	for _, st := range []orders.Statements{{}, {Lookup: orders.DefaultLookupSQL + " "}, {Close: orders.DefaultCloseSQL + " "}} {
		db := oneConn(t)
		batch(t, ctx, db, orders.NewStore(db, st), "learn")
		for _, h := range preparedInSession(t, db) {
			if !seen[h.statement] {
				seen[h.statement] = true
				all = append(all, h)
			}
		}
	}
	for _, old := range []string{orders.DefaultLookupSQL, orders.DefaultLookupSQL + " ", orders.DefaultCloseSQL, orders.DefaultCloseSQL + " "} {
		all = append(all, preparedHere{name: "previous release", statement: old, types: []string{"text[]"}})
	}
	return all
}

// A fleet in the middle of a rolling change — a custom lookup or close
// statement configured replica by replica, or an upgrade from the release
// that prepared the lookup as it is — behind a transaction pooler that
// mixes prepared statements up: every statement of a replica, bound to
// any statement another replica of that fleet prepares under the same
// name, must fail (and make the store fall back) or do what the replica
// meant. Not a lookup that closes, and not a close that reports closed the
// orders it only read: a close bound to the one statement reads its first
// column, which also lists the orders that are paid (a close event for a
// paid order), and a close bound to the previous release's lookup lists
// every order that has a row, closing none (removed from the queue while
// still pending).
func TestAdvShapeMixUpAcrossAFleetInARollingChange(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	fleet := fleetStatements(t, ctx)
	for _, p := range append(prepPaths[:len(prepPaths):len(prepPaths)],
		struct {
			name     string
			stmts    orders.Statements
			prepared int
		}{"custom close", orders.Statements{Close: orders.DefaultCloseSQL + " "}, 3}) {
		db := oneConn(t)
		batch(t, ctx, db, orders.NewStore(db, p.stmts), "learn")
		victims := preparedInSession(t, db)
		for _, victim := range victims {
			for _, impostor := range fleet {
				if impostor.statement == victim.statement || len(victim.types) == 0 && len(impostor.types) == 0 {
					// The same statement; or two that take no
					// parameters: only the transaction id's query does.
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

// mixUp puts impostor under the name of victim in the session of a store
// that ran a batch, then checks that a lookup only reads and that a batch
// closes what it says it closed and nothing else.
func mixUp(t *testing.T, ctx context.Context, stmts orders.Statements, victim, impostor preparedHere) {
	t.Helper()
	db := oneConn(t)
	s := orders.NewStore(db, stmts)
	batch(t, ctx, db, s, "prepared")
	var at string
	for _, h := range preparedInSession(t, db) {
		if h.statement == victim.statement {
			at = h.name
		}
	}
	if at == "" {
		t.Fatalf("%.40q is not prepared in the session", victim.statement)
	}
	params := ""
	if len(impostor.types) > 0 {
		params = "(" + strings.Join(impostor.types, ", ") + ")"
	}
	if _, err := db.ExecContext(ctx, fmt.Sprintf(`DEALLOCATE %s; PREPARE %s%s AS %s`,
		pq.QuoteIdentifier(at), pq.QuoteIdentifier(at), params, impostor.statement)); err != nil {
		t.Fatal(err)
	}
	pending := pendingOrders(t, db, "looked", 3)
	found, err := s.Lookup(ctx, pending)
	if err != nil || len(found) != 3 {
		t.Errorf("Lookup of 3 pending orders = %+v, %v", found, err)
	}
	if n := notPending(t, db, pending); n != 0 {
		t.Errorf("the lookup closed %d of 3 orders, outside any fenced transaction", n)
	}
	serials := pendingOrders(t, db, "after", 4)
	paid := pendingOrders(t, db, "paid", 1)
	if _, err := db.ExecContext(ctx, `UPDATE orders SET status = 'paid' WHERE serial_no = $1`, paid[0]); err != nil {
		t.Fatal(err)
	}
	out, err := s.Settle(ctx, append(slices.Clone(serials), paid[0], "after-no-row"), nil)
	if err != nil {
		t.Fatalf("Settle: %v", err)
	}
	if got := sorted(out.Closed); fmt.Sprint(got) != fmt.Sprint(serials) {
		t.Errorf("the batch said it closed %v, want %v", got, serials)
	}
	if n := notPending(t, db, serials); n != len(serials) {
		t.Errorf("the batch closed %d of its %d pending orders", n, len(serials))
	}
}

func notPending(t *testing.T, db *sqlx.DB, serials []string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, `SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status <> 'pending'`,
		pq.Array(serials)); err != nil {
		t.Fatal(err)
	}
	return n
}

// Custom close statements in the forms a shop writes them: each closes,
// fenced, batch after batch, prepared shaped when PostgreSQL takes the
// shaped form and unprepared (said once at Info) when it does not — a
// close that has a data-modifying WITH of its own cannot be wrapped in
// another.
func TestAdvShapeCustomCloseForms(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, close string
		prepared    bool
	}{
		{"trailing semicolon and blanks", orders.DefaultCloseSQL + ";\n\t ", true},
		{"trailing line comment", orders.DefaultCloseSQL + " -- closes the pending ones", true},
		{"trailing block comment", orders.DefaultCloseSQL + " /* closes */", true},
		{"read-only WITH", `WITH asked AS (SELECT unnest($1::text[]) AS s)
UPDATE orders SET status = 'closed', closed_at = now() WHERE serial_no IN (SELECT s FROM asked) AND status = 'pending'
RETURNING serial_no`, true},
		{"data-modifying WITH", `WITH c AS (UPDATE orders SET status = 'closed', closed_at = now()
WHERE serial_no = ANY($1) AND status = 'pending' RETURNING serial_no)
SELECT serial_no FROM c`, false},
		{"semicolon then a comment", orders.DefaultCloseSQL + "; -- closes", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t) // its own: a parallel subtest may wait for a slot
			db := oneConn(t)
			s := orders.NewStore(db, orders.Statements{Close: c.close})
			if err := s.Verify(ctx); err != nil {
				t.Fatalf("Verify: %v", err)
			}
			core, logs := observer.New(zap.InfoLevel)
			s.SetLogger(zap.New(core))
			for i := range 3 {
				batch(t, ctx, db, s, fmt.Sprintf("b%d", i))
			}
			notes := logs.FilterMessageSnippet("cannot be prepared").Len()
			got := preparedCounts(t, db, orders.ShapeClose(c.close))[0]
			if c.prepared && (notes != 0 || got != "1/3") {
				t.Errorf("%d notes, the shaped close prepared/ran %s; want 0, 1/3", notes, got)
			}
			if !c.prepared && (notes != 1 || ours(t, db) != 2) {
				t.Errorf("%d notes, %d statements of the store prepared; want 1 note and 2 (the lookup, the transaction id's)",
					notes, ours(t, db))
			}
		})
	}
}

// Another client's statement under the name of one of ours, taking the
// same parameters and returning as many columns, but of other types: the
// server sends them in the formats lib/pq asked for ours, and lib/pq
// decodes them as our columns' types. A column of ours asked for in
// binary (the transaction id, int8) that comes back shorter than 8 bytes,
// or a boolean that comes back empty, makes lib/pq panic (index out of
// range): before, that took the whole daemon down, at every restart for
// as long as the pooler kept handing it such sessions. It is the pooler
// mixing prepared statements up, like any other: the store falls back
// and runs the call again.
func TestAdvShapeImpostorOfOtherColumnTypesFallsBack(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, c := range []struct {
		name     string
		stmts    orders.Statements
		victim   string
		impostor string
	}{
		{"the transaction id's query", orders.Statements{Lookup: orders.DefaultLookupSQL + " "}, orders.TxRefSQL,
			`SELECT 'x'::text, 'y'::text`},
		{"the one statement", orders.Statements{}, orders.ShapedSettleSQL,
			`(text[], int, int, int) AS SELECT true, true, $1, 'short'::text, 'y'::text WHERE $2 + $3 + $4 > 0`},
		{"the lookup", orders.Statements{}, orders.ShapeLookup(orders.DefaultLookupSQL),
			`(text[], int) AS SELECT s, ''::text FROM unnest($1) s WHERE $2 IS NOT NULL`},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, c.stmts)
			logs := warnings(s)
			batch(t, ctx, db, s, "warm")
			var name string
			if err := db.Get(&name, `SELECT name FROM pg_prepared_statements WHERE statement = $1`, c.victim); err != nil {
				t.Fatal(err)
			}
			impostor := c.impostor
			if !strings.HasPrefix(impostor, "(") {
				impostor = "AS " + impostor
			}
			if _, err := db.ExecContext(ctx, fmt.Sprintf(`DEALLOCATE %[1]s; PREPARE %[1]s %s`,
				pq.QuoteIdentifier(name), impostor)); err != nil {
				t.Fatal(err)
			}
			pending := pendingOrders(t, db, "looked", 2)
			if found, err := s.Lookup(ctx, pending); err != nil || len(found) != 2 || !found[0].Pending || !found[1].Pending {
				t.Errorf("Lookup = %+v, %v; want both pending", found, err)
			}
			batch(t, ctx, db, s, "mixed")
			if logs.Len() != 1 || !strings.Contains(logs.All()[0].Message, "PgBouncer") {
				t.Errorf("warnings %v, want one that names PgBouncer", logs.All())
			}
			// The statements other than the impostor's stay prepared in
			// the session (a fallback does not close them), unused.
			before := oursRan(t, db)
			batch(t, ctx, db, s, "after")
			if after := oursRan(t, db); after != before {
				t.Errorf("the store's prepared statements ran %d times after the fallback, want none", after-before)
			}
		})
	}
}

// oursRan is how often the store's statements prepared in db's session ran.
func oursRan(t *testing.T, db *sqlx.DB) int64 {
	t.Helper()
	var n int64
	if err := db.Get(&n, `SELECT coalesce(sum(generic_plans + custom_plans), 0) FROM pg_prepared_statements
		WHERE statement ~ 'serial_no|txid_current'`); err != nil {
		t.Fatal(err)
	}
	return n
}

// A custom lookup PostgreSQL refuses in the shaped form runs unprepared,
// said once. A table altered under the other prepared statements (0A000,
// a reset) does not change what the lookup is: it is not offered to
// PostgreSQL shaped again, nor said again, after each such migration.
func TestAdvShapeUnshapeableLookupSaidOnceAcrossAReset(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := oneConn(t)
	other := otherSession(t, db)
	lookup := `WITH touched AS (UPDATE orders SET status = status WHERE false RETURNING 1)
SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1)`
	s := orders.NewStore(db, orders.Statements{Lookup: lookup})
	core, logs := observer.New(zap.InfoLevel)
	s.SetLogger(zap.New(core))
	batch(t, ctx, db, s, "before")
	for i, ddl := range []string{
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE varchar(128)`,
		`ALTER TABLE orders ALTER COLUMN serial_no TYPE text`,
	} {
		if _, err := other.ExecContext(ctx, ddl); err != nil {
			t.Fatalf("%s: %v", ddl, err)
		}
		batch(t, ctx, db, s, fmt.Sprintf("after%d", i))
	}
	if n := logs.FilterMessageSnippet("cannot be prepared").Len(); n != 1 {
		t.Errorf("%d notes that the lookup runs unprepared, want 1", n)
	}
}

// Custom lookup statements in the forms a shop writes them: each passes
// Verify and answers right, batch after batch, prepared shaped when
// PostgreSQL takes the shaped form, unprepared (said once) when it does
// not.
func TestAdvShapeCustomLookupForms(t *testing.T) {
	t.Parallel()
	const plain = `SELECT serial_no, status = 'pending' FROM orders WHERE serial_no = ANY($1)`
	for _, c := range []struct {
		name, lookup string
		prepared     bool
	}{
		{"trailing semicolon and blanks", plain + " ;;\r\n\t", true},
		{"trailing line comment", plain + " -- pending or not", true},
		{"trailing line comment ending in a semicolon", plain + " -- pending or not;", true},
		{"trailing block comment", plain + " /* pending or not */", true},
		{"a function", `SELECT * FROM od_lookup($1)`, true},
		{"ORDER BY and LIMIT", plain + " ORDER BY serial_no LIMIT 1000", true},
		{"FOR UPDATE", plain + " FOR UPDATE", true},
		{"UNION", plain + " AND status = 'pending' UNION ALL " + plain + " AND status <> 'pending'", true},
		{"semicolon then a comment", plain + "; -- pending or not", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t) // its own: a parallel subtest may wait for a slot
			db := oneConn(t)
			if _, err := db.ExecContext(ctx, `CREATE FUNCTION od_lookup(text[]) RETURNS TABLE (s text, p boolean)
				LANGUAGE sql STABLE AS $$`+plain+`$$`); err != nil {
				t.Fatal(err)
			}
			s := orders.NewStore(db, orders.Statements{Lookup: c.lookup})
			if err := s.Verify(ctx); err != nil {
				t.Fatalf("Verify: %v", err)
			}
			core, logs := observer.New(zap.InfoLevel)
			s.SetLogger(zap.New(core))
			for i := range 3 {
				batch(t, ctx, db, s, fmt.Sprintf("b%d", i))
				pending := pendingOrders(t, db, fmt.Sprintf("p%d", i), 2)
				if _, err := db.ExecContext(ctx, `UPDATE orders SET status = 'paid' WHERE serial_no = $1`, pending[1]); err != nil {
					t.Fatal(err)
				}
				found, err := s.Lookup(ctx, append(pending, "no-row"))
				if got := fmt.Sprintf("%+v", sortedFound(found)); err != nil || got != fmt.Sprintf("[{Serial:%s Pending:true} {Serial:%s Pending:false}]", pending[0], pending[1]) {
					t.Fatalf("Lookup = %s, %v", got, err)
				}
			}
			notes := logs.FilterMessageSnippet("cannot be prepared").Len()
			got := preparedCounts(t, db, orders.ShapeLookup(c.lookup))[0]
			if c.prepared && (notes != 0 || got != "1/6") {
				t.Errorf("%d notes, the shaped lookup prepared/ran %s; want 0, 1/6", notes, got)
			}
			if !c.prepared && (notes != 1 || got != "0/0") {
				t.Errorf("%d notes, the shaped lookup prepared/ran %s; want 1, 0/0", notes, got)
			}
		})
	}
}

func sortedFound(f []orders.Found) []orders.Found {
	out := slices.Clone(f)
	slices.SortFunc(out, func(a, b orders.Found) int { return strings.Compare(a.Serial, b.Serial) })
	return out
}

// Another client's statement under the name of one of ours, taking as
// many parameters of other types: PostgreSQL cannot read our text[] as
// its parameter and answers a data exception (22P02) from the Bind, which
// says nothing about the batch's orders. Before, the batch was taken for
// bad data: split, and its orders dead-lettered for as long as the pooler
// kept handing out such sessions. A data exception of a statement that ran
// prepared is tried once more unprepared: if that runs, it was the mix-up,
// and the store falls back for good.
func TestAdvShapeImpostorOfOtherParameterTypesFallsBack(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, c := range []struct {
		name     string
		stmts    orders.Statements
		victim   string
		impostor string
	}{
		{"the one statement", orders.Statements{}, orders.ShapedSettleSQL, `(int8, int8, int8, int8) AS SELECT $1 + $2 + $3 + $4`},
		{"the close statement", orders.Statements{Lookup: orders.DefaultLookupSQL + " "}, orders.ShapeClose(orders.DefaultCloseSQL),
			`(int8, int8, int8) AS SELECT $1 + $2 + $3`},
		{"the lookup", orders.Statements{}, orders.ShapeLookup(orders.DefaultLookupSQL), `(int8, int8) AS SELECT $1 + $2`},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, c.stmts)
			logs := warnings(s)
			batch(t, ctx, db, s, "warm")
			var name string
			if err := db.Get(&name, `SELECT name FROM pg_prepared_statements WHERE statement = $1`, c.victim); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, fmt.Sprintf(`DEALLOCATE %[1]s; PREPARE %[1]s%s`,
				pq.QuoteIdentifier(name), c.impostor)); err != nil {
				t.Fatal(err)
			}
			pending := pendingOrders(t, db, "looked", 2)
			if found, err := s.Lookup(ctx, pending); err != nil || len(found) != 2 {
				t.Errorf("Lookup = %+v, %v; want both", found, err)
			}
			batch(t, ctx, db, s, "mixed")
			if logs.Len() != 1 || !strings.Contains(logs.All()[0].Message, "PgBouncer") || loggedCode(logs.All()[0]) != "22P02" {
				t.Errorf("warnings %v, want one that names PgBouncer, for 22P02", logs.All())
			}
			before := oursRan(t, db)
			batch(t, ctx, db, s, "after")
			if after := oursRan(t, db); after != before {
				t.Errorf("the store's prepared statements ran %d times after the fallback, want none", after-before)
			}
		})
	}
}

// A data exception of the batch's own — a shop's trigger failing on one
// row's data (22012, raised in the trigger: with a context, as a Bind's
// parameter conversion is, but one that names the function) — reaches the
// caller as the batch's data; prepared statements stay on. (A lookup
// function failing once with 22000, in the consumer's
// TestLookupFailingAfterACommittedClose, is the same: not taken for a
// mix-up because a run unprepared then succeeds.)
func TestAdvShapeDataExceptionOfTheBatchStaysTheBatchs(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	for _, p := range prepPaths {
		t.Run(p.name, func(t *testing.T) {
			db := oneConn(t)
			s := orders.NewStore(db, p.stmts)
			logs := warnings(s)
			batch(t, ctx, db, s, "warm")
			db.MustExec(`CREATE FUNCTION od_poison() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN IF NEW.serial_no = 'poison-000' THEN PERFORM 1 / 0; END IF; RETURN NEW; END $$`)
			db.MustExec(`CREATE TRIGGER od_poison BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION od_poison()`)
			serials := pendingOrders(t, db, "poison", 3)
			_, err := s.Settle(ctx, serials, nil)
			var pqErr *pq.Error
			if !errors.As(err, &pqErr) || pqErr.Code != "22012" || orders.Transient(err) {
				t.Fatalf("Settle = %v, want the trigger's 22012, not transient", err)
			}
			if logs.Len() != 0 {
				t.Errorf("warnings %v, want none", logs.All())
			}
			before := oursRan(t, db)
			batch(t, ctx, db, s, "after")
			if after := oursRan(t, db); after == before {
				t.Errorf("the store's prepared statements did not run after the batch's data exception")
			}
		})
	}
}
