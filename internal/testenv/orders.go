package testenv

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Fixtures on the reference orders table and a queue's keys, shared by the
// tests of the packages that close orders (consumer, maintain).

// InsertOrders inserts n pending orders named prefix-0000i with the given
// deadline and returns their serials.
func InsertOrders(t testing.TB, db *sqlx.DB, prefix string, n int, deadline time.Time) []string {
	t.Helper()
	serials := make([]string, n)
	for i := range serials {
		serials[i] = fmt.Sprintf("%s-%05d", prefix, i)
	}
	_, err := db.Exec(`INSERT INTO orders (serial_no, expires_at) SELECT s, $2 FROM unnest($1::text[]) s`,
		pq.Array(serials), deadline)
	if err != nil {
		t.Fatal(err)
	}
	return serials
}

// OrderStatus is the status of serial's row.
func OrderStatus(t testing.TB, db *sqlx.DB, serial string) string {
	t.Helper()
	var s string
	if err := db.Get(&s, "SELECT status FROM orders WHERE serial_no = $1", serial); err != nil {
		t.Fatal(err)
	}
	return s
}

// CloseTrigger makes every close of an order row matching when (an SQL
// condition on NEW) run action (PL/pgSQL) first.
func CloseTrigger(t testing.TB, db *sqlx.DB, name, when, action string) {
	t.Helper()
	_, err := db.Exec(`CREATE FUNCTION ` + name + `() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'closed' AND (` + when + `) THEN
    ` + action + `;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER ` + name + ` BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION ` + name + `();`)
	if err != nil {
		t.Fatal(err)
	}
}

// FailClose makes every close of serial raise SQLSTATE code (the trigger
// refuse_close); the sequence close_failures counts the attempts (nextval
// survives the rollback): CloseFailures.
func FailClose(t testing.TB, db *sqlx.DB, serial, code string) {
	t.Helper()
	_, err := db.Exec(`CREATE SEQUENCE close_failures;
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
		t.Fatal(err)
	}
}

// PoisonOrder makes the close of serial fail with an error about its data,
// as a shop's trigger that refuses it would (FailClose with P0001).
func PoisonOrder(t testing.TB, db *sqlx.DB, serial string) {
	t.Helper()
	FailClose(t, db, serial, "P0001")
}

// CloseFailures is how many times a close of the FailClose serial ran.
func CloseFailures(t testing.TB, db *sqlx.DB) int {
	t.Helper()
	return sequenceValue(t, db, "close_failures")
}

// SlowCloseOf makes the close of serial sleep for five seconds (a shop's
// trigger calling out, a hot row): any short statement timeout cuts the
// statement that closes it, and only that one.
func SlowCloseOf(t testing.TB, db *sqlx.DB, serial string) {
	t.Helper()
	CloseTrigger(t, db, "slow_close", "NEW.serial_no = '"+serial+"'", "PERFORM pg_sleep(5)")
}

// SlowEveryClose makes every close sleep five seconds and counts the
// statements that reached a row (each is cut on its first row):
// SlowCloses.
func SlowEveryClose(t testing.TB, db *sqlx.DB) {
	t.Helper()
	if _, err := db.Exec(`CREATE SEQUENCE slow_closes`); err != nil {
		t.Fatal(err)
	}
	CloseTrigger(t, db, "slow_close", "true", "PERFORM nextval('slow_closes'); PERFORM pg_sleep(5)")
}

// SlowCloses is how many statements SlowEveryClose's trigger held.
func SlowCloses(t testing.TB, db *sqlx.DB) int {
	t.Helper()
	return sequenceValue(t, db, "slow_closes")
}

func sequenceValue(t testing.TB, db *sqlx.DB, seq string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM `+seq); err != nil {
		t.Fatal(err)
	}
	return n
}

// Enqueue ZADDs serials to key with deadline, as a raw producer would.
func Enqueue(t testing.TB, rdb redis.Cmdable, key string, serials []string, deadline time.Time) {
	t.Helper()
	z := make([]redis.Z, len(serials))
	for i, s := range serials {
		z[i] = redis.Z{Score: float64(queue.DeadlineMillis(deadline)), Member: s}
	}
	if err := rdb.ZAdd(context.Background(), key, z...).Err(); err != nil {
		t.Fatal(err)
	}
}

// ShardKeys returns keys and shards shard keys of its queue; the shards'
// keys are deleted when the test ends.
func ShardKeys(t testing.TB, rdb redis.Cmdable, keys queue.Keys, shards int) []queue.Keys {
	t.Helper()
	all := append([]queue.Keys{keys}, queue.ShardKeys(keys.Queue, shards)...)
	t.Cleanup(func() {
		for _, k := range all[1:] {
			DeleteQueue(rdb, k)
		}
	})
	return all
}

// RedisNow is Redis's clock.
func RedisNow(t testing.TB, rdb redis.Cmdable) time.Time {
	t.Helper()
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now
}
