package testenv

import (
	"context"
	"fmt"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Cluster is a private Redis Cluster of three masters (no replicas) on free
// loopback ports, killed when the test ends.
type Cluster struct {
	// Addrs are the masters' client addresses, in the order they were
	// given to redis-cli --cluster create (which gives the first the lowest
	// slots).
	Addrs []string
}

// PrivateCluster starts three cluster-enabled redis-servers, joins them
// with redis-cli --cluster create, and returns once every node reports
// cluster_state:ok and knows all 16384 slots and the other two nodes.
// Each node's bus port is a free port of its own (cluster-port), so client
// ports above 55535 are fine.
//
// The test is skipped if redis-server or redis-cli is not on PATH.
func PrivateCluster(t testing.TB) *Cluster {
	t.Helper()
	bin := redisBin(t, "redis-cli")
	c := &Cluster{}
	for range 3 {
		s := startServer(t, bin, func(port int, dir string) ([]string, error) {
			bus, err := FreePort()
			if err != nil {
				return nil, err
			}
			if bus == port {
				return nil, fmt.Errorf("bus port %d equals client port", bus)
			}
			return append(baseArgs(port, dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
				"--cluster-port", strconv.Itoa(bus), "--cluster-node-timeout", "5000"), nil
		})
		c.Addrs = append(c.Addrs, s.Addr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, a := range c.Addrs {
		rdb := redis.NewClient(&redis.Options{Addr: a})
		err := poll(30*time.Second, func(ctx context.Context) error {
			info, err := rdb.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			for _, want := range []string{"cluster_state:ok", "cluster_slots_assigned:16384", "cluster_known_nodes:3"} {
				if !strings.Contains(info, want) {
					return fmt.Errorf("node %s: no %s yet:\n%s", a, want, info)
				}
			}
			return nil
		})
		rdb.Close()
		if err != nil {
			t.Fatalf("cluster setup: %v", err)
		}
	}
	return c
}

// URL is the go-redis cluster URL (redis.ParseClusterURL) of the cluster:
// the first node as host, the others as addr parameters.
func (c *Cluster) URL() string {
	q := url.Values{}
	for _, a := range c.Addrs[1:] {
		q.Add("addr", a)
	}
	return (&url.URL{Scheme: "redis", Host: c.Addrs[0], RawQuery: q.Encode()}).String()
}

// Client returns a cluster client; it is closed when the test ends.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	o, err := redis.ParseClusterURL(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClusterClient(o)
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// NodeFor returns the address of the master serving key's hash slot (as the
// node the question is put to sees it).
func (c *Cluster) NodeFor(ctx context.Context, key string) (string, error) {
	rdb := redis.NewClient(&redis.Options{Addr: c.Addrs[0]})
	defer rdb.Close()
	slot, err := rdb.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return "", err
	}
	ranges, err := rdb.ClusterSlots(ctx).Result()
	if err != nil {
		return "", err
	}
	for _, r := range ranges {
		if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
			return r.Nodes[0].Addr, nil
		}
	}
	return "", fmt.Errorf("slot %d of %q is not served", slot, key)
}
