package e2e

// The orders table and its queue: creating and enqueueing orders, the
// audit every test ends with (nothing closed early, twice or after its
// payment; nothing unpaid left pending), and the checkout producer loop.

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// createOrders inserts n pending orders prefix-00000… with one deadline
// (none of them enqueued).
func (w *world) createOrders(prefix string, n int, deadline time.Time) []string {
	w.t.Helper()
	serials := make([]string, n)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	if err := insertOrders(w.db, serials, deadline); err != nil {
		w.t.Fatal(err)
	}
	return serials
}

// insertOrders inserts pending orders with one deadline through q: the
// world's database, a checkout's own connections, or a transaction that
// commits later.
func insertOrders(q sqlx.Execer, serials []string, deadline time.Time) error {
	_, err := q.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT s, $2 FROM unnest($1::text[]) s`,
		pq.Array(serials), deadline)
	return err
}

// spread creates n orders with deadlines spread evenly over [from,
// from+span) and enqueues each (raw ZADD) at its deadline.
func (w *world) spread(prefix string, n int, from time.Time, span time.Duration) []string {
	w.t.Helper()
	serials := make([]string, n)
	deadlines := make([]time.Time, n)
	z := make([]redis.Z, n)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s-%06d", prefix, i)
		deadlines[i] = from.Add(span * time.Duration(i) / time.Duration(n))
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(deadlines[i])), Member: serials[i]}
	}
	if _, err := w.db.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT * FROM unnest($1::text[], $2::timestamptz[])`,
		pq.Array(serials), pq.Array(deadlines)); err != nil {
		w.t.Fatal(err)
	}
	ctx := context.Background()
	for i := 0; i < n; i += 5000 {
		if err := w.rdb.ZAdd(ctx, w.keys.Queue, z[i:min(i+5000, n)]...).Err(); err != nil {
			w.t.Fatal(err)
		}
	}
	return serials
}

// zadd enqueues serials by raw ZADD with one score (milliseconds, unless a
// test means to get it wrong).
func (w *world) zadd(serials []string, score float64) {
	w.t.Helper()
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: score, Member: s}
	}
	if err := w.rdb.ZAdd(context.Background(), w.keys.Queue, z...).Err(); err != nil {
		w.t.Fatal(err)
	}
}

// pay marks serials paid, as a checkout's payment does (the queue entries
// stay: the close statement decides).
func (w *world) pay(serials []string) {
	w.t.Helper()
	if _, err := w.db.Exec("UPDATE orders SET status = 'paid', paid_at = now() WHERE serial_no = ANY($1)", pq.Array(serials)); err != nil {
		w.t.Fatal(err)
	}
}

// count runs a query returning one number.
func (w *world) count(query string, args ...any) int {
	w.t.Helper()
	var n int
	if err := w.db.Get(&n, query, args...); err != nil {
		w.t.Fatal(err)
	}
	return n
}

// closed is the number of closed orders.
func (w *world) closed() int {
	w.t.Helper()
	return w.count("SELECT count(*) FROM orders WHERE status = 'closed'")
}

// status is one order's status.
func (w *world) status(serial string) string {
	w.t.Helper()
	var s string
	if err := w.db.Get(&s, "SELECT status FROM orders WHERE serial_no = $1", serial); err != nil {
		w.t.Fatal(err)
	}
	return s
}

// queueLen is the number of entries queued or leased.
func (w *world) queueLen() int64 {
	w.t.Helper()
	n, err := w.rdb.ZCard(context.Background(), w.keys.Queue).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	return n + held(w.t, w.rdb, w.keys)
}

// held counts a queue's entries leased or backing off, whichever the lease
// (a claim's batch lease, or an entry's own: see queue's lease.go).
func held(t testing.TB, rdb redis.Scripter, k queue.Keys) int64 {
	t.Helper()
	st, err := queue.ReadStats(context.Background(), rdb, k)
	if err != nil {
		t.Fatal(err)
	}
	return st.Held
}

// inRedis returns the serials in the queue key or leased (queued, claimed
// or backing off): those the fast path may still close.
func (w *world) inRedis() map[string]bool {
	w.t.Helper()
	ctx := context.Background()
	queued, err := w.rdb.ZRange(ctx, w.keys.Queue, 0, -1).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	leased, err := w.rdb.HKeys(ctx, w.keys.Lease).Result()
	if err != nil {
		w.t.Fatal(err)
	}
	out := map[string]bool{}
	for _, s := range append(queued, leased...) {
		out[s] = true
	}
	return out
}

// checkInvariants: every unpaid order past its deadline is closed, no paid
// order is closed, nothing closed before its deadline.
func (w *world) checkInvariants() {
	w.t.Helper()
	if n := w.count("SELECT count(*) FROM orders WHERE status = 'pending' AND expires_at < now()"); n != 0 {
		w.t.Errorf("%d unpaid orders past their deadline are still pending", n)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE paid_at IS NOT NULL AND status <> 'paid'"); n != 0 {
		w.t.Errorf("%d paid orders were closed", n)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE closed_at < expires_at"); n != 0 {
		w.t.Errorf("%d orders closed before their deadline", n)
	}
}

// auditClose closes like the reference statement and records every close
// in close_audit (withAudit) with the closing replica's application_name,
// so a double close shows. Give it to a daemon as ORDERDELAY_CLOSE_SQL.
const auditClose = `WITH due AS (
    SELECT serial_no FROM orders WHERE serial_no = ANY($1) AND status = 'pending'
    ORDER BY serial_no FOR UPDATE),
` + auditCloseRest

// slowAuditClose is auditClose behind a 0.3 s pause per statement: a slow
// database.
const slowAuditClose = `WITH pause AS (SELECT pg_sleep(0.3)),
due AS (
    SELECT serial_no FROM orders, pause WHERE serial_no = ANY($1) AND status = 'pending'
    ORDER BY serial_no FOR UPDATE OF orders),
` + auditCloseRest

// auditCloseRest closes the rows of due and audits each close.
const auditCloseRest = `closed AS (
    UPDATE orders o SET status = 'closed', closed_at = now(), closed_by = current_setting('application_name')
    FROM due WHERE o.serial_no = due.serial_no AND o.status = 'pending'
    RETURNING o.serial_no),
audit AS (
    INSERT INTO close_audit (serial_no, replica) SELECT serial_no, current_setting('application_name') FROM closed)
SELECT serial_no FROM closed`

// withAudit creates the close_audit table auditClose writes to.
func (w *world) withAudit() {
	w.t.Helper()
	if _, err := w.db.Exec("CREATE TABLE close_audit (serial_no text NOT NULL, replica text NOT NULL, at timestamptz DEFAULT now())"); err != nil {
		w.t.Fatal(err)
	}
}

// doubleCloses is the number of orders close_audit saw closed more than once.
func (w *world) doubleCloses() int {
	w.t.Helper()
	return w.count("SELECT count(*) FROM (SELECT serial_no FROM close_audit GROUP BY serial_no HAVING count(*) > 1) d")
}

// lateness returns p50 and p99 of closed_at - expires_at over the closed
// orders whose serial is LIKE like.
func (w *world) lateness(like string) (p50, p99 time.Duration) {
	w.t.Helper()
	var a, b float64
	err := w.db.QueryRow(`SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM closed_at - expires_at)),
	        percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM closed_at - expires_at))
	 FROM orders WHERE status = 'closed' AND serial_no LIKE $1`, like).Scan(&a, &b)
	if err != nil {
		w.t.Fatal(err)
	}
	return time.Duration(a * float64(time.Second)), time.Duration(b * float64(time.Second))
}

// moveDeadlines sets every order's deadline to at: the rows first, then
// each of keys (ZADD XX: only members already there), as a checkout that
// moves deadlines does. Timing tests set up against a far deadline and move
// it near at the end, so a slow machine cannot eat their payment window.
func moveDeadlines(t *testing.T, db *sqlx.DB, rdb redis.Cmdable, keys, serials []string, at time.Time) {
	t.Helper()
	if _, err := db.Exec("UPDATE orders SET expires_at = $1", at); err != nil {
		t.Fatal(err)
	}
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(at)), Member: s}
	}
	for _, k := range keys {
		if err := rdb.ZAddXX(context.Background(), k, z...).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// closedSerials returns the set of closed orders in the database at dsn.
func closedSerials(t *testing.T, dsn string) map[string]bool {
	t.Helper()
	db, err := sqlx.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var serials []string
	if err := db.Select(&serials, "SELECT serial_no FROM orders WHERE status = 'closed'"); err != nil {
		t.Fatal(err)
	}
	out := make(map[string]bool, len(serials))
	for _, s := range serials {
		out[s] = true
	}
	return out
}

// inParallel runs fn(0) … fn(n-1), width at a time.
func inParallel(n, width int, fn func(i int)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, width)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			fn(i)
		}()
	}
	wg.Wait()
}

// putTimeouts enqueues every serial through the HTTP API (PUT
// /v1/timeouts/{serial} with deadline at), round robin over ds, 16
// requests at a time, and fails the test for any answer but 201 Created.
func putTimeouts(t *testing.T, ds []*daemon, serials []string, at time.Time) {
	t.Helper()
	body := `{"at":"` + at.UTC().Format(time.RFC3339Nano) + `"}`
	inParallel(len(serials), 16, func(i int) {
		code, b, err := ds[i%len(ds)].try(context.Background(), http.MethodPut, "/v1/timeouts/"+serials[i], "", body)
		if err != nil || code != http.StatusCreated {
			t.Errorf("PUT %s: status %d (%v) %s, want 201", serials[i], code, err, b)
		}
	})
}

// checkout is the producer loop of a live shop: every tick it commits a
// batch of orders due a second later and hands them to its enqueue, until
// stopped.
type checkout struct {
	stopped  chan struct{}
	done     chan struct{}
	once     sync.Once
	produced atomic.Int64 // orders committed and handed to enqueue without error
}

// startCheckout runs the producer loop: every tick, batch orders
// prefix-NNNNN-J, committed with a deadline one second ahead, then
// enqueue(serials, deadline). An error from the insert or from enqueue
// fails the test and ends the loop. It is stopped at the end of the test
// at the latest.
func (w *world) startCheckout(prefix string, tick time.Duration, batch int, enqueue func(serials []string, due time.Time) error) *checkout {
	c := &checkout{stopped: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		for i := 0; ; i++ {
			select {
			case <-c.stopped:
				return
			case <-time.After(tick):
			}
			due := time.Now().Add(time.Second)
			serials := make([]string, batch)
			for j := range serials {
				serials[j] = fmt.Sprintf("%s-%05d-%d", prefix, i, j)
			}
			if err := insertOrders(w.db, serials, due); err != nil {
				w.t.Error(err)
				return
			}
			if err := enqueue(serials, due); err != nil {
				w.t.Error(err)
				return
			}
			c.produced.Add(int64(batch))
		}
	}()
	w.t.Cleanup(func() { c.stop() })
	return c
}

// stop ends the loop, waits for its last batch, and returns the orders it
// produced.
func (c *checkout) stop() int64 {
	c.once.Do(func() { close(c.stopped) })
	<-c.done
	return c.produced.Load()
}
