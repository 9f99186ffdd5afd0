package testenv

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// PrivateRedis starts a redis-server of the test's own on a free local port,
// persisting nothing, and returns a client for it and its address. The
// server is killed when the test ends. Use it for anything that would damage
// a shared server: SCRIPT FLUSH, FLUSHALL, CONFIG SET, SHUTDOWN.
//
// The test is skipped if redis-server is not on PATH.
func PrivateRedis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	return PrivateRedisWith(t, nil)
}

// PrivateRedisWith is PrivateRedis with extra redis-server arguments (e.g.
// "--requirepass", "secret") and the client options to reach it (nil: no
// auth).
func PrivateRedisWith(t testing.TB, opts *redis.Options, args ...string) (*redis.Client, string) {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server is not on PATH; this test needs a private Redis it may flush (apt-get install redis-server)")
	}
	// The free port is found by listening on :0 and closing, so another
	// process may take it before redis-server binds it: try a few times.
	var errs []error
	for range 3 {
		addr, err := startRedis(t, bin, args...)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		o := redis.Options{}
		if opts != nil {
			o = *opts
		}
		o.Addr = addr
		rdb := redis.NewClient(&o)
		t.Cleanup(func() { rdb.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := rdb.Ping(ctx).Err(); err != nil {
			t.Fatalf("private redis-server at %s: %v", addr, err)
		}
		return rdb, addr
	}
	t.Fatalf("start private redis-server: %v", errs)
	return nil, ""
}

// startRedis runs one redis-server on a free port and waits until it
// reports that it accepts connections (or exits).
func startRedis(t testing.TB, bin string, extra ...string) (string, error) {
	t.Helper()
	port, err := FreePort()
	if err != nil {
		return "", err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	out := &readyWriter{marker: []byte("Ready to accept connections"), ready: make(chan struct{})}
	args := append([]string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", t.TempDir(),
		"--daemonize", "no", "--logfile", "", "--loglevel", "notice"}, extra...)
	cmd := exec.Command(bin, args...)
	cmd.Stdout = out
	cmd.Stderr = out
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("redis-server: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		cmd.Process.Kill() //nolint:errcheck // it may have exited already
		<-exited
	}
	select {
	case <-out.ready:
		t.Cleanup(stop)
		return addr, nil
	case err := <-exited:
		return "", fmt.Errorf("redis-server on port %d exited (%v): %s", port, err, out.String())
	case <-time.After(10 * time.Second):
		stop()
		return "", fmt.Errorf("redis-server on port %d not ready after 10s: %s", port, out.String())
	}
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago (and
// is, for a test's purposes, closed: nothing listens on it).
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// readyWriter collects a process's output and closes ready once marker has
// appeared in it.
type readyWriter struct {
	marker []byte
	ready  chan struct{}

	mu   sync.Mutex
	buf  bytes.Buffer
	done bool
}

func (w *readyWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.buf.Len() < 64<<10 { // keep the start, for error messages
		w.buf.Write(p)
	}
	if !w.done && bytes.Contains(w.buf.Bytes(), w.marker) {
		w.done = true
		close(w.ready)
	}
	return len(p), nil
}

func (w *readyWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
