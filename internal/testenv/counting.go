package testenv

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
)

// Statements counts the statements a pool ran on the server (queries and
// execs, not BEGIN or COMMIT; a prepared statement each time it runs), and
// keeps their text, and counts apart how many statements it prepared.
type Statements struct {
	n        atomic.Int64
	prepares atomic.Int64
	mu       sync.Mutex
	text     []string
	runs     map[string]int // by text
	// afterPrepare, when set, runs after a statement was prepared on a
	// connection and before the prepare returns to database/sql.
	afterPrepare func(ctx context.Context, conn driver.Conn, q string)
}

// N is how many statements ran so far.
func (s *Statements) N() int64 { return s.n.Load() }

// Prepares is how many statements were prepared so far (once per
// connection and statement, not counted in N).
func (s *Statements) Prepares() int64 { return s.prepares.Load() }

// Since returns the texts of the statements after the first n.
func (s *Statements) Since(n int64) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.text[n:]...)
}

// Ran is how many times the statement of text q ran so far (prepared or
// not: the text the driver was given).
func (s *Statements) Ran(q string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[q]
}

// AfterPrepare makes f run each time a statement q has been prepared on a
// connection, on that connection (lib/pq's own, to run statements in its
// session), before the prepare returns: between the Parse and the first
// Bind, where no goroutine of a test could otherwise step in. nil stops it.
func (s *Statements) AfterPrepare(f func(ctx context.Context, conn driver.Conn, q string)) {
	s.mu.Lock()
	s.afterPrepare = f
	s.mu.Unlock()
}

func (s *Statements) add(q string) {
	s.mu.Lock()
	s.text = append(s.text, q)
	if s.runs == nil {
		s.runs = map[string]int{}
	}
	s.runs[q]++
	s.mu.Unlock()
	s.n.Add(1)
}

func (s *Statements) prepared(ctx context.Context, conn driver.Conn, q string) {
	s.prepares.Add(1)
	s.mu.Lock()
	f := s.afterPrepare
	s.mu.Unlock()
	if f != nil {
		f(ctx, conn, q)
	}
}

// CountingPostgres is Postgres through a driver that counts every statement
// the pool sends, so a test can assert how many round trips a code path
// takes.
func CountingPostgres(t testing.TB) (*sqlx.DB, string, *Statements) {
	t.Helper()
	_, dsn := CreateDatabase(t)
	db, st := CountingPool(t, dsn, 0)
	return db, dsn, st
}

// CountingPool is a pool on dsn (a database of the test's, or a proxy in
// front of one) of at most conns connections (0: no limit), through the
// counting driver of CountingPostgres; closed when the test ends.
func CountingPool(t testing.TB, dsn string, conns int) (*sqlx.DB, *Statements) {
	t.Helper()
	c, err := pq.NewConnector(dsn)
	if err != nil {
		t.Fatal(err)
	}
	st := &Statements{}
	db := sqlx.NewDb(sql.OpenDB(countingConnector{c, st}), "postgres")
	if conns > 0 {
		db.SetMaxOpenConns(conns)
		db.SetMaxIdleConns(conns)
	}
	t.Cleanup(func() { db.Close() })
	return db, st
}

type countingConnector struct {
	driver.Connector
	st *Statements
}

func (c countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &countingConn{conn, c.st}, nil
}

// countingConn forwards to lib/pq's connection, which implements every
// interface below.
type countingConn struct {
	driver.Conn
	st *Statements
}

func (c *countingConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	c.st.add(q)
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

func (c *countingConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	c.st.add(q)
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c *countingConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	c.st.prepared(ctx, c.Conn, q)
	return &countingStmt{st, c.st, q}, nil
}

// countingStmt counts each run of a prepared statement of lib/pq's, which
// implements the interfaces below.
type countingStmt struct {
	driver.Stmt
	st *Statements
	q  string
}

func (s *countingStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.st.add(s.q)
	return s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}

func (s *countingStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.st.add(s.q)
	return s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c *countingConn) Ping(ctx context.Context) error { return c.Conn.(driver.Pinger).Ping(ctx) }

func (c *countingConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *countingConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

func (c *countingConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}
