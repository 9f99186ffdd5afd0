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
