package queue

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Adversarial tests of the claim's raw reply and of runOnce: see
// docs/reliability.md.

// A reply whose declared counts are larger than what follows is refused
// at once, whatever the counts say. Before the fix the parser went on
// skipping the elements of a cut array (or map) one by one after the
// first error, as many times as its header said: a header of 2^62 never
// returned.
func TestAdvParseClaimReplyHugeCountsEndAtOnce(t *testing.T) {
	for _, reply := range []string{
		array(integer(1), integer(1), integer(1), "*4611686018427387903\r\n"),
		"*6\r\n:1\r\n:1\r\n:1\r\n*4611686018427387903\r\n",
		"*6\r\n:1\r\n:1\r\n:1\r\n*1\r\n%4611686018427387903\r\n",
		"*6\r\n:1\r\n:1\r\n:1\r\n*8\r\n*4611686018427387903\r\n",
		"*6\r\n:1\r\n:1\r\n:1\r\n*0\r\n*2\r\n$1\r\nx\r\n*4611686018427387903\r\n",
	} {
		done := make(chan error, 1)
		go func() {
			_, err := parseClaimReply([]byte(reply))
			done <- err
		}()
		select {
		case err := <-done:
			if !errors.Is(err, ErrReply) {
				t.Errorf("%q: %v, want ErrReply", reply, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%q: parseClaimReply has not returned after 5 s", reply)
		}
	}
}

// cutRedis reads each command, records its name, and answers it with the
// next scripted reply; the reply "" closes the connection instead, after
// the command was read (the server ran it, the answer never came).
type cutRedis struct {
	ln      net.Listener
	mu      sync.Mutex
	replies []string
	names   []string
}

func newCutRedis(t *testing.T, replies ...string) (*cutRedis, *redis.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &cutRedis{ln: ln, replies: replies}
	go f.serve()
	// The daemon's client: go-redis's default retries, which resend a
	// command whose connection broke unless it says NoRetry.
	rdb := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), Protocol: 2, DisableIdentity: true,
		MinRetryBackoff: time.Millisecond, MaxRetryBackoff: time.Millisecond})
	t.Cleanup(func() { rdb.Close(); ln.Close() })
	return f, rdb
}

func (f *cutRedis) commands() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.names...)
}

func (f *cutRedis) serve() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			rd := bufio.NewReader(c)
			for {
				name, err := readCommand(rd)
				if err != nil {
					return
				}
				f.mu.Lock()
				out := "-ERR no reply scripted\r\n"
				switch name {
				case "hello":
					out = "-ERR unknown command 'HELLO'\r\n"
				case "ping":
					out = "+PONG\r\n"
				default:
					f.names = append(f.names, name)
					if len(f.replies) > 0 {
						out, f.replies = f.replies[0], f.replies[1:]
					}
				}
				f.mu.Unlock()
				if out == "" {
					return // cut after the command arrived
				}
				if _, err := io.WriteString(c, out); err != nil {
					return
				}
			}
		}()
	}
}

// A claim whose connection breaks after the server read it, on the raw
// path and on the runOnce path a "not run" reply leads to, is sent once
// per path and fails: go-redis, with its default retries, never sends it
// again (a second run would claim again under the same token).
func TestAdvClaimCutAfterSendingIsNeverResent(t *testing.T) {
	for _, c := range []struct {
		name    string
		replies []string
		want    []string
	}{
		{"raw", []string{""}, []string{"evalsha"}},
		{"after NOSCRIPT", []string{"-NOSCRIPT No matching script.\r\n", ""}, []string{"evalsha", "evalsha"}},
		{"after NOSCRIPT and the load", []string{"-NOSCRIPT No matching script.\r\n", "-NOSCRIPT No matching script.\r\n",
			bulk(claimScript.Hash()), ""}, []string{"evalsha", "evalsha", "script", "evalsha"}},
		{"after LOADING, runOnce LOADING too", []string{"-LOADING Redis is loading the dataset in memory\r\n",
			"-LOADING Redis is loading the dataset in memory\r\n"}, []string{"evalsha", "evalsha"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, rdb := newCutRedis(t, c.replies...)
			res, err := runClaim(context.Background(), rdb, []string{"q"}, 1)
			if err == nil {
				t.Fatalf("claim = %+v, want an error", res)
			}
			if got := f.commands(); !reflect.DeepEqual(got, c.want) {
				t.Fatalf("commands sent %q, want %q", got, c.want)
			}
		})
	}
}

// parseClaimReply on any bytes returns (no panic, no endless loop), and
// what it accepts is a whole claim reply: reading it again from a copy
// with a value appended is refused.
func FuzzAdvParseClaimReply(f *testing.F) {
	ok := array(integer(5), integer(-1), integer(-1), array(bulk("a"), integer(3), integer(1), integer(1)),
		array(bulk("x"), bulk("malformed")), integer(0), array(bulk("b"), integer(4)))
	for _, seed := range []string{ok, "*6\r\n:1\r\n:1\r\n:1\r\n*4611686018427387903\r\n", "-NOSCRIPT x\r\n",
		"*7\r\n:1\r\n:1\r\n:1\r\n%1\r\n+a\r\n+b\r\n*0\r\n:0\r\n*0\r\n", "=8\r\ntxt:abcd\r\n", "!3\r\nERR\r\n", ""} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		res, err := parseClaimReply(raw)
		if err != nil {
			return
		}
		if _, err := parseClaimReply(append(append([]byte(nil), raw...), ":1\r\n"...)); err == nil {
			t.Fatalf("%q accepted as %+v, and again with a value after it", raw, res)
		}
	})
}
