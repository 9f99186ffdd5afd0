package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// server is one redis-server (or sentinel) process a test owns. It is
// killed when the test ends, or earlier by Kill.
type server struct {
	Addr string
	Port int
	Dir  string

	cmd    *exec.Cmd
	out    *readyWriter
	exited chan struct{}
	once   sync.Once
}

// Kill sends SIGKILL (no shutdown, no save: what a crashed host does) and
// waits for the process to go. Calling it again does nothing.
func (s *server) Kill() {
	s.once.Do(func() {
		s.cmd.Process.Kill() //nolint:errcheck // it may have exited already
		<-s.exited
	})
}

// redisBin returns the path of redis-server, or skips the test.
func redisBin(t testing.TB, also ...string) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server is not on PATH; this test needs private Redis servers (apt-get install redis-server)")
	}
	for _, b := range also {
		if _, err := exec.LookPath(b); err != nil {
			t.Skipf("%s is not on PATH; this test needs it (apt-get install redis-tools)", b)
		}
	}
	return bin
}

// startServer runs redis-server with the arguments args builds for a free
// port and a private directory, and waits until it answers PING. A port
// taken by someone else between FreePort and bind is retried.
func startServer(t testing.TB, bin string, args func(port int, dir string) ([]string, error)) *server {
	t.Helper()
	var errs []error
	for range 3 {
		s, err := tryStartServer(t, bin, args)
		if err == nil {
			return s
		}
		errs = append(errs, err)
	}
	t.Fatalf("start private redis-server: %v", errors.Join(errs...))
	return nil
}

func tryStartServer(t testing.TB, bin string, args func(port int, dir string) ([]string, error)) (*server, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	dir := t.TempDir()
	a, err := args(port, dir)
	if err != nil {
		return nil, err
	}
	// Readiness is a PING answered (sentinels log differently from data
	// servers); the writer only keeps the output for error messages.
	s := &server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Port: port, Dir: dir,
		out: &readyWriter{marker: []byte("\x00unused"), ready: make(chan struct{})}, exited: make(chan struct{})}
	s.cmd = exec.Command(bin, a...)
	s.cmd.Dir = dir
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("redis-server: %w", err)
	}
	go func() { s.cmd.Wait(); close(s.exited) }() //nolint:errcheck // exit status of a killed server
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := rdb.Ping(ctx).Err()
		cancel()
		if err == nil {
			t.Cleanup(s.Kill)
			return s, nil
		}
		select {
		case <-s.exited:
			return nil, fmt.Errorf("redis-server on port %d exited: %s", port, s.out.String())
		default:
		}
		if time.Now().After(deadline) {
			s.Kill()
			return nil, fmt.Errorf("redis-server on port %d not answering after 10s (%v): %s", port, err, s.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// baseArgs are the settings of every private server: loopback only,
// persisting nothing, logging to stdout.
func baseArgs(port int, dir string) []string {
	return []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir,
		"--daemonize", "no", "--logfile", "", "--loglevel", "notice"}
}

// poll runs cond every 50 ms until it returns nil or within passes; it
// returns cond's last error.
func poll(within time.Duration, cond func(ctx context.Context) error) error {
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := cond(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}
