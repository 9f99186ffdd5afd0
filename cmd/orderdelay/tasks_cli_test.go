package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// `orderdelay task put` refuses a payload nested deeper than
// client.MaxPayloadDepth as bad usage (exit status 2) naming the limit, and
// writes nothing.
func TestTaskPutRefusesDeeplyNestedPayload(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(file, []byte("queues:\n  - name: jobs\n    key: '"+keys.Queue+"'\n    action: {type: poll}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"ORDERDELAY_REDIS_URL": testenv.RedisURL(), "ORDERDELAY_QUEUES_FILE": file}
	getenv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	deep := strings.Repeat("[", client.MaxPayloadDepth+1) + strings.Repeat("]", client.MaxPayloadDepth+1)
	var out bytes.Buffer
	err := cmdTask(context.Background(), []string{"put", "--after", "1m", "--payload", deep, "jobs", "j-1"}, &out, testWriter{t}, getenv)
	var usage usageError
	if !errors.As(err, &usage) || !strings.Contains(err.Error(), strconv.Itoa(client.MaxPayloadDepth)) {
		t.Fatalf("task put of a payload nested %d deep: %v (%T), want a usage error naming the limit", client.MaxPayloadDepth+1, err, err)
	}
	if n, err := rdb.ZCard(context.Background(), keys.Queue).Result(); err != nil || n != 0 {
		t.Errorf("%d tasks written by a refused put (%v)", n, err)
	}
}

// `orderdelay task put` of a new task on a queue at its max_pending fails
// (exit status 1, not 2: the command was right, the queue is full) naming
// the cap, and writes nothing; a re-put of the task already there is fine.
func TestTaskPutOnAFullQueue(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	yaml := "queues:\n  - name: jobs\n    key: '" + keys.Queue + "'\n    max_pending: 1\n    action: {type: poll}\n"
	if err := os.WriteFile(file, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := tasks.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := tasks.WriteMeta(ctx, rdb, f); err != nil { // as the daemon does at start
		t.Fatal(err)
	}
	env := map[string]string{"ORDERDELAY_REDIS_URL": testenv.RedisURL(), "ORDERDELAY_QUEUES_FILE": file}
	getenv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	put := func(id string) error {
		var out bytes.Buffer
		return cmdTask(ctx, []string{"put", "--after", "1h", "jobs", id}, &out, testWriter{t}, getenv)
	}
	if err := put("j-1"); err != nil {
		t.Fatalf("first put: %v", err)
	}
	err = put("j-2")
	var usage usageError
	if err == nil || errors.As(err, &usage) || !strings.Contains(err.Error(), "max_pending of 1") {
		t.Errorf("put on a full queue: %v (%T); want a plain failure naming max_pending 1", err, err)
	}
	if n, err := rdb.ZCard(ctx, keys.Queue).Result(); err != nil || n != 1 {
		t.Errorf("%d tasks in the queue (%v), want 1", n, err)
	}
	if err := put("j-1"); err != nil {
		t.Errorf("re-put of the task already there, at the cap: %v", err)
	}
}

// A durable queue cannot take reminders (they are written to Redis beside
// the order entry, past the durable tier): refused at start, exit 2.
func TestReminderQueueMustNotBeDurable(t *testing.T) {
	f, err := tasks.Parse([]byte("queues:\n  - name: remind\n    durable: true\n    action: {type: sql, statement: 'SELECT 1'}\n"))
	if err != nil {
		t.Fatal(err)
	}
	_, ok, err := reminderQueue(config.Config{ReminderQueue: "remind"}, f)
	var usage usageError
	if ok || !errors.As(err, &usage) || !strings.Contains(err.Error(), "durable") {
		t.Errorf("durable reminder queue: ok %v, %v; want a usage error naming durable", ok, err)
	}
}
