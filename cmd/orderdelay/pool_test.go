package main

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestSharedPoolSaturatedOrdersStillClose: with every connection of the
// shared pool (task queues, relay, admin, start-up checks) held, orders
// still close: the order path has a pool of its own (issue 11, item 7).
func TestSharedPoolSaturatedOrdersStillClose(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	db, dsn := testenv.Postgres(t)
	cfg := daemonConfig(t, keys, dsn, map[string]string{"ORDERDELAY_WORKERS": "2"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	held := make(chan *daemon)
	started := func(ctx context.Context, d *daemon) {
		var conns []*sql.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for range d.db.Stats().MaxOpenConnections {
			c, err := d.db.Conn(ctx)
			if err != nil {
				t.Errorf("taking a shared connection: %v", err)
				return
			}
			conns = append(conns, c)
		}
		held <- d
		<-ctx.Done()
	}
	run := startDaemon(t, cfg, daemonOptions{started: started})
	var d *daemon
	select {
	case d = <-held:
	case <-run.done:
		t.Fatalf("daemon stopped: %v", run.err)
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon never started")
	}
	shared, ords := d.db.Stats(), d.ordDB.Stats()
	if shared.InUse != shared.MaxOpenConnections {
		t.Fatalf("shared pool: %d of %d connections in use, want all", shared.InUse, shared.MaxOpenConnections)
	}
	if want := cfg.Workers + 1; ords.MaxOpenConnections != want {
		t.Errorf("order pool of %d connections, want workers + reconciler = %d", ords.MaxOpenConnections, want)
	}
	// The shared pool is really full: a request for it waits.
	short, stop := context.WithTimeout(ctx, 200*time.Millisecond)
	if err := d.db.PingContext(short); err == nil {
		t.Fatal("the shared pool answered a ping with every connection held")
	}
	stop()

	const n = 20
	var zs []redis.Z
	for i := range n {
		serial := fmt.Sprintf("sat-%02d", i)
		if _, err := db.Exec(`INSERT INTO orders (serial_no, expires_at) VALUES ($1, now() - interval '1 second')`, serial); err != nil {
			t.Fatal(err)
		}
		zs = append(zs, redis.Z{Score: float64(time.Now().Add(-time.Second).UnixMilli()), Member: serial})
	}
	if err := rdb.ZAdd(ctx, keys.Queue, zs...).Err(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var closed int
		if err := db.Get(&closed, `SELECT count(*) FROM orders WHERE status = 'closed'`); err != nil {
			t.Fatal(err)
		}
		if closed == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d orders closed with the shared pool saturated", closed, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if s := d.db.Stats(); s.InUse != s.MaxOpenConnections {
		t.Errorf("the shared pool was released during the test (%d of %d in use)", s.InUse, s.MaxOpenConnections)
	}
	run.cancel()
	select {
	case <-run.done:
		if run.err != nil {
			t.Errorf("runDaemon: %v", run.err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon did not stop")
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }
