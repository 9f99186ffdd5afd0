package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Sentinel is a private Redis Sentinel deployment: a master, one replica
// and three sentinels (quorum 2) on free loopback ports, all killed when the
// test ends. Failure detection is tuned down so a failover takes seconds.
//
// The replica replicates through a TCP proxy the test owns, so that
// CutReplication can make the master acknowledge writes the replica never
// gets: what asynchronous replication loses when a master dies.
type Sentinel struct {
	// MasterName is the name the sentinels monitor the master under.
	MasterName string
	// Addrs are the sentinels' addresses.
	Addrs []string
	// MasterAddr and ReplicaAddr are the data servers as started; after a
	// failover the replica is the master.
	MasterAddr, ReplicaAddr string

	master, replica *server
	link            *Proxy // the replica's connection to the master
}

// Failure detection settings of PrivateSentinel.
const (
	SentinelDownAfter       = time.Second     // down-after-milliseconds
	SentinelFailoverTimeout = 3 * time.Second // failover-timeout, from KillMaster on
	// sentinelQuietTimeout is the failover-timeout until KillMaster. A
	// sentinel "fixes" a replica that replicates from another address than
	// the master's (the proxy) once failover-timeout has passed, which would
	// undo CutReplication; a dead master stops that, so KillMaster lowers
	// it, in time for the election (a failed one is retried after twice
	// failover-timeout).
	sentinelQuietTimeout = 10 * time.Minute
)

// PrivateSentinel starts a master, a replica and three sentinels, and
// returns once the replica is in sync and every sentinel knows the replica
// and the two other sentinels (so a failover can be agreed on at once).
//
// The test is skipped if redis-server is not on PATH.
func PrivateSentinel(t testing.TB) *Sentinel {
	t.Helper()
	bin := redisBin(t)
	s := &Sentinel{MasterName: "odmaster"}
	s.master = startServer(t, bin, func(port int, dir string) ([]string, error) {
		// Diskless full sync waits 5 s by default for more replicas to join.
		return append(baseArgs(port, dir), "--repl-diskless-sync-delay", "0"), nil
	})
	s.link = NewProxy(t, s.master.Addr)
	s.replica = startServer(t, bin, func(port int, dir string) ([]string, error) {
		ph, pp, _ := net.SplitHostPort(s.link.Addr())
		return append(baseArgs(port, dir), "--replicaof", ph, pp), nil
	})
	s.MasterAddr, s.ReplicaAddr = s.master.Addr, s.replica.Addr
	replica := redis.NewClient(&redis.Options{Addr: s.ReplicaAddr})
	defer replica.Close()
	if err := poll(20*time.Second, func(ctx context.Context) error {
		info, err := replica.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "master_link_status:up") {
			return fmt.Errorf("replica not in sync yet:\n%s", info)
		}
		return nil
	}); err != nil {
		t.Fatalf("sentinel setup: %v", err)
	}
	mh, mp, _ := net.SplitHostPort(s.MasterAddr)
	for range 3 {
		sen := startServer(t, bin, func(port int, dir string) ([]string, error) {
			// A sentinel rewrites its configuration file, so each has its own.
			conf := filepath.Join(dir, "sentinel.conf")
			body := fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
sentinel monitor %s %s %s 2
sentinel down-after-milliseconds %s %d
sentinel failover-timeout %s %d
sentinel parallel-syncs %s 1
`, port, dir, s.MasterName, mh, mp, s.MasterName, SentinelDownAfter.Milliseconds(),
				s.MasterName, sentinelQuietTimeout.Milliseconds(), s.MasterName)
			if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
				return nil, err
			}
			return []string{conf, "--sentinel", "--daemonize", "no", "--logfile", "", "--loglevel", "notice"}, nil
		})
		s.Addrs = append(s.Addrs, sen.Addr)
	}
	// Sentinels find each other through hello messages on the master,
	// every 2 s; wait until each knows the replica and both others.
	for _, a := range s.Addrs {
		sc := redis.NewSentinelClient(&redis.Options{Addr: a})
		err := poll(30*time.Second, func(ctx context.Context) error {
			m, err := sc.Master(ctx, s.MasterName).Result()
			if err != nil {
				return err
			}
			if m["num-other-sentinels"] != "2" || m["num-slaves"] != "1" || m["flags"] != "master" {
				return fmt.Errorf("sentinel %s sees %s other sentinels, %s replicas, flags %q", a,
					m["num-other-sentinels"], m["num-slaves"], m["flags"])
			}
			return nil
		})
		sc.Close()
		if err != nil {
			t.Fatalf("sentinel setup: %v", err)
		}
	}
	return s
}

// URL is the go-redis failover URL (redis.ParseFailoverURL) of the
// deployment: the first sentinel as host, the others as addr parameters.
func (s *Sentinel) URL() string {
	q := url.Values{"master_name": {s.MasterName}}
	for _, a := range s.Addrs[1:] {
		q.Add("addr", a)
	}
	return (&url.URL{Scheme: "redis", Host: s.Addrs[0], RawQuery: q.Encode()}).String()
}

// Client returns a failover client that follows the master through
// failovers; it is closed when the test ends.
func (s *Sentinel) Client(t testing.TB) *redis.Client {
	t.Helper()
	o, err := redis.ParseFailoverURL(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewFailoverClient(o)
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// CutReplication cuts the replica off the master: from now on the master
// acknowledges writes that the replica (the next master) never receives.
// Redis's replication is asynchronous; this widens the window in which a
// master's death loses acknowledged writes from microseconds to as long as
// the test likes.
func (s *Sentinel) CutReplication() { s.link.Down() }

// ReplicationLag returns how many bytes of the replication stream the
// master has that the replica has not applied (both must be reachable).
func (s *Sentinel) ReplicationLag(ctx context.Context) (int64, error) {
	offset := func(addr, field string) (int64, error) {
		rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		defer rdb.Close()
		info, err := rdb.Info(ctx, "replication").Result()
		if err != nil {
			return 0, err
		}
		for line := range strings.SplitSeq(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
				return strconv.ParseInt(v, 10, 64)
			}
		}
		return 0, fmt.Errorf("%s: no %s in INFO replication", addr, field)
	}
	m, err := offset(s.MasterAddr, "master_repl_offset")
	if err != nil {
		return 0, err
	}
	r, err := offset(s.ReplicaAddr, "slave_repl_offset")
	if err != nil {
		return 0, err
	}
	return m - r, nil
}

// KillMaster SIGKILLs the master started by PrivateSentinel (a crash: no
// save, no shutdown; writes not yet replicated are lost), then sets the
// sentinels' failover-timeout to SentinelFailoverTimeout.
func (s *Sentinel) KillMaster() error {
	s.master.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, a := range s.Addrs {
		sc := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
		err := sc.Set(ctx, s.MasterName, "failover-timeout", strconv.FormatInt(SentinelFailoverTimeout.Milliseconds(), 10)).Err()
		sc.Close()
		if err != nil {
			return fmt.Errorf("sentinel %s: set failover-timeout: %w", a, err)
		}
	}
	return nil
}

// CurrentMaster asks the sentinels which address the master has now; the
// first sentinel that answers wins.
func (s *Sentinel) CurrentMaster(ctx context.Context) (string, error) {
	var last error
	for _, a := range s.Addrs {
		sc := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
		hp, err := sc.GetMasterAddrByName(ctx, s.MasterName).Result()
		sc.Close()
		if err == nil && len(hp) == 2 {
			return net.JoinHostPort(hp[0], hp[1]), nil
		}
		last = err
	}
	return "", fmt.Errorf("no sentinel named a master: %v", last)
}

// WaitFailover waits until every sentinel names a master other than the
// original one and that master accepts writes (role master), and returns
// its address.
func (s *Sentinel) WaitFailover(within time.Duration) (string, error) {
	var promoted string
	err := poll(within, func(ctx context.Context) error {
		for _, a := range s.Addrs {
			sc := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
			hp, err := sc.GetMasterAddrByName(ctx, s.MasterName).Result()
			sc.Close()
			if err != nil {
				return err
			}
			if addr := net.JoinHostPort(hp[0], hp[1]); addr == s.MasterAddr {
				return fmt.Errorf("sentinel %s still names %s", a, addr)
			} else {
				promoted = addr
			}
		}
		rdb := redis.NewClient(&redis.Options{Addr: promoted, MaxRetries: -1})
		defer rdb.Close()
		info, err := rdb.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "role:master") {
			return fmt.Errorf("%s not yet promoted", promoted)
		}
		return nil
	})
	return promoted, err
}
