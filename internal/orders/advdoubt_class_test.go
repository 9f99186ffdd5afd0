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

	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// An InDoubtError says how many orders a COMMIT without an answer may have
// closed; it must not change what the error says about the database or
// the batch. Every predicate the consumer's failure path (failed,
// oneByOne, split) and the reconciler's page handling consult answers the
// same for the error in doubt as for the bare COMMIT error, also wrapped
// as the callers wrap it (clientCut's context error, the reconciler's
// "reconcile commit: %w").
func TestInDoubtKeepsTheCommitErrorsClassification(t *testing.T) {
	t.Parallel()
	pqe := func(code, sev string) *pq.Error { return &pq.Error{Code: pq.ErrorCode(code), Severity: sev} }
	causes := []error{
		driver.ErrBadConn, io.EOF, io.ErrUnexpectedEOF, sql.ErrTxDone, sql.ErrConnDone,
		context.DeadlineExceeded, context.Canceled,
		&net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET},
		pqe("57014", "ERROR"), fmt.Errorf("%w: %w", context.DeadlineExceeded, pqe("57014", "ERROR")),
		pqe("55P03", "ERROR"), pqe("40001", "ERROR"), pqe("40P01", "ERROR"), pqe("57P01", "FATAL"),
		pqe("08006", "ERROR"), pqe("23505", "ERROR"), pqe("40002", "ERROR"), pqe("P0001", "ERROR"),
		pqe("53100", "ERROR"), errors.New("unexpected command tag ROLLBACK"), pq.ErrInFailedTransaction,
	}
	type verdict struct {
		transient, unavailable, contended, costly, timedOut, rowLocked, cut, begin, fence, stale bool
	}
	judge := func(err error) verdict {
		return verdict{orders.Transient(err), orders.Unavailable(err), orders.Contended(err), orders.Costly(err),
			orders.TimedOut(err), orders.RowLocked(err), orders.CutWhileRunning(err),
			errors.As(err, new(*orders.BeginError)), errors.As(err, new(*orders.FenceError)), orders.StalePlan(err)}
	}
	for _, cause := range causes {
		doubt := &orders.InDoubtError{Err: cause, Orders: 3}
		for _, wrap := range []func(error) error{
			func(e error) error { return e },
			func(e error) error { return fmt.Errorf("%w: %w", context.DeadlineExceeded, e) },
			func(e error) error { return fmt.Errorf("reconcile commit: %w", e) },
		} {
			if got, want := judge(wrap(doubt)), judge(wrap(cause)); got != want {
				t.Errorf("%v in doubt is judged %+v, bare %+v", wrap(cause), got, want)
			}
			if n := orders.InDoubt(wrap(doubt)); n != 3 {
				t.Errorf("InDoubt(%v) = %d, want 3", wrap(doubt), n)
			}
			if n := orders.InDoubt(wrap(cause)); n != 0 {
				t.Errorf("InDoubt(%v) = %d, want 0", wrap(cause), n)
			}
		}
	}
}
