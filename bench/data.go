package bench

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"time"

	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"
)

// orderSet is a batch of orders as the checkout created them: a serial, a
// deadline in Unix ms and whether the buyer paid (one in ten did).
type orderSet struct {
	Serials  []string
	Deadline []int64
	Paid     []bool
}

func (s *orderSet) Len() int { return len(s.Serials) }

func (s *orderSet) Unpaid() int {
	n := 0
	for _, p := range s.Paid {
		if !p {
			n++
		}
	}
	return n
}

// serial is 20 bytes, about what a real order number is.
func serial(tag string, i int) string { return fmt.Sprintf("ORD%s%014d", tag, i) }

// backlog returns n orders that expired during the last 30 s (the
// reconciler's grace is 5 minutes, so it never races the fast path).
func backlog(n int, now time.Time) *orderSet {
	s := &orderSet{Serials: make([]string, n), Deadline: make([]int64, n), Paid: make([]bool, n)}
	base := now.Add(-30 * time.Second).UnixMilli()
	for i := range n {
		s.Serials[i] = serial("B", i)
		s.Deadline[i] = base + int64(i)*29_000/int64(max(n, 1))
		s.Paid[i] = i%10 == 0
	}
	return s
}

// loadPG inserts the orders with COPY, then VACUUM ANALYZE so that no
// contender pays for hint bits, visibility map or statistics of a fresh table.
func loadPG(ctx context.Context, db *sql.DB, s *orderSet) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // after Commit it is a no-op
	st, err := tx.PrepareContext(ctx, pq.CopyIn("orders", "serial_no", "status", "expires_at", "paid_at"))
	if err != nil {
		return err
	}
	now := time.Now()
	for i, ser := range s.Serials {
		status, paidAt := "pending", any(nil)
		if s.Paid[i] {
			status, paidAt = "paid", now
		}
		if _, err := st.ExecContext(ctx, ser, status, time.UnixMilli(s.Deadline[i]), paidAt); err != nil {
			return err
		}
	}
	if _, err := st.ExecContext(ctx); err != nil {
		return err
	}
	if err := st.Close(); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	_, err = db.ExecContext(ctx, "VACUUM ANALYZE orders")
	return err
}

// insertOrders is what a checkout does at 1,000 orders/s: one multi-row
// INSERT per tick. Deadlines are exact milliseconds.
const insertOrdersSQL = `INSERT INTO orders (serial_no, status, expires_at, paid_at)
SELECT s, CASE WHEN p THEN 'paid' ELSE 'pending' END,
       'epoch'::timestamptz + d * interval '1 millisecond',
       CASE WHEN p THEN now() END
FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS t(s, d, p)`

func insertOrders(ctx context.Context, db *sql.DB, serials []string, deadlines []int64, paid []bool) error {
	_, err := db.ExecContext(ctx, insertOrdersSQL, pq.Array(serials), pq.Array(deadlines), pq.Array(paid))
	return err
}

// zaddAll writes the orders to key with pipelined ZADD NX (1,000 per
// pipeline), as a raw producer would.
func zaddAll(ctx context.Context, rdb *redis.Client, key string, s *orderSet, from, to int) error {
	for start := from; start < to; start += 1000 {
		end := min(start+1000, to)
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i := start; i < end; i++ {
				p.ZAddNX(ctx, key, redis.Z{Score: float64(s.Deadline[i]), Member: s.Serials[i]})
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// Verdict is the correctness check of one run, from the orders table.
type Verdict struct {
	Unpaid         int // orders that should be closed
	Closed         int // rows closed
	Reported       int // closes the contender reported (rows its statements changed)
	PaidClosed     int // paid orders closed: never allowed
	Early          int // closed before their deadline
	UnpaidLeft     int // unpaid orders still pending
	Complete       bool
	Violations     []string
	KnownDefect    bool      // violations expected of this contender (asynq's early closes)
	LatenessMillis []float64 `json:"-"` // sorted; plotted, summarized, not stored
}

// OK reports whether the run has no violation (known defects excepted).
func (v Verdict) OK() bool { return len(v.Violations) == 0 || v.KnownDefect }

// verify checks the run: every unpaid order closed once (when the run was
// meant to finish), no paid order closed, none closed before its deadline.
// "Closed once" compares the rows closed with the closes the contender
// reported: a second close of a row would count twice in the report but once
// in the table. (Every contender's statement is conditional on
// status = 'pending', so a second close changes nothing; this check catches a
// harness or contender that loses count.)
func verify(ctx context.Context, db *sql.DB, wantComplete bool, reported int, lateness bool) (Verdict, error) {
	var v Verdict
	err := db.QueryRowContext(ctx, `SELECT
	  count(*) FILTER (WHERE paid_at IS NULL),
	  count(*) FILTER (WHERE status = 'closed'),
	  count(*) FILTER (WHERE status = 'closed' AND paid_at IS NOT NULL),
	  count(*) FILTER (WHERE status = 'closed' AND closed_at < expires_at),
	  count(*) FILTER (WHERE status = 'pending')
	FROM orders`).Scan(&v.Unpaid, &v.Closed, &v.PaidClosed, &v.Early, &v.UnpaidLeft)
	if err != nil {
		return v, fmt.Errorf("verify: %w", err)
	}
	v.Reported = reported
	v.Complete = v.UnpaidLeft == 0
	if v.PaidClosed > 0 {
		v.Violations = append(v.Violations, fmt.Sprintf("%d paid orders closed", v.PaidClosed))
	}
	if v.Early > 0 {
		v.Violations = append(v.Violations, fmt.Sprintf("%d orders closed before their deadline", v.Early))
	}
	if wantComplete && v.UnpaidLeft > 0 {
		v.Violations = append(v.Violations, fmt.Sprintf("%d of %d unpaid orders not closed", v.UnpaidLeft, v.Unpaid))
	}
	if reported >= 0 && reported != v.Closed {
		v.Violations = append(v.Violations, fmt.Sprintf("contender reported %d closes, table has %d closed rows", reported, v.Closed))
	}
	if lateness {
		rows, err := db.QueryContext(ctx, `SELECT extract(epoch FROM closed_at - expires_at)::float8 * 1000
			FROM orders WHERE status = 'closed'`)
		if err != nil {
			return v, fmt.Errorf("lateness: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			var ms float64
			if err := rows.Scan(&ms); err != nil {
				return v, err
			}
			v.LatenessMillis = append(v.LatenessMillis, ms)
		}
		if err := rows.Err(); err != nil {
			return v, err
		}
		slices.Sort(v.LatenessMillis)
	}
	return v, nil
}

// quantile of sorted xs (nearest rank).
func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
