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
	"github.com/redis/go-redis/v9"
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
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	ctx := context.Background()
	// Default keys are not under the test's prefix: names of the test's own.
	suffix := strings.TrimPrefix(strings.TrimSuffix(keys.Queue, ":order"), "test:")
	plain, custom := "calls-"+suffix, "moved-"+suffix
	customKey := "test:" + suffix + ":moved"
	for _, k := range []string{client.TaskQueueKey(plain), client.TaskQueueKey(custom), client.TaskQueueKey("other-" + suffix)} {
		testenv.CheckNoKeysLeft(t, rdb, "*"+k+"*")
	}
	for _, k := range []string{client.TaskQueueKey(plain), client.TaskQueueKey(custom), customKey} {
		t.Cleanup(func() { testenv.DeleteQueue(rdb, queue.NewKeys(k)) })
	}

	if _, err := client.ForQueue(ctx, rdb, plain); !errors.Is(err, client.ErrUnknownQueue) {
		t.Fatalf("ForQueue before any daemon: %v, want ErrUnknownQueue", err)
	}
	// An earlier configuration served "moved" at its default key (and an
	// older daemon left its ":name" mark for "calls" there).
	if err := rdb.HSet(ctx, queue.NewKeys(client.TaskQueueKey(custom)).Meta, queue.MetaName, custom, queue.MetaDurable, "0").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, queue.NewKeys(client.TaskQueueKey(plain)).Name, plain, 0).Err(); err != nil {
		t.Fatal(err)
	}

	f, err := Parse([]byte(fmt.Sprintf(`queues:
  - {name: %s, action: {type: poll}}
  - {name: %s, key: %s, action: {type: poll}}
`, plain, custom, customKey)))
	if err != nil {
		t.Fatal(err)
	}
	startKeepMeta(t, rdb, f)
	// KeepMeta drops the old marks just after its first write of the meta
	// hashes, which is what startKeepMeta waited for.
	oldMark := queue.NewKeys(client.TaskQueueKey(plain)).Name
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n, err := rdb.Exists(ctx, oldMark).Result()
		if err == nil && n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the old %s mark is still there 30s after start: %d, %v", oldMark, n, err)
		}
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
	// A queue the file does not name (or no daemon runs) is refused even
	// where a meta hash without a name exists (a daemon older than the name field).
	other := "other-" + suffix
	t.Cleanup(func() { testenv.DeleteQueue(rdb, queue.NewKeys(client.TaskQueueKey(other))) })
	if err := rdb.HSet(ctx, queue.NewKeys(client.TaskQueueKey(other)).Meta, queue.MetaDurable, "0").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := client.ForQueue(ctx, rdb, other); !errors.Is(err, client.ErrUnknownQueue) {
		t.Errorf("ForQueue(%s) with a meta hash naming no queue: %v, want ErrUnknownQueue", other, err)
	}
	if n, err := rdb.Exists(ctx, client.TaskQueueKey(custom)).Result(); err != nil || n != 0 {
		t.Errorf("something was written at %s: %d, %v", client.TaskQueueKey(custom), n, err)
	}
}

// startKeepMeta runs a daemon's KeepMeta for f until the test ends and
// waits for its first write.
func startKeepMeta(t *testing.T, rdb redis.UniversalClient, f File) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := NewManager(f, rdb, nil, metrics.NewTaskFamilies(reg, metrics.New(reg, "t", "t")), zap.NewNop(), "test")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); m.KeepMeta(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	last := f.Queues[len(f.Queues)-1]
	deadline := time.Now().Add(30 * time.Second)
	for {
		if got, _ := rdb.HGet(ctx, queue.NewKeys(last.Key).Meta, queue.MetaName).Result(); got == last.Name {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("KeepMeta wrote no name for %s in 30s", last.Name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
