package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// `orderdelay task put|delete` on a durable queue go through PostgreSQL,
// as the HTTP API does. The CLI wrote only Redis: the executor, finding no
// row, took the task for one executed or cancelled and dropped it without
// running it, although the CLI had answered "created"; and a delete left
// the row SCHEDULED, so the loader brought the deleted task back.
func TestTaskPutAndDeleteOnADurableQueueWriteTheRow(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	db, dsn := testenv.Postgres(t)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	yaml := "queues:\n  - name: dq\n    key: '" + keys.Queue + "'\n    durable: true\n    window: 5m\n" +
		"    action: {type: sql, statement: \"SELECT unnest($1::text[])\"}\n"
	if err := os.WriteFile(file, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"ORDERDELAY_REDIS_URL": testenv.RedisURL(), "ORDERDELAY_DATABASE_URL": dsn,
		"ORDERDELAY_QUEUES_FILE": file}
	getenv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	cli := func(args ...string) (int, string) {
		var out bytes.Buffer
		code := run(context.Background(), append([]string{"task"}, args...), &out, testWriter{t}, getenv)
		return code, out.String()
	}
	t.Cleanup(func() { testenv.DeleteQueue(rdb, keys) })

	if code, out := cli("put", "dq", "CLI-1", "--after", "1m", "--payload", `{"n":1}`); code != 0 {
		t.Fatalf("put: exit %d: %s", code, out)
	}
	var state, payload string
	if err := db.QueryRow(`SELECT state, payload FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'CLI-1'`).Scan(&state, &payload); err != nil {
		t.Fatalf("no row for the task the CLI put on a durable queue (%v): the executor drops it unrun", err)
	}
	if state != "SCHEDULED" || payload != `{"n": 1}` && payload != `{"n":1}` {
		t.Errorf("row %s %s, want SCHEDULED with the payload", state, payload)
	}
	if _, err := rdb.ZScore(context.Background(), keys.Queue, "CLI-1").Result(); err != nil {
		t.Errorf("not in Redis although due within the window: %v", err)
	}
	if code, out := cli("delete", "dq", "CLI-1"); code != 0 {
		t.Fatalf("delete: exit %d: %s", code, out)
	}
	if err := db.QueryRow(`SELECT state FROM orderdelay_tasks WHERE queue = 'dq' AND id = 'CLI-1'`).Scan(&state); err != nil || state != "CANCELLED" {
		t.Errorf("row after the CLI's delete: %q (%v), want CANCELLED (else the loader brings it back)", state, err)
	}
}
