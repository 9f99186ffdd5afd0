package main

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// TestCloseClientsDoesNotWaitOutAStalledDatabase: closing the order path's
// pool closes each connection's prepared statements first, and lib/pq
// waits for the server's answer to each with no deadline. With PostgreSQL's
// answers held (a partition, a stalled failover), the daemon's last step
// would wait for as long as the network does — until TCP gives up, or the
// pod is killed. closeClients gives each pool a bounded wait instead: it
// returns while the stall still lasts.
func TestCloseClientsDoesNotWaitOutAStalledDatabase(t *testing.T) {
	_, _, dsn, px := testenv.PostgresViaProxy(t)
	_, keys := testenv.Redis(t)
	cfg := daemonConfig(t, keys, dsn, nil)
	d, closeClients, err := wire(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// One batch: its statements are now prepared on an idle connection.
	if _, err := d.store.Settle(ctx, []string{"closepool-no-row"}, nil); err != nil {
		t.Fatal(err)
	}
	const stall = 60 * time.Second
	end := time.Now().Add(stall)
	px.Stall(stall)
	defer px.Down()
	closeClients()
	if !time.Now().Before(end) {
		t.Fatalf("closeClients returned only when the %s stall ended: shutdown waits for as long as the network does", stall)
	}
}
