package testenv

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The orderdelay binary tests run as a process: built once per test binary
// by BuildDaemon, removed by RemoveDaemon.
var daemonBuild struct {
	once sync.Once
	dir  string
	bin  string
	err  error
}

// BuildDaemon builds ./cmd/orderdelay into a temporary directory, once per
// test binary (later calls return the first build), and returns its path.
// The binary is race-instrumented when the test binary is, so the daemon's
// own data races fail the tests that run it. Call RemoveDaemon from
// TestMain once m.Run has returned.
func BuildDaemon() (string, error) {
	b := &daemonBuild
	b.once.Do(func() {
		b.dir, b.err = os.MkdirTemp("", "orderdelay-test-bin")
		if b.err != nil {
			return
		}
		bin := filepath.Join(b.dir, "orderdelay")
		args := []string{"build", "-o", bin}
		if raceEnabled {
			args = append(args, "-race")
		}
		build := exec.Command("go", append(args, "github.com/orderdelay/orderdelay/cmd/orderdelay")...)
		if out, err := build.CombinedOutput(); err != nil {
			b.err = fmt.Errorf("go build ./cmd/orderdelay: %v\n%s", err, out)
			return
		}
		b.bin = bin
	})
	return b.bin, b.err
}

// DaemonBinary is BuildDaemon for a test: a failed build fails t.
func DaemonBinary(t testing.TB) string {
	t.Helper()
	bin, err := BuildDaemon()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// RemoveDaemon deletes the binary BuildDaemon built, if it built one.
func RemoveDaemon() {
	if daemonBuild.dir != "" {
		os.RemoveAll(daemonBuild.dir)
	}
}

// Daemon is an `orderdelay run` process a test started.
type Daemon struct {
	// LogTail is how many of the log's last lines are logged if the test
	// failed (0: all of it).
	LogTail int

	cmd  *exec.Cmd
	log  LockedBuffer
	done chan struct{}
	err  error
}

// StartDaemon runs `orderdelay run args...` (DaemonBinary) with env as its
// whole environment, and returns at once. When t ends, a daemon still
// running is killed, and if t failed the tail of its log is logged.
func StartDaemon(t testing.TB, env []string, args ...string) *Daemon {
	t.Helper()
	d := &Daemon{LogTail: 40, done: make(chan struct{})}
	d.cmd = exec.Command(DaemonBinary(t), append([]string{"run"}, args...)...)
	d.cmd.Env = env
	d.cmd.Stdout, d.cmd.Stderr = &d.log, &d.log
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		d.Kill()
		if t.Failed() {
			log := d.Log()
			if d.LogTail > 0 {
				log = LastLines(log, d.LogTail)
			}
			t.Logf("daemon (pid %d) output:\n%s", d.cmd.Process.Pid, log)
		}
	})
	return d
}

// Log is everything the daemon printed so far.
func (d *Daemon) Log() string { return d.log.String() }

// Pid is the process's id: the daemon names itself by it (the replica
// name in its lease tokens and its PostgreSQL application_name,
// "orderdelay/<host>/<pid>").
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

// Done is closed once the process has exited.
func (d *Daemon) Done() <-chan struct{} { return d.done }

// Err is how the process ended (nil: exit status 0), once Done.
func (d *Daemon) Err() error { return d.err }

// ExitCode is the process's exit status once Done (-1 if a signal ended
// it).
func (d *Daemon) ExitCode() int { return d.cmd.ProcessState.ExitCode() }

// Signal sends sig to the process.
func (d *Daemon) Signal(sig os.Signal) error { return d.cmd.Process.Signal(sig) }

// Wait waits at most within for the process to exit and returns its exit
// status; an error if it is still running.
func (d *Daemon) Wait(within time.Duration) (int, error) {
	select {
	case <-d.done:
		return d.ExitCode(), nil
	case <-time.After(within):
		return 0, fmt.Errorf("daemon still running after %s", within)
	}
}

// Stop sends SIGTERM and waits at most within for the process to exit, and
// returns its exit status. If it does not exit in time it is killed and
// Stop returns an error saying so.
func (d *Daemon) Stop(within time.Duration) (int, error) {
	if err := d.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return 0, err
	}
	code, err := d.Wait(within)
	if err != nil {
		d.Kill()
		return 0, fmt.Errorf("daemon did not stop within %s of SIGTERM", within)
	}
	return code, nil
}

// Kill sends SIGKILL (unless it has exited) and waits for the process to
// go.
func (d *Daemon) Kill() {
	select {
	case <-d.done:
	default:
		d.cmd.Process.Kill() //nolint:errcheck // it may be exiting
		<-d.done
	}
}

// WaitReady waits at most within until GET url answers 200, failing t
// (with the daemon's log) if the daemon exits first or the time runs out.
func (d *Daemon) WaitReady(t testing.TB, url string, within time.Duration) {
	t.Helper()
	WaitFor(t, "daemon ready", within, func() bool {
		select {
		case <-d.done:
			t.Fatalf("daemon exited early: %v\n%s", d.err, d.Log())
		default:
		}
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// WaitFor polls cond until it holds, failing the test if it does not
// within the given time. It polls every 20 ms at first, then less often
// (up to every 100 ms), so a long wait does not load the machine it waits
// on with scrapes and queries.
func WaitFor(t testing.TB, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	pause := 20 * time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within %s", what, within)
		}
		time.Sleep(pause)
		pause = min(pause*5/4, 100*time.Millisecond)
	}
}

// FreeAddr is a loopback host:port that was free a moment ago (see
// FreePort).
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// LastLines is the last n lines of s.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// LockedBuffer collects a process's output written from two pipes (or
// any writers in several goroutines).
type LockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *LockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *LockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
