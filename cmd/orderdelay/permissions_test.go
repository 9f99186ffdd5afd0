package main

import (
	"context"
	"errors"
	"fmt"
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
