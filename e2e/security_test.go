package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

const (
	redisPassword = "r3dis-s3cret-pw-1"
	aclPassword   = "acl-s3cret-pw-2"
	pgPassword    = "pg-s3cret-pw-3"
)

func TestSecuritySecretsNeverLeakAndAuthHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, addr := testenv.PrivateRedisWith(t, &redis.Options{Password: redisPassword}, "--requirepass", redisPassword)
	// An ACL user with its own password, as production would use.
	if err := rdb.Do(ctx, "ACL", "SETUSER", "orderdelay", "on", ">"+aclPassword, "~*", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	db, dsn := testenv.Postgres(t)
	dbURL := strings.Replace(dsn, "postgres@", "postgres:"+pgPassword+"@", 1)
	if strings.Contains(dbURL, "?") {
		dbURL += "&sslmode=require"
	} else {
		dbURL += "?sslmode=require"
	}
	dbURL = strings.Replace(dbURL, "sslmode=disable&", "", 1)
	w := &world{t: t, rdb: rdb, redisURL: "redis://orderdelay:" + aclPassword + "@" + addr + "/0",
		keys: queue.NewKeys(queue.DefaultKey), db: db, dbURL: dbURL}
	d := w.start("ORDERDELAY_API_TOKEN=" + tokenA + "," + tokenB)

	serials := w.createOrders("sec", 3, time.Now().Add(200*time.Millisecond))
	next := 0 // the next order to enqueue with an accepted token
	for i, tc := range []struct {
		auth string
		want int
	}{
		{"", http.StatusUnauthorized},
		{bearer("wrong-token-wrong-token"), http.StatusUnauthorized},
		{"Basic " + tokenA, http.StatusUnauthorized},
		{bearer(tokenA[:len(tokenA)-1]), http.StatusUnauthorized},
		{bearer(tokenA), http.StatusCreated},
		{bearer(tokenB), http.StatusCreated},
		{"bearer " + tokenA, http.StatusCreated},
	} {
		serial := fmt.Sprintf("refused-%d", i)
		if tc.want == http.StatusCreated {
			serial = serials[next]
			next++
		}
		if got := d.call(http.MethodPut, "/v1/timeouts/"+serial, tc.auth, `{"after":"200ms"}`, nil); got != tc.want {
			t.Errorf("Authorization %q: %d, want %d", tc.auth, got, tc.want)
		}
	}
	waitFor(t, "orders closed through the ACL user and TLS to PostgreSQL", 30*time.Second, func() bool {
		return w.closed() == 3
	})
	if n := w.count("SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) WHERE application_name LIKE 'orderdelay/%' AND datname = current_database() AND NOT ssl"); n != 0 {
		t.Errorf("%d daemon connections without TLS despite sslmode=require", n)
	}
	if got := d.call(http.MethodPut, "/v1/timeouts/big", bearer(tokenA), `{"after":"1m","x":"`+strings.Repeat("a", 20000)+`"}`, nil); got != http.StatusRequestEntityTooLarge {
		t.Errorf("oversized body: %d, want 413", got)
	}
	// A slow client that never finishes its headers is cut off.
	conn, err := net.Dial("tcp", d.addr)
	if err != nil {
		t.Fatal(err)
	}
	conn.Write([]byte("PUT /v1/timeouts/slow HTTP/1.1\r\nHost: x\r\n"))
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	start := time.Now()
	_, err = io.ReadAll(conn)
	conn.Close()
	if err != nil || time.Since(start) > 20*time.Second {
		t.Errorf("slow request not cut off: %v after %s", err, time.Since(start))
	}
	metricsBody := d.scrape()
	d.stopCleanly()

	// Wrong credentials make the daemon log errors that carry URLs.
	bad := *w
	bad.redisURL = "redis://orderdelay:wrong-" + aclPassword + "@" + addr + "/0"
	bd := bad.launch(t, nil, "ORDERDELAY_API_TOKEN="+tokenA)
	waitFor(t, "the wrong password is reported", 30*time.Second, func() bool {
		return strings.Contains(bd.Output(), "WRONGPASS")
	})
	bd.stop()

	everything := d.Output() + bd.Output() + metricsBody
	for _, secret := range []string{redisPassword, aclPassword, pgPassword, tokenA, tokenB} {
		if strings.Contains(everything, secret) {
			t.Errorf("secret %q appears in the daemon's output or /metrics", secret)
		}
	}
	if !strings.Contains(d.Output(), "xxxxx") {
		t.Errorf("start-up log does not show masked URLs:\n%s", testenv.LastLines(d.Output(), 5))
	}
}
