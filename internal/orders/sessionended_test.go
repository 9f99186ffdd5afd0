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

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// SessionEnded tells a statement whose session ended under it (the
// connection broke, the server sent FATAL) from everything the caller's
// context caused, everything before a statement ran, and every error
// the server answered on a live session.
func TestSessionEndedByWhatTheErrorSays(t *testing.T) {
	t.Parallel()
	timeout := &net.OpError{Op: "read", Net: "tcp", Err: timeoutErr{}}
	for _, tt := range []struct {
		name string
		err  error
		want bool
	}{
		{"driver.ErrBadConn", driver.ErrBadConn, true},
		{"io.EOF", io.EOF, true},
		{"io.ErrUnexpectedEOF", io.ErrUnexpectedEOF, true},
		{"connection reset", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, true},
		{"broken pipe", syscall.EPIPE, true},
		{"sql.ErrConnDone", sql.ErrConnDone, true},
		{"FATAL admin shutdown (pg_terminate_backend)", &pq.Error{Code: "57P01", Severity: "FATAL"}, true},
		{"PANIC", &pq.Error{Code: "XX000", Severity: "PANIC"}, true},
		{"connection exception (08006), FATAL", &pq.Error{Code: "08006", Severity: "FATAL"}, true},
		{"class 08 a trigger raised (an ERROR: the session lives on)", &pq.Error{Code: "08006", Severity: "ERROR"}, false},

		{"nil", nil, false},
		{"context deadline", context.DeadlineExceeded, false},
		{"context canceled", context.Canceled, false},
		{"cut at the context's deadline while reading", fmt.Errorf("%w (%w)", driver.ErrBadConn, context.DeadlineExceeded), false},
		{"a client read timeout", timeout, false},
		{"sql.ErrTxDone (the context ended the transaction)", sql.ErrTxDone, false},
		{"begin", &orders.BeginError{Err: driver.ErrBadConn}, false},
		{"connect", &orders.ConnectError{Err: io.EOF}, false},
		{"statement timeout (answered)", &pq.Error{Code: "57014", Severity: "ERROR"}, false},
		{"read-only (answered)", &pq.Error{Code: "25006", Severity: "ERROR"}, false},
		{"a trigger's RAISE (answered)", &pq.Error{Code: "P0001", Severity: "ERROR"}, false},
		{"no code, no severity (does not panic)", &pq.Error{}, false},
		{"something else", errors.New("something else"), false},
		{"a bad result", fmt.Errorf("%w: NULL serial", orders.ErrBadResult), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := orders.SessionEnded(tt.err); got != tt.want {
				t.Errorf("SessionEnded(%#v) = %v, want %v", tt.err, got, tt.want)
			}
			if tt.err != nil {
				if got := orders.SessionEnded(fmt.Errorf("close: %w", tt.err)); got != tt.want {
					t.Errorf("SessionEnded(wrapped %v) = %v, want %v", tt.err, got, tt.want)
				}
			}
		})
	}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

// On the real server: a close whose statement ends its own backend (a
// shop's trigger) returns a SessionEndedError, still Transient; one whose
// session ends only at COMMIT (a deferred constraint trigger that ends it)
// does not — nothing about the close statement's rows said so, and an
// outcome the server may have written is the in-doubt path's to settle —
// and a rollback by an answered error is neither. Both forms of the close
// (the one statement and a custom close statement).
func TestSettleMarksASessionEndedByItsOwnStatement(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		stmts orders.Statements
	}{
		{"one statement", orders.Statements{}},
		{"custom close", orders.Statements{Close: `UPDATE orders SET status = 'closed', closed_at = now(), close_reason = 'timeout'
			WHERE serial_no = ANY($1) AND status = 'pending' RETURNING serial_no`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db, _ := testenv.Postgres(t)
			insert(t, db, order{"kill", "pending", -time.Minute}, order{"late", "pending", -time.Minute},
				order{"good", "pending", -time.Minute})
			db.MustExec(`CREATE FUNCTION kill_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no IN ('kill', 'late') THEN
    PERFORM pg_terminate_backend(pg_backend_pid());
  END IF;
  RETURN NEW;
END $$`)
			db.MustExec(`CREATE TRIGGER kill_now BEFORE UPDATE ON orders FOR EACH ROW
  WHEN (NEW.serial_no = 'kill') EXECUTE FUNCTION kill_close()`)
			db.MustExec(`CREATE CONSTRAINT TRIGGER kill_at_commit AFTER UPDATE ON orders DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW WHEN (NEW.serial_no = 'late') EXECUTE FUNCTION kill_close()`)
			s := orders.NewStore(db, tc.stmts)
			ctx := ctxT(t)

			_, err := s.Settle(ctx, []string{"good", "kill"}, nil)
			var se *orders.SessionEndedError
			if !errors.As(err, &se) || !orders.Transient(err) {
				t.Errorf("close whose statement ends its session: %v (%T); want a Transient *orders.SessionEndedError", err, err)
			}
			_, err = s.Settle(ctx, []string{"good", "late"}, nil)
			if err == nil || errors.As(err, &se) {
				t.Errorf("close whose session ends at COMMIT: %v (%T); want an error that is not a SessionEndedError", err, err)
			}
			for _, serial := range []string{"kill", "good"} {
				if st := status(t, db, serial); st != "pending" {
					t.Errorf("%s is %s after its batch's session ended, want pending", serial, st)
				}
			}
			if err := s.Ping(ctx); err != nil {
				t.Errorf("Ping after two sessions ended: %v, want the database answering", err)
			}
		})
	}
}
