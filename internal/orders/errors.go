package orders

import (
	"context"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"syscall"

	"github.com/lib/pq"
)

// Transient reports whether err is worth retrying without spending an
// attempt: the connection was lost or refused, or PostgreSQL reported a
// serialization failure (40001), a deadlock (40P01), a statement timeout or
// cancellation (57014), or that it is shutting down or not accepting
// connections (class 08, 57P01–57P03, 53300 too many connections). A
// context deadline is transient too: the batch ran out of time, not input.
// Anything else is permanent for the statement and input that caused it.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	var pqErr *pq.Error
	if errors.As(err, &pqErr) {
		switch pqErr.Code {
		case "40001", "40P01", "57014", "57P01", "57P02", "57P03", "53300", "53400":
			return true
		}
		return pqErr.Code.Class() == "08"
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var opErr *net.OpError
	return errors.As(err, &opErr)
}

// RowLocked reports whether err is 55P03 lock_not_available: a row stayed
// locked longer than lock_timeout. The database is fine; one row is held
// (a payment in progress, a stuck transaction of the shop's), so the
// consumer isolates that row instead of retrying its whole batch.
func RowLocked(err error) bool {
	var pqErr *pq.Error
	return errors.As(err, &pqErr) && pqErr.Code == "55P03"
}
