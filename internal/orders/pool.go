package orders

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"strconv"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
)

// PoolOptions configure a pool opened by Open.
type PoolOptions struct {
	// MaxConns bounds the pool (open and idle connections); at least 1.
	MaxConns int
	// StatementTimeout, if positive, is set as the server's
	// statement_timeout on every connection of the pool: a statement that
	// runs longer is cancelled BY THE SERVER (57014, nothing of it
	// committed), which is unambiguous, unlike a client deadline that may
	// fire after the server committed.
	StatementTimeout time.Duration
	// LockTimeout is set as lock_timeout on every connection: a statement
	// waiting longer for a lock (a row a payment holds) fails with 55P03 at
	// once instead of using up the statement timeout. Zero with a
	// StatementTimeout: LockTimeoutFor(StatementTimeout). Negative: not set.
	LockTimeout time.Duration
	// With a StatementTimeout, idle_in_transaction_session_timeout is set
	// to it too: a replica that stops between its close and its COMMIT
	// (a SIGSTOP, a GC pause, a partition) longer than that loses its
	// session, so its transaction rolls back and its row locks go, instead
	// of holding the order (and any payment on it) and committing a close
	// long after its lease ended.
}

// MinLockTimeout is the smallest lock_timeout Open derives.
const MinLockTimeout = 10 * time.Millisecond

// LockTimeoutFor is the lock_timeout derived from a statement timeout: a
// quarter of it, at least MinLockTimeout.
func LockTimeoutFor(statement time.Duration) time.Duration {
	return max(statement/4, MinLockTimeout)
}

// Open opens (lazily; nothing is dialled yet) a pool of its own on dsn. The
// timeouts are sent as startup parameters (lib/pq passes any key it does not
// know to the server), so every connection has them from its first
// statement, without a round trip, and they override the same keys in dsn.
// An error while connecting is returned as a *ConnectError (Transient).
func Open(dsn string, o PoolOptions) (*sqlx.DB, error) {
	cfg, err := pq.NewConfig(dsn)
	if err != nil {
		return nil, err
	}
	if cfg.Runtime == nil {
		cfg.Runtime = map[string]string{}
	}
	if o.StatementTimeout > 0 {
		cfg.Runtime["statement_timeout"] = millis(o.StatementTimeout)
		cfg.Runtime["idle_in_transaction_session_timeout"] = millis(o.StatementTimeout)
		if o.LockTimeout == 0 {
			o.LockTimeout = LockTimeoutFor(o.StatementTimeout)
		}
	}
	if o.LockTimeout > 0 {
		cfg.Runtime["lock_timeout"] = millis(o.LockTimeout)
	}
	c, err := pq.NewConnectorConfig(cfg)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(connector{c})
	n := max(o.MaxConns, 1)
	db.SetMaxOpenConns(n)
	db.SetMaxIdleConns(n)
	return sqlx.NewDb(db, "postgres"), nil
}

// millis renders d as a PostgreSQL duration in whole milliseconds, rounded
// up (0 would mean "no timeout").
func millis(d time.Duration) string {
	ms := (d + time.Millisecond - 1) / time.Millisecond
	return strconv.FormatInt(int64(ms), 10) + "ms"
}

// connector marks connection errors, so callers can tell them from errors
// of a statement.
type connector struct{ c *pq.Connector }

func (c connector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.c.Connect(ctx)
	if err != nil {
		return nil, &ConnectError{Err: err}
	}
	return conn, nil
}

func (c connector) Driver() driver.Driver { return c.c.Driver() }
