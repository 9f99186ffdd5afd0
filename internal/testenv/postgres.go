package testenv

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/orders"
)

// PGPair is a private PostgreSQL primary and a streaming standby (built by
// pg_basebackup -R) on free loopback ports, with the orderdelay schema
// migrated on the primary. Both are stopped and their data directories
// removed when the test ends.
//
// The standby replicates through a TCP proxy the test owns (Link), so
// CutReplication makes the primary commit what the standby never gets:
// what asynchronous replication loses when a primary dies. Clients reach
// the database through another proxy (Front) that Repoint moves to the
// standby once promoted, as a Kubernetes Service follows the new primary.
type PGPair struct {
	// PrimaryAddr and StandbyAddr are the servers' own addresses (after a
	// failover the standby is the primary).
	PrimaryAddr, StandbyAddr string
	// Front is what clients dial; Link is the standby's replication
	// connection to the primary.
	Front, Link *Proxy

	primary, standby *pgServer
	bin              string
	cred             *syscall.Credential
	root             string
}

// pgServer is one postgres process a test owns.
type pgServer struct {
	Addr string
	Port int
	Data string

	cmd    *exec.Cmd
	log    *readyWriter
	exited chan struct{}
	once   sync.Once
}

// PGDatabase is the database PGPair's schema lives in.
const PGDatabase = "postgres"

// PrivatePostgresPair starts a primary, migrates the orderdelay schema
// into it, clones a standby with pg_basebackup -R through the Link proxy and
// returns once the standby streams from the primary.
//
// initdb and postgres refuse to run as root: when the test runs as root
// they run as the unprivileged user "postgres" (or $ORDERDELAY_TEST_PG_USER),
// in a directory chowned to it. The test is skipped if the PostgreSQL server
// binaries are not installed or no such user exists.
func PrivatePostgresPair(t testing.TB) *PGPair {
	t.Helper()
	p := &PGPair{bin: pgBin(t)}
	if os.Geteuid() == 0 {
		name := os.Getenv("ORDERDELAY_TEST_PG_USER")
		if name == "" {
			name = "postgres"
		}
		u, err := user.Lookup(name)
		if err != nil {
			t.Skipf("running as root and there is no user %q to run initdb and postgres as (they refuse root); create one or set ORDERDELAY_TEST_PG_USER: %v", name, err)
		}
		uid, _ := strconv.ParseUint(u.Uid, 10, 32)
		gid, _ := strconv.ParseUint(u.Gid, 10, 32)
		p.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	// t.TempDir is private to root (0700 all the way down): the postgres
	// user needs a directory of its own it can reach.
	root, err := os.MkdirTemp("", "orderdelay-pg-")
	if err != nil {
		t.Fatal(err)
	}
	p.root = root
	t.Cleanup(p.cleanup)
	if p.cred != nil {
		if err := os.Chown(root, int(p.cred.Uid), int(p.cred.Gid)); err != nil {
			t.Fatalf("chown %s: %v", root, err)
		}
	}

	primaryData := filepath.Join(root, "primary")
	if out, err := p.run("initdb", "-D", primaryData, "-A", "trust", "-U", "postgres", "-E", "UTF8",
		"--no-locale", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	p.primary = p.startServer(t, primaryData)
	p.PrimaryAddr = p.primary.Addr
	if _, err := orders.Migrate(p.URL(p.PrimaryAddr)); err != nil {
		t.Fatalf("migrate the private primary: %v", err)
	}

	p.Link = NewProxy(t, p.PrimaryAddr)
	standbyData := filepath.Join(root, "standby")
	lh, lp, _ := net.SplitHostPort(p.Link.Addr())
	// -R writes standby.signal and a primary_conninfo naming the host and
	// port it copied from: the Link proxy.
	if out, err := p.run("pg_basebackup", "-h", lh, "-p", lp, "-U", "postgres", "-D", standbyData,
		"-R", "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		t.Fatalf("pg_basebackup: %v\n%s", err, out)
	}
	p.standby = p.startServer(t, standbyData)
	p.StandbyAddr = p.standby.Addr
	if err := poll(30*time.Second, func(ctx context.Context) error {
		return queryRow(ctx, p.URL(p.PrimaryAddr), "SELECT count(*) = 1 FROM pg_stat_replication WHERE state = 'streaming'")
	}); err != nil {
		t.Fatalf("standby not streaming: %v\n%s", err, p.standby.log.String())
	}
	p.Front = NewProxy(t, p.PrimaryAddr)
	return p
}

// URL is the database URL of the server at addr (Front.Addr() for what a
// daemon should be given).
func (p *PGPair) URL(addr string) string {
	u := url.URL{Scheme: "postgres", User: url.User("postgres"), Host: addr, Path: "/" + PGDatabase,
		RawQuery: "sslmode=disable"}
	return u.String()
}

// CutReplication cuts the standby off the primary: from now on the primary
// commits transactions the standby never receives.
func (p *PGPair) CutReplication() { p.Link.Down() }

// StopPrimary stops the primary in immediate mode (SIGQUIT: no checkpoint,
// clients cut, what a crashed host does) and waits until it is gone.
func (p *PGPair) StopPrimary() { p.primary.stop(syscall.SIGQUIT) }

// Promote promotes the standby and waits until it accepts writes.
func (p *PGPair) Promote(within time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	db, err := sql.Open("postgres", p.URL(p.StandbyAddr))
	if err != nil {
		return err
	}
	defer db.Close()
	var ok bool
	if err := db.QueryRowContext(ctx, "SELECT pg_promote(true, $1)", int(within.Seconds())).Scan(&ok); err != nil {
		return fmt.Errorf("pg_promote: %w", err)
	}
	if !ok {
		return errors.New("pg_promote: not promoted in time")
	}
	return poll(within, func(ctx context.Context) error {
		return queryRow(ctx, p.URL(p.StandbyAddr),
			"SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'")
	})
}

// Repoint moves Front to the promoted standby, cutting every connection it
// still carries.
func (p *PGPair) Repoint() { p.Front.SetTarget(p.StandbyAddr) }

// RestartOldPrimary starts the stopped primary again on its own port, after
// crash recovery, so a test can read what it had committed (its closes the
// standby never got). Nothing but the test reaches it: Front points at the
// new primary by then.
func (p *PGPair) RestartOldPrimary(t testing.TB) string {
	t.Helper()
	// A stale postmaster.pid of the immediate stop is fine: postgres
	// checks the pid in it is gone.
	s, err := p.tryStartServer(p.primary.Data, p.primary.Port)
	if err != nil {
		t.Fatalf("restart the old primary: %v", err)
	}
	p.primary = s
	return p.URL(s.Addr)
}

func (p *PGPair) cleanup() {
	for _, s := range []*pgServer{p.primary, p.standby} {
		if s != nil {
			s.stop(syscall.SIGQUIT)
		}
	}
	os.RemoveAll(p.root)
}

// run runs a PostgreSQL program as the pair's user.
func (p *PGPair) run(prog string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(p.bin, prog), args...)
	cmd.Dir = p.root
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	return cmd.CombinedOutput()
}

// startServer starts postgres on data, retrying when the free port was
// taken before postgres bound it.
func (p *PGPair) startServer(t testing.TB, data string) *pgServer {
	t.Helper()
	var errs []error
	for range 3 {
		port, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		s, err := p.tryStartServer(data, port)
		if err == nil {
			return s
		}
		errs = append(errs, err)
	}
	t.Fatalf("start private postgres: %v", errors.Join(errs...))
	return nil
}

func (p *PGPair) tryStartServer(data string, port int) (*pgServer, error) {
	s := &pgServer{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Port: port, Data: data,
		log:    &readyWriter{marker: []byte("database system is ready to accept"), ready: make(chan struct{})},
		exited: make(chan struct{})}
	// Settings for a throwaway test server: loopback only, no unix socket,
	// no durability (the OS keeps what a SIGQUIT'd server wrote).
	s.cmd = exec.Command(filepath.Join(p.bin, "postgres"), "-D", data, "-p", strconv.Itoa(port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
		"-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=100",
		"-c", "shared_buffers=16MB")
	s.cmd.Dir = p.root
	s.cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C"}
	// Pdeathsig: a test binary that dies (a timeout panic skips cleanups)
	// takes its servers with it.
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred, Pdeathsig: syscall.SIGKILL}
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	go func() { s.cmd.Wait(); close(s.exited) }() //nolint:errcheck // exit status of a stopped server
	select {
	case <-s.log.ready:
	case <-s.exited:
		return nil, fmt.Errorf("postgres on port %d exited: %s", port, s.log.String())
	case <-time.After(60 * time.Second):
		s.stop(syscall.SIGKILL)
		return nil, fmt.Errorf("postgres on port %d not ready after 60s: %s", port, s.log.String())
	}
	if err := poll(30*time.Second, func(ctx context.Context) error {
		return queryRow(ctx, p.URL(s.Addr), "SELECT true")
	}); err != nil {
		s.stop(syscall.SIGKILL)
		return nil, fmt.Errorf("postgres on port %d: %w: %s", port, err, s.log.String())
	}
	return s, nil
}

// stop sends sig to the postmaster and waits for it to exit. Calling it
// again does nothing.
func (s *pgServer) stop(sig syscall.Signal) {
	s.once.Do(func() {
		s.cmd.Process.Signal(sig) //nolint:errcheck // it may have exited already
		select {
		case <-s.exited:
		case <-time.After(30 * time.Second):
			s.cmd.Process.Kill() //nolint:errcheck
			<-s.exited
		}
	})
}

// queryRow runs a query returning one boolean and fails unless it is true.
func queryRow(ctx context.Context, dsn, query string) error {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	var ok bool
	if err := db.QueryRowContext(ctx, query).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%s: false", query)
	}
	return nil
}

// pgBin returns the directory of the PostgreSQL server programs, or skips
// the test.
func pgBin(t testing.TB) string {
	t.Helper()
	var dirs []string
	if path, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(path); err == nil {
			dirs = append(dirs, filepath.Dir(real))
		}
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	for i := len(found) - 1; i >= 0; i-- { // newest first
		dirs = append(dirs, found[i])
	}
	for _, d := range dirs {
		ok := true
		for _, prog := range []string{"initdb", "postgres", "pg_basebackup"} {
			if _, err := os.Stat(filepath.Join(d, prog)); err != nil {
				ok = false
			}
		}
		if ok {
			return d
		}
	}
	t.Skipf("PostgreSQL server programs (initdb, postgres, pg_basebackup) not found on PATH or in /usr/lib/postgresql/*/bin (tried %s); apt-get install postgresql",
		strings.Join(dirs, ", "))
	return ""
}
