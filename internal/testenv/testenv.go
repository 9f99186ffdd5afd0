// Package testenv gives tests their own slice of the real Redis and
// PostgreSQL servers: a queue key nobody else uses (deleted afterwards) and a
// private database cloned from a migrated template (dropped afterwards), so
// tests run in parallel and leave nothing behind. It never flushes, stops or
// reconfigures the servers it is pointed at.
//
//	ORDERDELAY_TEST_REDIS_URL     default redis://127.0.0.1:6379/0
//	ORDERDELAY_TEST_DATABASE_URL  default postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable
//	                              (a role that may CREATE DATABASE)
package testenv

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // the PostgreSQL driver
	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// RedisURL is the Redis the tests use.
func RedisURL() string {
	if u := os.Getenv("ORDERDELAY_TEST_REDIS_URL"); u != "" {
		return u
	}
	return "redis://127.0.0.1:6379/0"
}

// AdminURL is the PostgreSQL database tests connect to for CREATE DATABASE.
func AdminURL() string {
	if u := os.Getenv("ORDERDELAY_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// Name returns a short unique name derived from the test's name.
func Name(t testing.TB) string {
	b := make([]byte, 4)
	rand.Read(b)
	n := strings.ToLower(regexp.MustCompile(`[^a-zA-Z0-9]+`).ReplaceAllString(t.Name(), "_"))
	if len(n) > 30 {
		n = n[:30]
	}
	return n + "_" + hex.EncodeToString(b)
}

// Redis returns a client and a queue key of the test's own. The queue's
// keys are deleted when the test ends.
func Redis(t testing.TB) (*redis.Client, queue.Keys) {
	t.Helper()
	o, err := redis.ParseURL(RedisURL())
	if err != nil {
		t.Fatalf("ORDERDELAY_TEST_REDIS_URL: %v", err)
	}
	rdb := redis.NewClient(o)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("redis at %s: %v (run ./scripts/test.sh, which starts one)", RedisURL(), err)
	}
	keys := queue.NewKeys("test:" + Name(t) + ":order")
	t.Cleanup(func() {
		DeleteQueue(rdb, keys)
		rdb.Close()
	})
	return rdb, keys
}

// DeleteQueue deletes every key of a queue.
func DeleteQueue(rdb redis.Cmdable, k queue.Keys) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rdb.Del(ctx, k.Queue, k.Inflight, k.Deadlines, k.Lease, k.Leases, k.LeaseBatch, k.Dead, k.DeadInfo, k.Paused, k.Events,
		k.Payload, k.Stream, k.Ready, k.Processing, k.Unacked, k.Taken, k.Deliveries, k.DeliveryIDs, k.DeliverySeq, k.Name, k.Meta)
}

// Postgres returns a migrated database of the test's own and its URL. The
// database is dropped when the test ends.
func Postgres(t testing.TB) (*sqlx.DB, string) {
	t.Helper()
	_, dsn := CreateDatabase(t)
	db, err := sqlx.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, dsn
}

// PostgresViaProxy returns a migrated database of the test's own, reached
// directly (db, for the test's own checks) and through a Proxy the test
// owns: a pool on it (via) and its URL (dsn), for outages and stalls. Both
// pools close and the database is dropped when the test ends.
func PostgresViaProxy(t testing.TB) (db, via *sqlx.DB, dsn string, px *Proxy) {
	t.Helper()
	db, direct := Postgres(t)
	u, err := url.Parse(direct)
	if err != nil {
		t.Fatal(err)
	}
	px = NewProxy(t, u.Host)
	u.Host = px.Addr()
	dsn = u.String()
	if via, err = sqlx.Open("postgres", dsn); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { via.Close() })
	return db, via, dsn, px
}

// CreateDatabase clones the migrated template into a new database, drops it
// at cleanup, and returns its name and URL.
func CreateDatabase(t testing.TB) (string, string) {
	t.Helper()
	admin, err := sql.Open("postgres", AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := admin.PingContext(ctx); err != nil {
		t.Fatalf("postgresql at %s: %v (run ./scripts/test.sh, which starts one)", AdminURL(), err)
	}
	tmpl, err := template(ctx, admin)
	if err != nil {
		t.Fatalf("template database: %v", err)
	}
	name := "odtest_" + Name(t)
	if _, err := admin.ExecContext(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, tmpl)); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := sql.Open("postgres", AdminURL())
		if err != nil {
			return
		}
		defer admin.Close()
		if _, err := admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Logf("drop database %s: %v", name, err)
		}
	})
	return name, DatabaseURL(name)
}

// DatabaseURL is AdminURL pointed at database name.
func DatabaseURL(name string) string {
	u, err := url.Parse(AdminURL())
	if err != nil {
		return AdminURL() + " dbname=" + name
	}
	u.Path = "/" + name
	return u.String()
}

// template makes sure a migrated template database exists for the current
// migrations (named by their hash) and returns its name. Concurrent test
// processes serialise on an advisory lock.
func template(ctx context.Context, admin *sql.DB) (string, error) {
	h := sha256.New()
	err := fs.WalkDir(orders.MigrationFiles(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(orders.MigrationFiles(), p)
		h.Write([]byte(p))
		h.Write(b)
		return err
	})
	if err != nil {
		return "", err
	}
	name := "odtmpl_" + hex.EncodeToString(h.Sum(nil))[:16]
	conn, err := admin.Conn(ctx)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "SELECT pg_advisory_lock(781234501)"); err != nil {
		return "", err
	}
	defer conn.ExecContext(context.Background(), "SELECT pg_advisory_unlock(781234501)") //nolint:errcheck
	var exists bool
	if err := conn.QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return "", err
	}
	if exists {
		return name, nil
	}
	build := name + "_build"
	conn.ExecContext(ctx, "DROP DATABASE IF EXISTS "+build+" WITH (FORCE)") //nolint:errcheck // leftover of a crash
	if _, err := conn.ExecContext(ctx, "CREATE DATABASE "+build); err != nil {
		return "", err
	}
	if _, err := orders.Migrate(DatabaseURL(build)); err != nil {
		return "", err
	}
	// Rename only once complete, so a half-built template is never used.
	// The migration's connection may take a moment to go away.
	for try := 0; ; try++ {
		_, err := conn.ExecContext(ctx, fmt.Sprintf("ALTER DATABASE %s RENAME TO %s", build, name))
		if err == nil {
			return name, nil
		}
		if try == 50 {
			return "", err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// CheckNoKeysLeft fails the test if, once every cleanup registered after
// it has run, Redis still holds a key matching the glob pattern: call it
// before registering the cleanups that delete the test's keys.
func CheckNoKeysLeft(t testing.TB, rdb redis.Cmdable, pattern string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var left []string
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			left = append(left, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Errorf("cleanup check: scan %s: %v", pattern, err)
			return
		}
		if len(left) > 0 {
			t.Errorf("cleanup left %d key(s) matching %s in the shared Redis: %v", len(left), pattern, left)
		}
	})
}

// RaceEnabled reports whether this test binary is race-instrumented:
// tests that pin allocation counts skip then (sync.Pool drops what it is
// given at random under the race detector).
const RaceEnabled = raceEnabled
