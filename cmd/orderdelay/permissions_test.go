package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// redisUser starts a private redis-server with user "od" (password "pw")
// of rules and returns the URL that logs in as it, and an admin client.
func redisUser(t *testing.T, rules ...string) (string, func() int64) {
	t.Helper()
	admin, addr := testenv.PrivateRedis(t)
	args := []any{"acl", "setuser", "od", "on", ">pw"}
	for _, r := range rules {
		args = append(args, r)
	}
	if err := admin.Do(context.Background(), args...).Err(); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("redis://od:pw@%s/0", addr), func() int64 { return admin.DBSize(context.Background()).Val() }
}

// TestDaemonRefusesARedisUserWithoutACommandItNeeds: a Redis user refused
// HDEL (which the scripts call) stops the start with a configuration
// error (exit 2) that names the command and the user, before anything
// wrote to Redis.
func TestDaemonRefusesARedisUserWithoutACommandItNeeds(t *testing.T) {
	url, dbsize := redisUser(t, "~*", "&*", "+@all", "-hdel")
	_, dsn := testenv.Postgres(t)
	cfg := daemonConfig(t, queue.NewKeys(queue.DefaultKey), dsn, map[string]string{"ORDERDELAY_REDIS_URL": url})
	d := startDaemon(t, cfg, daemonOptions{started: func(context.Context, *daemon) { t.Error("the daemon started its work") }})
	select {
	case <-d.done:
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon still runs a minute after a refused permission check")
	}
	var ue usageError
	if !errors.As(d.err, &ue) || !strings.Contains(d.err.Error(), "HDEL") || !strings.Contains(d.err.Error(), `user "od"`) {
		t.Fatalf("runDaemon: %v, want a configuration error (exit 2) naming HDEL and user od", d.err)
	}
	if n := dbsize(); n != 0 {
		t.Errorf("%d keys in Redis after the refused start, want none", n)
	}
}

// TestDaemonStartsWithoutObject: OBJECT, which the claim asks with pcall,
// is optional: a user refused it starts the daemon.
func TestDaemonStartsWithoutObject(t *testing.T) {
	url, _ := redisUser(t, "~*", "&*", "+@all", "-object")
	_, dsn := testenv.Postgres(t)
	cfg := daemonConfig(t, queue.NewKeys(queue.DefaultKey), dsn, map[string]string{"ORDERDELAY_REDIS_URL": url})
	up := make(chan struct{})
	d := startDaemon(t, cfg, daemonOptions{started: signalStarted(up)})
	select {
	case <-up:
	case <-d.done:
		t.Fatalf("the daemon stopped: %v", d.err)
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon never started")
	}
}

// TestDaemonChecksTheDefaultKeyOfATaskQueueWithItsOwnKey: a task queue the
// queues file gives a key of its own still has the daemon read and clear
// the meta hash and legacy name mark at its name's default key
// ({delaytask:NAME}:meta, {delaytask:NAME}:name: tasks.WriteMeta,
// dropLegacyNames). A user granted only the queue's own keys passed the
// check, and then every meta pass failed there — before the meta of the
// queues after it in the file, whose durable flag and cap producers'
// scripts obey, was written. The check asks about those keys too.
func TestDaemonChecksTheDefaultKeyOfATaskQueueWithItsOwnKey(t *testing.T) {
	q, own := queue.DefaultKey, "custom:jobs"
	url, _ := redisUser(t, "resetkeys", "resetchannels", "+@all",
		"~"+q, "~{"+q+"}:*", "&{"+q+"}:wake", "~"+own, "~{"+own+"}:*", "&{"+own+"}:wake",
		"~delaytask:more", "~{delaytask:more}:*", "&{delaytask:more}:wake")
	_, dsn := testenv.Postgres(t)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	yaml := "queues:\n  - name: jobs\n    key: '" + own + "'\n    action: {type: poll}\n" +
		"  - name: more\n    max_pending: 5\n    action: {type: poll}\n"
	if err := os.WriteFile(file, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := daemonConfig(t, queue.NewKeys(q), dsn, map[string]string{"ORDERDELAY_REDIS_URL": url, "ORDERDELAY_QUEUES_FILE": file})
	up := make(chan struct{})
	d := startDaemon(t, cfg, daemonOptions{started: signalStarted(up)})
	select {
	case <-d.done:
	case <-up:
		t.Fatal("the daemon started its work")
	case <-time.After(60 * time.Second):
		t.Fatal("the daemon still runs a minute after its start")
	}
	meta := queue.NewKeys(queue.TaskQueueKey("jobs")).Meta
	if ue := (usageError{}); !errors.As(d.err, &ue) || !strings.Contains(d.err.Error(), meta) {
		t.Fatalf("runDaemon: %v, want a configuration error (exit 2) naming %s", d.err, meta)
	}
}
