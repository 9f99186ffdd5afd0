package e2e

// The campaign's Redis: a private server, since the nemesis changes its
// ACL (redis-refuse) and fails it over (redis-failover), which no test may
// do to the shared 6379; and, for redis-failover, a second private server
// replicating it. The daemons reach the primary through one proxy
// (redis-cut cuts it) as the Redis user "od", whose ACL redis-refuse
// tightens; the checkout and the checker reach it through another, as the
// default user. Both proxies stand for the Service a failover repoints.

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

const (
	campaignRedisUser     = "od"
	campaignRedisPassword = "od-campaign-pw"
)

// refusable are the commands redis-refuse takes from the daemons' user in
// turn: what the order path's scripts call (claim, fence, finish, retry,
// bury, hand-back, schedule, reconcile), EVALSHA that runs every script,
// and TIME that every script and the scanner's clock read.
var refusable = []string{"hset", "hdel", "hmget", "hincrby", "zadd", "zrem", "zrange", "zmscore", "publish", "time", "evalsha"}

type campaignRedis struct {
	t          *testing.T
	admin      []*redis.Client // straight to each server, as the default user
	addr       []string
	primary    int            // the server the proxies point at
	daemonPx   *testenv.Proxy // the daemons' way in
	checkoutPx *testenv.Proxy // the checkout's and the checker's way in
	checkout   *redis.Client  // through checkoutPx, as the default user
	// lastRepoint is when the proxies last turned to a new primary (or
	// the servers started): a write since then may be lost by a failover
	// whose WAIT found the replica behind.
	lastRepoint time.Time
}

// newCampaignRedis starts the campaign's private Redis, with a replica
// when the nemesis may fail it over.
func newCampaignRedis(t *testing.T, replica bool) *campaignRedis {
	t.Helper()
	ctx := context.Background()
	admin, addr := testenv.PrivateRedis(t)
	r := &campaignRedis{t: t, admin: []*redis.Client{admin}, addr: []string{addr}}
	if replica {
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatal(err)
		}
		rep, raddr := testenv.PrivateRedisWith(t, nil, "--replicaof", "127.0.0.1", port)
		r.admin, r.addr = append(r.admin, rep), append(r.addr, raddr)
	}
	// ACL users are not replicated: each server gets its own.
	for _, a := range r.admin {
		if err := a.Do(ctx, "ACL", "SETUSER", campaignRedisUser, "on", ">"+campaignRedisPassword, "~*", "&*", "+@all").Err(); err != nil {
			t.Fatal(err)
		}
	}
	if replica {
		testenv.WaitFor(t, "the replica in sync", 30*time.Second, func() bool { return linkUp(r.admin[1]) })
	}
	r.daemonPx = testenv.NewProxy(t, addr)
	r.checkoutPx = testenv.NewProxy(t, addr)
	r.checkout = redis.NewClient(&redis.Options{Addr: r.checkoutPx.Addr()})
	t.Cleanup(func() { r.checkout.Close() })
	r.lastRepoint = time.Now()
	return r
}

// daemonURL is the daemons' ORDERDELAY_REDIS_URL.
func (r *campaignRedis) daemonURL() string {
	return fmt.Sprintf("redis://%s:%s@%s/0", campaignRedisUser, campaignRedisPassword, r.daemonPx.Addr())
}

func linkUp(a *redis.Client) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := a.Info(ctx, "replication").Result()
	return err == nil && strings.Contains(info, "master_link_status:up")
}

// replOffset is the server's master_repl_offset: how far into the
// replication stream its writes (or those it received) go.
func replOffset(a *redis.Client) int64 {
	info, _ := a.Info(context.Background(), "replication").Result()
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "master_repl_offset:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

// acl applies rules to the daemons' user on every server (a replica
// promoted later must refuse what the primary refuses). Connections
// already open see the change at once: Redis checks every command, a
// script's included, against the user's rules as they are now.
func (r *campaignRedis) acl(rules ...string) {
	r.t.Helper()
	for _, a := range r.admin {
		args := []any{"ACL", "SETUSER", campaignRedisUser}
		for _, rule := range rules {
			args = append(args, rule)
		}
		if err := a.Do(context.Background(), args...).Err(); err != nil {
			r.t.Fatalf("ACL SETUSER %s %v: %v", campaignRedisUser, rules, err)
		}
	}
}

// lossWindow is when a failover may have lost the writes Redis
// acknowledged: from since (every write acknowledged before it had
// reached the replica) to until (the proxies turned to the replica).
type lossWindow struct{ since, until time.Time }

// failover fails Redis over to a stale replica: the replica stops
// following the primary (it is promoted), the daemons and the checkout go
// on writing to the old primary for hold, then both proxies turn to the
// promoted replica — Redis goes back by hold — and the old primary
// becomes its replica, for the next failover.
func (r *campaignRedis) failover(hold time.Duration) (lossWindow, string) {
	r.t.Helper()
	ctx := context.Background()
	p, q := r.primary, 1-r.primary
	// WAIT counts the replicas that have this connection's latest write,
	// and so every write before it: one write, then WAIT, on one
	// connection.
	w := lossWindow{since: time.Now()}
	var note string
	conn := r.admin[p].Conn()
	var wait *redis.Cmd
	_, err := conn.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		pipe.Incr(ctx, "campaign:failover")
		wait = pipe.Do(ctx, "WAIT", 1, 5000)
		return nil
	})
	conn.Close()
	if n, werr := wait.Int64(); err != nil || werr != nil || n != 1 {
		// The replica was behind: anything since it last had every write may go.
		w.since = r.lastRepoint
		note = fmt.Sprintf("WAIT found the replica behind (%d, %v): ", n, err)
	}
	if err := r.admin[q].Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
		r.t.Fatalf("redis-failover: promote: %v", err)
	}
	had := replOffset(r.admin[q])
	time.Sleep(hold)
	note += fmt.Sprintf("%d bytes of writes lost; ", replOffset(r.admin[p])-had)
	r.daemonPx.SetTarget(r.addr[q])
	r.checkoutPx.SetTarget(r.addr[q])
	w.until = time.Now()
	r.primary, r.lastRepoint = q, w.until
	host, port, _ := net.SplitHostPort(r.addr[q])
	if err := r.admin[p].Do(ctx, "REPLICAOF", host, port).Err(); err != nil {
		r.t.Fatalf("redis-failover: demote the old primary: %v", err)
	}
	// The next failover needs a replica in sync; a resync that takes
	// longer only widens that one's window (WAIT times out).
	deadline := time.Now().Add(20 * time.Second)
	for !linkUp(r.admin[p]) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if !linkUp(r.admin[p]) {
		note += "old primary not yet in sync; "
	}
	return w, note + fmt.Sprintf("promoted %s after %s on the old primary", r.addr[q], hold.Round(time.Millisecond))
}

// mayBeLost reports whether Redis acknowledged op's write in a window a
// failover lost: a reschedule whose Redis write may be gone while its row
// kept the new deadline. (A create's deadline holds by its row: a lost
// enqueue is the reconciler's to close, after the row's deadline.)
func mayBeLost(op cop, windows []lossWindow) bool {
	if op.kind != "reschedule" || op.outcome != acked {
		return false
	}
	for _, w := range windows {
		if !op.end.Before(w.since) && !op.start.After(w.until) {
			return true
		}
	}
	return false
}

// durableOps is ops as the checker may hold the daemons to: a reschedule
// a failover may have lost is one of unknown outcome (docs/reliability.md
// "Redis failover to a stale replica": the order may close at the
// deadline Redis went back to). lost reports whether any was.
func durableOps(ops []cop, windows []lossWindow) (out []cop, lost bool) {
	if len(windows) == 0 {
		return ops, false
	}
	for i, op := range ops {
		if mayBeLost(op, windows) {
			if !lost {
				out = append([]cop(nil), ops...)
				lost = true
			}
			out[i].outcome = unknown
			out[i].note = strings.TrimSpace("acked, then possibly lost by a Redis failover " + op.note)
		}
	}
	if !lost {
		return ops, false
	}
	return out, true
}

// finalDeadline is final for an order whose ops a failover may have
// rolled back: Redis may hold any deadline written before the lost one,
// so the latest written (and the row's) bounds when it must close.
func finalDeadline(ops []cop, row time.Time, lost bool) time.Time {
	f := final(ops, row)
	if !lost {
		return f
	}
	for _, o := range ops {
		if o.writesDeadline() && o.outcome != notApplied && o.deadline.After(f) {
			f = o.deadline
		}
	}
	return f
}
