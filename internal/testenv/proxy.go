package testenv

import (
	"bytes"
	"encoding/binary"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy is a TCP proxy a test owns, for outages: Down cuts every connection
// and refuses new ones, Up lets them through again, SetTarget sends new
// connections elsewhere (a Service following a failover), Stall holds
// the server's replies back for a while (a statement that committed on the
// server while its client's deadline ran out), and DropReplies loses them
// (a connection cut after the server did the work). StallOnQuery starts a
// stall when a client sends a given query (a slow BEGIN, whatever the
// clock did before it). The servers behind it are never touched.
type Proxy struct {
	ln net.Listener

	mu     sync.Mutex
	target string
	down   bool
	stall  time.Time     // server-to-client bytes are held until then
	wake   chan struct{} // closed (and replaced) when Stall or Down changes a stall in progress
	drop   int           // server-to-client reads to discard, cutting their connection
	onQ    []byte        // StallOnQuery's message: a client chunk holding it starts a stall of onQFor
	onQFor time.Duration
	onQHit chan struct{} // closed when onQ passed
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// NewProxy listens on a free loopback port and forwards to target. It is
// closed when the test ends.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}, wake: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Down cuts all connections and refuses new ones until Up.
func (p *Proxy) Down() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		c.Close()
	}
	p.wakeLocked() // a held chunk is dropped with its connection
}

// wakeLocked wakes the copies waiting out a stall, so they see its new
// end (or their closed connection). p.mu is held.
func (p *Proxy) wakeLocked() {
	close(p.wake)
	p.wake = make(chan struct{})
}

// SetTarget forwards new connections to target from now on and cuts every
// connection to the old one, as a Kubernetes Service repointed at a new
// primary leaves its clients to reconnect.
func (p *Proxy) SetTarget(target string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.target = target
	for c := range p.conns {
		c.Close()
	}
}

// Up accepts connections again.
func (p *Proxy) Up() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

// Stall holds every byte the server sends, on every connection, for d from
// now: the server has done the work (a COMMIT, say) and the client hears of
// it only after d. Client-to-server bytes still flow. A later Stall moves
// the end of one in progress (Stall(0) ends it now).
func (p *Proxy) Stall(d time.Duration) {
	p.mu.Lock()
	p.stall = time.Now().Add(d)
	p.wakeLocked()
	p.mu.Unlock()
}

// StallOnQuery arms a stall that the client starts: the next time a client
// sends the simple-protocol query q (PostgreSQL's Query message, as lib/pq
// sends "BEGIN READ WRITE"), every byte the server sends is held for d from the moment
// the query passes the proxy — before the server has seen it, so its answer
// is among them. It fires once; the channel is closed when it has. The
// message is looked for in each chunk the client writes (lib/pq writes a
// message whole).
func (p *Proxy) StallOnQuery(q string, d time.Duration) <-chan struct{} {
	msg := make([]byte, 5, 6+len(q))
	msg[0] = 'Q'
	binary.BigEndian.PutUint32(msg[1:], uint32(4+len(q)+1))
	msg = append(append(msg, q...), 0)
	hit := make(chan struct{})
	p.mu.Lock()
	p.onQ, p.onQFor, p.onQHit = msg, d, hit
	p.mu.Unlock()
	return hit
}

// queried starts StallOnQuery's stall if chunk, from a client, holds its
// query.
func (p *Proxy) queried(chunk []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.onQ == nil || !bytes.Contains(chunk, p.onQ) {
		return
	}
	p.stall = time.Now().Add(p.onQFor)
	p.wakeLocked()
	close(p.onQHit)
	p.onQ, p.onQHit = nil, nil
}

// watchingCopy copies client bytes to the server like io.Copy, starting
// StallOnQuery's stall before the chunk holding its query goes on.
func (p *Proxy) watchingCopy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.queried(buf[:n])
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// DropReplies discards the next n reads of server bytes, on whichever
// connections they come, and cuts each of those connections: the server
// has done the work (a script ran) and the client never hears of it. The
// client's own retry, if it has one, goes out on a new connection.
func (p *Proxy) DropReplies(n int) {
	p.mu.Lock()
	p.drop = n
	p.mu.Unlock()
}

// dropping reports whether the read just made is to be discarded.
func (p *Proxy) dropping() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drop > 0 {
		p.drop--
		return true
	}
	return false
}

// held waits out a stall in progress, until it ends or Stall or Down
// changes it.
func (p *Proxy) held() {
	for {
		p.mu.Lock()
		until, wake, down := p.stall, p.wake, p.down
		p.mu.Unlock()
		wait := time.Until(until)
		if wait <= 0 || down {
			return
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-wake:
		}
		t.Stop()
	}
}

// stallingCopy copies src to dst like io.Copy, holding each chunk back
// while a stall lasts, and ends (losing the chunk) when DropReplies says
// to drop it.
func (p *Proxy) stallingCopy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.held()
			if p.dropping() {
				return // the caller closes both ends
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *Proxy) close() {
	p.ln.Close()
	p.Down()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.down {
			p.mu.Unlock()
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c] = struct{}{}
		p.conns[up] = struct{}{}
		p.wg.Add(2)
		p.mu.Unlock()
		pipe := func(dst, src net.Conn, fromServer bool) {
			defer p.wg.Done()
			if fromServer {
				p.stallingCopy(dst, src)
			} else {
				p.watchingCopy(dst, src)
			}
			dst.Close()
			src.Close()
			p.mu.Lock()
			delete(p.conns, dst)
			delete(p.conns, src)
			p.mu.Unlock()
		}
		go pipe(up, c, false)
		go pipe(c, up, true)
	}
}
