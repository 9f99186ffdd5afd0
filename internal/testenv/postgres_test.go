package testenv

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"
)

// TestPostgresPairLosesUnreplicatedCommits checks the failover rig itself:
// a commit made after CutReplication is on the old primary only, Front
// follows Repoint to the promoted standby, which accepts writes.
func TestPostgresPairLosesUnreplicatedCommits(t *testing.T) {
	p := PrivatePostgresPair(t)
	front, err := sql.Open("postgres", p.URL(p.Front.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	exec := func(db *sql.DB, q string, args ...any) {
		t.Helper()
		if _, err := db.Exec(q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	status := func(db *sql.DB, serial string) string {
		t.Helper()
		var s string
		if err := db.QueryRow("SELECT status FROM orders WHERE serial_no = $1", serial).Scan(&s); err != nil {
			t.Fatalf("%s: %v", serial, err)
		}
		return s
	}
	exec(front, "INSERT INTO orders (serial_no, expires_at) VALUES ('a', now()), ('b', now())")
	standby, err := sql.Open("postgres", p.URL(p.StandbyAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer standby.Close()
	if err := poll(30*time.Second, func(ctx context.Context) error {
		var n int
		if err := standby.QueryRowContext(ctx, "SELECT count(*) FROM orders").Scan(&n); err != nil {
			return err
		}
		if n != 2 {
			return fmt.Errorf("standby has %d orders, want 2", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	p.CutReplication()
	exec(front, "UPDATE orders SET status = 'closed', closed_at = now() WHERE serial_no = 'a'")
	p.StopPrimary()
	if err := front.Ping(); err == nil {
		t.Error("Front still reaches a database after StopPrimary")
	}
	if err := p.Promote(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	p.Repoint()
	front.SetMaxIdleConns(0) // drop connections to the old primary
	if got := status(front, "a"); got != "pending" {
		t.Errorf("order a is %s on the promoted standby, want pending: the close was never replicated", got)
	}
	exec(front, "UPDATE orders SET status = 'closed', closed_at = now() WHERE serial_no = 'b'")
	old, err := sql.Open("postgres", p.RestartOldPrimary(t))
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if got := status(old, "a"); got != "closed" {
		t.Errorf("order a is %s on the restarted old primary, want closed", got)
	}
	if got := status(old, "b"); got != "pending" {
		t.Errorf("order b is %s on the old primary, want pending (closed after the failover)", got)
	}
}
