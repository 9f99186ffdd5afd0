package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// client.ForQueue finds a queue by name only where a daemon serves it: at
// the default key of a queue the daemon runs; never at the default key of
// a queue the queues file gives a key of its own (issue 12, item 3).
func TestForQueueWritesOnlyWhereADaemonServes(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	ctx := context.Background()
	// Default keys are not under the test's prefix: names of the test's own.
	suffix := strings.TrimPrefix(strings.TrimSuffix(keys.Queue, ":order"), "test:")
	plain, custom := "calls-"+suffix, "moved-"+suffix
	customKey := "test:" + suffix + ":moved"
	for _, k := range []string{client.TaskQueueKey(plain), client.TaskQueueKey(custom), customKey} {
		t.Cleanup(func() { testenv.DeleteQueue(rdb, queue.NewKeys(k)) })
	}

	if _, err := client.ForQueue(ctx, rdb, plain); !errors.Is(err, client.ErrUnknownQueue) {
		t.Fatalf("ForQueue before any daemon: %v, want ErrUnknownQueue", err)
	}
	// An earlier configuration served "moved" at its default key.
	if err := rdb.Set(ctx, queue.NewKeys(client.TaskQueueKey(custom)).Name, custom, 0).Err(); err != nil {
		t.Fatal(err)
	}

	f, err := Parse([]byte(fmt.Sprintf(`queues:
  - {name: %s, action: {type: poll}}
  - {name: %s, key: %s, action: {type: poll}}
`, plain, custom, customKey)))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := NewManager(f, rdb, nil, metrics.NewTaskFamilies(reg, metrics.New(reg, "t", "t")), zap.NewNop(), "test")
	if err != nil {
		t.Fatal(err)
	}
	if err := m.announce(ctx); err != nil {
		t.Fatal(err)
	}

	c, err := client.ForQueue(ctx, rdb, plain)
	if err != nil {
		t.Fatalf("ForQueue(%s): %v", plain, err)
	}
	if _, _, err := c.PutTask(ctx, "t-1", json.RawMessage(`{}`), time.Now().Add(time.Minute), client.Create); err != nil {
		t.Fatal(err)
	}
	if _, err := rdb.ZScore(ctx, client.TaskQueueKey(plain), "t-1").Result(); err != nil {
		t.Errorf("t-1 not at %s: %v", client.TaskQueueKey(plain), err)
	}

	_, err = client.ForQueue(ctx, rdb, custom)
	if !errors.Is(err, client.ErrUnknownQueue) || !strings.Contains(err.Error(), "client.New") {
		t.Errorf("ForQueue(%s) with a key of its own: %v, want ErrUnknownQueue pointing at client.New", custom, err)
	}
	for _, bad := range []string{"", "Calls", "a b", "x:y", strings.Repeat("a", 65)} {
		if _, err := client.ForQueue(ctx, rdb, bad); !errors.Is(err, client.ErrUnknownQueue) {
			t.Errorf("ForQueue(%q): %v, want ErrUnknownQueue", bad, err)
		}
	}
	if n, err := rdb.Exists(ctx, client.TaskQueueKey(custom)).Result(); err != nil || n != 0 {
		t.Errorf("something was written at %s: %d, %v", client.TaskQueueKey(custom), n, err)
	}
}
