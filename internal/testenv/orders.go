package testenv

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Env is one test's slice of the real servers in the tests of the packages
// that close orders (consumer, maintain), whose own env types embed it: a
// queue's keys on Redis and, once the test gives it one (Postgres,
// PostgresViaProxy), a database of its own with the reference orders table
// and an order store on it. Its methods are the fixtures on them, written
// once for both packages.
type Env struct {
	T     testing.TB
	RDB   *redis.Client
	Keys  queue.Keys
	DB    *sqlx.DB      // direct: the test's own checks
	Store *orders.Store // the code under test's
}

// NewEnv is an Env on a queue key of the test's own (Redis), without a
// database yet.
func NewEnv(t testing.TB) Env {
	t.Helper()
	rdb, keys := Redis(t)
	return Env{T: t, RDB: rdb, Keys: keys}
}

// Postgres gives e a database of the test's own (see the function Postgres)
// and an order store with stmts on it.
func (e *Env) Postgres(stmts orders.Statements) {
	e.T.Helper()
	e.DB, _ = Postgres(e.T)
	e.Store = orders.NewStore(e.DB, stmts)
}

// PostgresViaProxy gives e a database of the test's own, reached directly
// by e.DB and through the returned Proxy, which the test controls, by
// e.Store (with stmts): see the function PostgresViaProxy.
func (e *Env) PostgresViaProxy(stmts orders.Statements) *Proxy {
	e.T.Helper()
	db, via, _, px := PostgresViaProxy(e.T)
	e.DB, e.Store = db, orders.NewStore(via, stmts)
	return px
}

// Orders inserts n pending orders named prefix-0000i with the given
// deadline and returns their serials.
func (e *Env) Orders(prefix string, n int, deadline time.Time) []string {
	e.T.Helper()
	serials := make([]string, n)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	_, err := e.DB.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT s, $2 FROM unnest($1::text[]) s`,
		pq.Array(serials), deadline)
	if err != nil {
		e.T.Fatal(err)
	}
	return serials
}

// Status is the status of serial's row.
func (e *Env) Status(serial string) string {
	e.T.Helper()
	var s string
	if err := e.DB.Get(&s, "SELECT status FROM orders WHERE serial_no = $1", serial); err != nil {
		e.T.Fatal(err)
	}
	return s
}

// StatusCounts is how many rows have each status.
func (e *Env) StatusCounts() map[string]int {
	e.T.Helper()
	rows, err := e.DB.Query("SELECT status, count(*) FROM orders GROUP BY status")
	if err != nil {
		e.T.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			e.T.Fatal(err)
		}
		out[s] = n
	}
	return out
}

// CloseTrigger makes every close of an order row matching when (an SQL
// condition on NEW) run action (PL/pgSQL) first.
func (e *Env) CloseTrigger(name, when, action string) {
	e.T.Helper()
	_, err := e.DB.Exec(`CREATE FUNCTION ` + name + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND (` + when + `) THEN
    ` + action + `;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER ` + name + ` BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION ` + name + `();`)
	if err != nil {
		e.T.Fatal(err)
	}
}

// FailClose makes every close of serial raise SQLSTATE code (the trigger
// refuse_close); the sequence close_failures counts the attempts (nextval
// survives the rollback): CloseFailures.
func (e *Env) FailClose(serial, code string) {
	e.T.Helper()
	_, err := e.DB.Exec(`CREATE SEQUENCE close_failures;
CREATE FUNCTION refuse_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND NEW.serial_no = '` + serial + `' THEN
    PERFORM nextval('close_failures');
    RAISE EXCEPTION 'shop trigger: order % cannot be closed', NEW.serial_no USING ERRCODE = '` + code + `';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER refuse_close BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION refuse_close();`)
	if err != nil {
		e.T.Fatal(err)
	}
}

// PoisonOrder makes the close of serial fail with an error about its data,
// as a shop's trigger that refuses it would (FailClose with P0001).
func (e *Env) PoisonOrder(serial string) {
	e.T.Helper()
	e.FailClose(serial, "P0001")
}

// CloseFailures is how many times a close of the FailClose serial ran.
func (e *Env) CloseFailures() int {
	e.T.Helper()
	return e.sequenceValue("close_failures")
}

// SlowCloseOf makes the close of serial sleep for five seconds (a shop's
// trigger calling out, a hot row): any short statement timeout cuts the
// statement that closes it, and only that one.
func (e *Env) SlowCloseOf(serial string) {
	e.T.Helper()
	e.CloseTrigger("slow_close", "NEW.serial_no = '"+serial+"'", "PERFORM pg_sleep(5)")
}

// SlowEveryClose makes every close sleep five seconds and counts the
// statements that reached a row (each is cut on its first row):
// SlowCloses.
func (e *Env) SlowEveryClose() {
	e.T.Helper()
	if _, err := e.DB.Exec(`CREATE SEQUENCE slow_closes`); err != nil {
		e.T.Fatal(err)
	}
	e.CloseTrigger("slow_close", "true", "PERFORM nextval('slow_closes'); PERFORM pg_sleep(5)")
}

// SlowCloses is how many statements SlowEveryClose's trigger held.
func (e *Env) SlowCloses() int {
	e.T.Helper()
	return e.sequenceValue("slow_closes")
}

func (e *Env) sequenceValue(seq string) int {
	e.T.Helper()
	var n int
	if err := e.DB.Get(&n, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM `+seq); err != nil {
		e.T.Fatal(err)
	}
	return n
}

// Enqueue ZADDs serials to e's queue with deadline, as a raw producer
// would.
func (e *Env) Enqueue(serials []string, deadline time.Time) {
	e.T.Helper()
	e.ZAdd(e.Keys.Queue, serials, deadline)
}

// ZAdd ZADDs serials to key with deadline.
func (e *Env) ZAdd(key string, serials []string, deadline time.Time) {
	e.T.Helper()
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(deadline)), Member: s}
	}
	if err := e.RDB.ZAdd(context.Background(), key, z...).Err(); err != nil {
		e.T.Fatal(err)
	}
}

// ShardKeys returns e's keys and shards shard keys of its queue; the
// shards' keys are deleted when the test ends.
func (e *Env) ShardKeys(shards int) []queue.Keys {
	e.T.Helper()
	all := append([]queue.Keys{e.Keys}, queue.ShardKeys(e.Keys.Queue, shards)...)
	e.T.Cleanup(func() {
		for _, k := range all[1:] {
			DeleteQueue(e.RDB, k)
		}
	})
	return all
}

// RedisNow is Redis's clock.
func (e *Env) RedisNow() time.Time {
	e.T.Helper()
	now, err := e.RDB.Time(context.Background()).Result()
	if err != nil {
		e.T.Fatal(err)
	}
	return now
}
