package orders_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestTransientByWhatTheErrorSays: an error about the database (its
// connection, availability, mode, locks, resources, an operator) is
// transient; an error about this order's data is not. Codes, severities and
// the driver's and database/sql's sentinel errors.
func TestTransientByWhatTheErrorSays(t *testing.T) {
	t.Parallel()
	inTrigger := "PL/pgSQL function orders_guard() line 3 at EXECUTE"
	tests := []struct {
		name      string
		err       error
		transient bool
	}{
		// The database's state: a failover, a full disk, an operator.
		{"read-only transaction (failover to a standby)", &pq.Error{Code: "25006"}, true},
		{"lock not available", &pq.Error{Code: "55P03"}, true},
		{"object in use", &pq.Error{Code: "55006"}, true},
		{"insufficient resources", &pq.Error{Code: "53000"}, true},
		{"disk full", &pq.Error{Code: "53100"}, true},
		{"out of memory", &pq.Error{Code: "53200"}, true},
		{"too many connections", &pq.Error{Code: "53300"}, true},
		{"configuration limit exceeded", &pq.Error{Code: "53400"}, true},
		{"operator intervention", &pq.Error{Code: "57000"}, true},
		{"statement timeout or cancel", &pq.Error{Code: "57014"}, true},
		{"admin shutdown", &pq.Error{Code: "57P01"}, true},
		{"crash shutdown", &pq.Error{Code: "57P02"}, true},
		{"cannot connect now", &pq.Error{Code: "57P03"}, true},
		{"database dropped", &pq.Error{Code: "57P04"}, true},
		{"idle session timeout", &pq.Error{Code: "57P05"}, true},
		{"system error", &pq.Error{Code: "58000"}, true},
		{"I/O error", &pq.Error{Code: "58030"}, true},
		{"undefined file", &pq.Error{Code: "58P01"}, true},
		{"connection failure", &pq.Error{Code: "08006"}, true},
		{"protocol violation", &pq.Error{Code: "08P01"}, true},
		{"serialization failure", &pq.Error{Code: "40001"}, true},
		{"deadlock", &pq.Error{Code: "40P01"}, true},
		{"statement completion unknown", &pq.Error{Code: "40003"}, true},
		{"config file error", &pq.Error{Code: "F0000"}, true},
		{"FATAL at connect: password rotated", &pq.Error{Code: "28P01", Severity: "FATAL"}, true},
		{"FATAL at connect: database missing", &pq.Error{Code: "3D000", Severity: "FATAL"}, true},
		// The statement itself, the same for every order: the schema or a
		// grant changed under the daemon. Burying orders cannot fix it.
		{"undefined column in the statement", &pq.Error{Code: "42703", Position: "42"}, true},
		{"undefined table in the statement", &pq.Error{Code: "42P01", Position: "8"}, true},
		{"permission denied for the table", &pq.Error{Code: "42501", Message: "permission denied for table orders"}, true},

		// This order's data.
		{"invalid text representation", &pq.Error{Code: "22P02"}, false},
		{"value too long", &pq.Error{Code: "22001"}, false},
		{"unique violation", &pq.Error{Code: "23505"}, false},
		{"check violation", &pq.Error{Code: "23514"}, false},
		{"foreign key violation", &pq.Error{Code: "23503"}, false},
		{"raise_exception from a shop's trigger", &pq.Error{Code: "P0001", Where: "PL/pgSQL function orders_guard() line 3 at RAISE"}, false},
		{"assert failure", &pq.Error{Code: "P0004"}, false},
		{"triggered data change violation", &pq.Error{Code: "27000"}, false},
		{"with check option violation", &pq.Error{Code: "44000"}, false},
		{"deferred constraint at commit", &pq.Error{Code: "40002"}, false},
		{"cardinality violation", &pq.Error{Code: "21000"}, false},
		{"class 42 inside a trigger (dynamic SQL on row values)", &pq.Error{Code: "42P01", Where: inTrigger}, false},
		{"class 42 syntax inside a trigger", &pq.Error{Code: "42601", Where: inTrigger}, false},
		{"row-level security policy", &pq.Error{Code: "42501", Message: `new row violates row-level security policy for table "orders"`}, false},
		{"no code at all (does not panic)", &pq.Error{}, false},

		// Not from the server.
		{"nil", nil, false},
		{"something else", errors.New("something else"), false},
		{"statement result", fmt.Errorf("%w: NULL serial", orders.ErrBadResult), false},
		{"driver.ErrBadConn", driver.ErrBadConn, true},
		{"sql.ErrConnDone", sql.ErrConnDone, true},
		{"sql.ErrTxDone", sql.ErrTxDone, true},
		{"context deadline", context.DeadlineExceeded, true},
		{"context canceled", context.Canceled, true},
		{"io.EOF", io.EOF, true},
		{"io.ErrUnexpectedEOF", io.ErrUnexpectedEOF, true},
		{"connection reset", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, true},
		{"connection refused", syscall.ECONNREFUSED, true},
		{"broken pipe", syscall.EPIPE, true},
		{"could not connect to any host", fmt.Errorf("pq: could not connect to any of the hosts:\n%w",
			errors.Join(fmt.Errorf("connecting to a:5432: %w", &pq.Error{Code: "57P03", Severity: "FATAL"}))), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := orders.Transient(tt.err); got != tt.transient {
				t.Errorf("Transient(%#v) = %v, want %v", tt.err, got, tt.transient)
			}
			if tt.err == nil {
				return
			}
			if got := orders.Transient(fmt.Errorf("close batch: %w", tt.err)); got != tt.transient {
				t.Errorf("Transient(wrapped %v) = %v, want %v", tt.err, got, tt.transient)
			}
		})
	}
}

func TestRowLocked(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		err  error
		want bool
	}{
		{&pq.Error{Code: "55P03"}, true},
		{fmt.Errorf("close: %w", &pq.Error{Code: "55P03"}), true},
		{&pq.Error{Code: "57014"}, false},
		{&pq.Error{Code: "40P01"}, false},
		{&pq.Error{}, false},
		{context.DeadlineExceeded, false},
		{nil, false},
	} {
		if got := orders.RowLocked(tt.err); got != tt.want {
			t.Errorf("RowLocked(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

// TestTransientProvoked provokes each error on the real PostgreSQL and
// classifies what lib/pq and database/sql actually return.
func TestTransientProvoked(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		err       func(t *testing.T) error
		transient bool
		rowLocked bool
	}{
		{"read-only session (25006)", readOnly, true, false},
		{"lock timeout on a held row (55P03)", lockTimeout, true, true},
		{"trigger RAISE (P0001)", triggerRaise, false, false},
		{"unique violation (23505)", uniqueViolation, false, false},
		{"undefined column in the statement (42703)", undefinedColumn, true, false},
		{"undefined table inside a trigger (42P01)", triggerUndefinedTable, false, false},
		{"session terminated: driver.ErrBadConn", terminatedConnection, true, false},
		{"session terminated, Conn used again: sql.ErrConnDone", connUsedAgain, true, false},
		{"committed Tx used again: sql.ErrTxDone", txUsedAgain, true, false},
		{"deadline between statement and commit: sql.ErrTxDone or context", deadlineBeforeCommit, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := tt.err(t)
			if err == nil {
				t.Fatalf("the setup produced no error")
			}
			t.Logf("%T: %v", err, err)
			if got := orders.Transient(err); got != tt.transient {
				t.Errorf("Transient(%v [%T]) = %v, want %v", err, err, got, tt.transient)
			}
			if got := orders.RowLocked(err); got != tt.rowLocked {
				t.Errorf("RowLocked(%v) = %v, want %v", err, got, tt.rowLocked)
			}
		})
	}
}

func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) || string(pqErr.Code) != code {
		t.Fatalf("error = %v (%T), want a *pq.Error %s", err, err, code)
	}
}

func readOnly(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"ro", "pending", -time.Minute})
	ctx := ctxT(t)
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SET default_transaction_read_only = on`); err != nil {
		t.Fatal(err)
	}
	_, err = conn.ExecContext(ctx, `UPDATE orders SET status = 'closed' WHERE serial_no = 'ro'`)
	wantCode(t, err, "25006")
	return err
}

// holdRow locks serial in a transaction until the test ends.
func holdRow(t *testing.T, db *sqlx.DB, serial string) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback() }) //nolint:errcheck
	if _, err := tx.Exec(`SELECT 1 FROM orders WHERE serial_no = $1 FOR UPDATE`, serial); err != nil {
		t.Fatal(err)
	}
}

func lockTimeout(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"locked", "pending", -time.Minute})
	holdRow(t, db, "locked")
	ctx := ctxT(t)
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SET lock_timeout = '50ms'`); err != nil {
		t.Fatal(err)
	}
	_, err = orders.NewStore(db, orders.Statements{}).CloseOn(ctx, conn, []string{"locked"})
	wantCode(t, err, "55P03")
	return err
}

func triggerRaise(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"poison", "pending", -time.Minute})
	db.MustExec(`CREATE FUNCTION orders_guard() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.serial_no = 'poison' THEN RAISE EXCEPTION 'order % cannot be closed', NEW.serial_no; END IF;
			RETURN NEW;
		END $$`)
	db.MustExec(`CREATE TRIGGER orders_guard BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION orders_guard()`)
	_, err := orders.NewStore(db, orders.Statements{}).Close(ctxT(t), []string{"poison"}, nil)
	wantCode(t, err, "P0001")
	return err
}

func undefinedColumn(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	s := orders.NewStore(db, orders.Statements{Close: `UPDATE orders SET status = 'closed', closed_on = now()
		WHERE serial_no = ANY($1) RETURNING serial_no`})
	_, err := s.Close(ctxT(t), []string{"a"}, nil)
	wantCode(t, err, "42703")
	return err
}

func triggerUndefinedTable(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"odd", "pending", -time.Minute})
	// A shop's trigger that writes to a table named after the row.
	db.MustExec(`CREATE FUNCTION orders_copy() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			EXECUTE format('INSERT INTO %I VALUES ($1)', 'archive_' || NEW.serial_no) USING NEW.serial_no;
			RETURN NEW;
		END $$`)
	db.MustExec(`CREATE TRIGGER orders_copy BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION orders_copy()`)
	_, err := orders.NewStore(db, orders.Statements{}).Close(ctxT(t), []string{"odd"}, nil)
	wantCode(t, err, "42P01")
	return err
}

// connUsedAgain: after lib/pq reported the terminated session as
// driver.ErrBadConn, database/sql closed the Conn; the next call on it
// returns sql.ErrConnDone.
func connUsedAgain(t *testing.T) error {
	conn := terminatedConn(t)
	ctx := ctxT(t)
	var err error
	// The first use reports the termination (driver.ErrBadConn, or the
	// connection reset if the socket closed before lib/pq read the FATAL
	// message); database/sql then closes the Conn.
	for try := 0; try < 3; try++ {
		_, err = conn.ExecContext(ctx, `SELECT 1`)
		if err == nil {
			t.Fatal("a terminated session answered")
		}
		if !orders.Transient(err) {
			t.Errorf("use %d after termination: Transient(%v [%T]) = false", try+1, err, err)
		}
		if errors.Is(err, sql.ErrConnDone) {
			return err
		}
	}
	t.Fatalf("last use: %v, want sql.ErrConnDone", err)
	return err
}

func txUsedAgain(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(`SELECT 1`)
	if !errors.Is(err, sql.ErrTxDone) {
		t.Fatalf("used after commit: %v, want sql.ErrTxDone", err)
	}
	return err
}

// deadlineBeforeCommit: the close statement succeeded, then the batch's
// deadline passed before COMMIT; database/sql rolled the transaction back
// and Commit reports it. Nothing about the orders.
func deadlineBeforeCommit(t *testing.T) error {
	db, _ := testenv.Postgres(t)
	insert(t, db, order{"slow", "pending", -time.Minute})
	ctx, cancel := context.WithCancel(ctxT(t))
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck
	if _, err := orders.NewStore(db, orders.Statements{}).CloseOn(ctx, tx, []string{"slow"}); err != nil {
		t.Fatal(err)
	}
	cancel()
	// database/sql rolls back in the background once ctx ends; Commit says
	// ErrTxDone if that happened first, the context's error otherwise.
	err = tx.Commit()
	if !errors.Is(err, sql.ErrTxDone) && !errors.Is(err, context.Canceled) {
		t.Fatalf("commit after the deadline: %v, want sql.ErrTxDone or context.Canceled", err)
	}
	if got := status(t, db, "slow"); got != "pending" {
		t.Fatalf("status %q, want pending (rolled back)", got)
	}
	return err
}

// A standby in recovery refuses BEGIN READ WRITE with 0A000 before any
// statement ran: that is the database, not the order.
func TestBeginErrorIsTransient(t *testing.T) {
	t.Parallel()
	err := &orders.BeginError{Err: &pq.Error{Code: "0A000", Message: "cannot set transaction read-write mode during recovery"}}
	if !orders.Transient(err) {
		t.Fatalf("Transient(%v) = false, want true", err)
	}
	if orders.Transient(&pq.Error{Code: "0A000", Message: "feature not supported"}) {
		t.Errorf("a statement's own 0A000 is not transient")
	}
}

// A statement timeout is the server's whatever language it speaks
// (lc_messages); a 57014 that came because the caller's context ended is
// the client's, and says nothing about the row.
func TestTimedOutIsTheServersWhateverItsLanguage(t *testing.T) {
	t.Parallel()
	german := &pq.Error{Severity: "ERROR", Code: "57014", Message: "storniere Anfrage wegen Zeitüberschreitung der Anfrage"}
	if !orders.TimedOut(german) || !orders.Contended(german) || !orders.Costly(german) {
		t.Errorf("a statement timeout in German: TimedOut %v, Contended %v, Costly %v; want all true",
			orders.TimedOut(german), orders.Contended(german), orders.Costly(german))
	}
	db, _ := testenv.Postgres(t)
	s := orders.NewStore(db, orders.Statements{
		Lookup: `SELECT s, true FROM unnest($1::text[]) s WHERE length(s) + (SELECT 0 FROM pg_sleep(5)) < 0`,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := s.Lookup(ctx, []string{"x"})
	if err == nil {
		t.Fatal("a five-second lookup under a 100 ms context returned no error")
	}
	if orders.TimedOut(err) || orders.Contended(err) || !orders.Transient(err) {
		t.Errorf("cut by the client's deadline (%v): TimedOut %v, Contended %v, Transient %v; want false, false, true",
			err, orders.TimedOut(err), orders.Contended(err), orders.Transient(err))
	}
}

// Answered: the server raised the error for a statement and the session
// lives on, whatever the error says; not a connection exception, not a
// FATAL, not a driver's or the network's error.
func TestAnsweredIsAnErrorTheSessionSurvives(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&pq.Error{Severity: "ERROR", Code: "25006"}, true},
		{&pq.Error{Severity: "ERROR", Code: "P0001"}, true},
		{fmt.Errorf("close: %w", &pq.Error{Severity: "ERROR", Code: "55000"}), true},
		{&pq.Error{Severity: "ERROR", Code: "08006"}, false},
		{&pq.Error{Severity: "FATAL", Code: "57P01"}, false},
		{&pq.Error{Severity: "PANIC", Code: "XX000"}, false},
		{driver.ErrBadConn, false},
		{io.EOF, false},
		{context.DeadlineExceeded, false},
		{nil, false},
	} {
		if got := orders.Answered(tc.err); got != tc.want {
			t.Errorf("Answered(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
