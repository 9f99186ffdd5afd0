package queue

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// fakeRedis answers each command with the next reply it is given, as
// bytes, and records the commands' names: it lets a test hand go-redis
// and parseClaimReply any reply at all.
type fakeRedis struct {
	ln      net.Listener
	mu      sync.Mutex
	replies []string
	names   []string
}

func newFakeRedis(t testing.TB) (*fakeRedis, *redis.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeRedis{ln: ln}
	go f.serve()
	rdb := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), Protocol: 2, DisableIdentity: true,
		MaxRetries: -1, PoolSize: 1})
	t.Cleanup(func() { rdb.Close(); ln.Close() })
	return f, rdb
}

func (f *fakeRedis) reply(rs ...string) {
	f.mu.Lock()
	f.replies = append(f.replies, rs...)
	f.mu.Unlock()
}

func (f *fakeRedis) commands() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.names...)
}

func (f *fakeRedis) serve() {
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
					out = "-ERR unknown command 'HELLO'\r\n" // a RESP2 server's answer
				case "ping":
					out = "+PONG\r\n"
				default:
					f.names = append(f.names, name)
					if len(f.replies) > 0 {
						out, f.replies = f.replies[0], f.replies[1:]
					}
				}
				f.mu.Unlock()
				if _, err := io.WriteString(c, out); err != nil {
					return
				}
			}
		}()
	}
}

// readCommand reads one command (an array of bulk strings) and returns
// its name.
func readCommand(rd *bufio.Reader) (string, error) {
	line, err := rd.ReadString('\n')
	if err != nil {
		return "", err
	}
	n, err := strconv.Atoi(strings.TrimSpace(line[1:]))
	if err != nil {
		return "", err
	}
	var name string
	for i := range n {
		line, err := rd.ReadString('\n')
		if err != nil {
			return "", err
		}
		l, err := strconv.Atoi(strings.TrimSpace(line[1:]))
		if err != nil {
			return "", err
		}
		b := make([]byte, l+2)
		if _, err := io.ReadFull(rd, b); err != nil {
			return "", err
		}
		if i == 0 {
			name = strings.ToLower(string(b[:l]))
		}
	}
	return name, nil
}

// respGen makes RESP replies: claim replies, and values of every type.
type respGen struct{ r *rand.Rand }

func bulk(s string) string   { return "$" + strconv.Itoa(len(s)) + "\r\n" + s + "\r\n" }
func integer(n int64) string { return ":" + strconv.FormatInt(n, 10) + "\r\n" }
func array(elems ...string) string {
	return "*" + strconv.Itoa(len(elems)) + "\r\n" + strings.Join(elems, "")
}

// value is a random RESP value of any type (depth bounds nesting).
func (g respGen) value(depth int) string {
	switch g.r.IntN(16) {
	case 0:
		return "$-1\r\n"
	case 1:
		return "_\r\n"
	case 2:
		return ",3.5\r\n"
	case 3:
		return "#t\r\n"
	case 4:
		return "(12345678901234567890123\r\n"
	case 5:
		return "+OK\r\n"
	case 6:
		return "=6\r\ntxt:ab\r\n"
	case 7:
		return ":99999999999999999999\r\n" // overflows int64
	case 8:
		if depth > 0 {
			return "%1\r\n" + bulk("k") + g.value(depth-1)
		}
		return integer(7)
	case 9:
		if depth > 0 {
			return "~2\r\n" + g.value(depth-1) + g.value(depth-1)
		}
		return bulk("x")
	case 10:
		if depth > 0 {
			return array(g.value(depth-1), g.value(depth-1))
		}
		return "*0\r\n"
	case 11:
		return "-ERR nested\r\n"
	case 12:
		return bulk("")
	case 13:
		return integer(g.r.Int64N(3) - 1)
	default:
		return bulk(fmt.Sprintf("s%d\r\n|%d", g.r.IntN(9), g.r.IntN(9)))
	}
}

// reply is a claim reply, well formed or (with probability bad in each
// place) not.
func (g respGen) reply(bad float64) string {
	odd := func() bool { return g.r.Float64() < bad }
	intOr := func(n int64) string {
		if odd() {
			return g.value(2)
		}
		return integer(n)
	}
	strOr := func(s string) string {
		if odd() {
			return g.value(2)
		}
		return bulk(s)
	}
	// deadlineOr is a fresh entry's deadline: the score as Redis printed
	// it (today's claim), an integer (an older claim's), or not one.
	deadlineOr := func(n int64) string {
		switch {
		case odd():
			return g.value(2)
		case odd():
			return bulk([]string{"", "-5", "+5", "12a", "1e12", strings.Repeat("9", 19), " 17", "1.5"}[g.r.IntN(8)])
		case g.r.IntN(2) == 0:
			return integer(n)
		}
		return bulk(strconv.FormatInt(n, 10))
	}
	var claimed, dead, fresh []string
	for i := range g.r.IntN(4) {
		claimed = append(claimed, strOr(fmt.Sprintf("c%d", i)), intOr(1_700_000_000_000+int64(i)), intOr(int64(g.r.IntN(3))), intOr(int64(g.r.IntN(2))))
	}
	for i := range g.r.IntN(3) {
		dead = append(dead, strOr(fmt.Sprintf("d%d", i)), strOr([]string{"malformed", "score_out_of_range"}[g.r.IntN(2)]))
	}
	for i := range g.r.IntN(5) {
		fresh = append(fresh, strOr(fmt.Sprintf("f%d", i)), deadlineOr(1_700_000_000_000+int64(i)))
	}
	trim := func(l []string) []string {
		if len(l) > 0 && odd() {
			return l[:len(l)-1]
		}
		return l
	}
	listOr := func(l []string) string {
		if odd() {
			return g.value(2)
		}
		return array(trim(l)...)
	}
	fields := []string{intOr(1_700_000_000_000), intOr(-1), intOr(1_700_000_060_000), listOr(claimed), listOr(dead), intOr(int64(g.r.IntN(2))), listOr(fresh)}
	switch {
	case odd():
		fields = fields[:6] // a peek's form: valid too
	case odd():
		fields = fields[:g.r.IntN(6)]
	case odd():
		fields = append(fields, g.value(1))
	}
	if odd() {
		return g.value(2) // not a claim reply at all
	}
	return array(fields...)
}

// goRedisParse is how Claim read a reply before: go-redis's parser, then
// parseClaim.
func goRedisParse(ctx context.Context, rdb *redis.Client, f *fakeRedis, reply string) (ClaimResult, error) {
	f.reply(reply)
	raw, err := rdb.Do(ctx, "evalsha", "x", 0).Slice()
	if err != nil {
		return ClaimResult{}, err
	}
	return parseClaim(raw)
}

// parseClaimReply must read every reply as go-redis and parseClaim read it:
// the same result, or an error where they give one.
func TestParseClaimReplyAgreesWithGoRedis(t *testing.T) {
	f, rdb := newFakeRedis(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	g := respGen{rand.New(rand.NewPCG(seed, 1))}
	var agreedOK, agreedErr int
	for i := range 4000 {
		reply := g.reply([]float64{0, 0.02, 0.1, 0.3}[i%4])
		want, wantErr := goRedisParse(ctx, rdb, f, reply)
		got, gotErr := parseClaimReply([]byte(reply))
		switch {
		case (wantErr != nil) != (gotErr != nil):
			t.Fatalf("seed %d: reply %q:\n go-redis: %+v, %v\n raw:      %+v, %v", seed, reply, want, wantErr, got, gotErr)
		case wantErr != nil:
			agreedErr++
		case !reflect.DeepEqual(want, got):
			t.Fatalf("seed %d: reply %q:\n go-redis: %+v\n raw:      %+v", seed, reply, want, got)
		default:
			agreedOK++
		}
	}
	t.Logf("%d replies read alike, %d refused by both", agreedOK, agreedErr)
	if agreedOK < 500 || agreedErr < 500 {
		t.Fatalf("the generator made %d good and %d bad replies: too few of one kind to tell", agreedOK, agreedErr)
	}
}

// A fresh entry's deadline is the score as Redis printed it: decimal
// digits are read as the integer they spell, by both readers; anything
// else in its place (a sign, a fraction, an exponent, blanks, nothing, more
// digits than an int64 holds) is a malformed reply, never a deadline.
func TestFreshDeadlineIsTheScoreAsRedisPrintedIt(t *testing.T) {
	f, rdb := newFakeRedis(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reply := func(d string) string {
		return array(integer(1_700_000_100_000), integer(-1), integer(-1), "*0\r\n", "*0\r\n", integer(0),
			array(bulk("ORD-1"), bulk(d)))
	}
	for _, d := range []string{"1700000000123", "0", "946684800000", "999999999999999999"} {
		want, _ := strconv.ParseInt(d, 10, 64)
		for name, parse := range map[string]func(string) (ClaimResult, error){
			"raw":      func(r string) (ClaimResult, error) { return parseClaimReply([]byte(r)) },
			"go-redis": func(r string) (ClaimResult, error) { return goRedisParse(ctx, rdb, f, r) },
		} {
			res, err := parse(reply(d))
			if err != nil || len(res.Items) != 1 || res.Items[0].Deadline != want || res.Items[0].Serial != "ORD-1" {
				t.Errorf("%s: deadline %q read as %+v, %v; want %d", name, d, res.Items, err, want)
			}
		}
	}
	for _, d := range []string{"", "-5", "+5", "12a", "1e12", "1.5", " 17", "17 ", "1000000000000000000", "0x10", "１２"} {
		if res, err := parseClaimReply([]byte(reply(d))); !errors.Is(err, ErrReply) {
			t.Errorf("raw: deadline %q read as %+v, %v; want ErrReply", d, res.Items, err)
		}
		if res, err := goRedisParse(ctx, rdb, f, reply(d)); !errors.Is(err, ErrReply) {
			t.Errorf("go-redis: deadline %q read as %+v, %v; want ErrReply", d, res.Items, err)
		}
	}
}

// A reply cut anywhere, or followed by anything, is refused (go-redis
// hands RawCmd one whole value; a reader that accepted less or more would
// misread the fields).
func TestParseClaimReplyRefusesPartsAndExtras(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	g := respGen{rand.New(rand.NewPCG(seed, 2))}
	for range 200 {
		reply := g.reply(0)
		if _, err := parseClaimReply([]byte(reply)); err != nil {
			t.Fatalf("seed %d: a well-formed reply %q: %v", seed, reply, err)
		}
		for cut := range len(reply) {
			if res, err := parseClaimReply([]byte(reply[:cut])); err == nil {
				t.Fatalf("seed %d: %q cut at %d read as %+v", seed, reply, cut, res)
			}
		}
		if res, err := parseClaimReply([]byte(reply + ":1\r\n")); err == nil {
			t.Fatalf("seed %d: %q with a value after it read as %+v", seed, reply, res)
		}
	}
}

// Replies that say the script did not run are sent again through
// runOnce, which loads the script after NOSCRIPT and sends EVALSHA again
// (and, on a cluster, follows MOVED and ASK), never letting the client
// resend a call that may have run.
func TestRunClaimSendsAgainWhenTheScriptDidNotRun(t *testing.T) {
	f, rdb := newFakeRedis(t)
	ok := array(integer(5), integer(-1), integer(-1), array(bulk("a"), integer(3), integer(1), integer(1)), "*0\r\n", integer(0), array(bulk("b"), integer(4)))
	f.reply("-NOSCRIPT No matching script.\r\n", "-NOSCRIPT No matching script.\r\n", bulk(claimScript.Hash()), ok)
	res, err := runClaim(context.Background(), rdb, []string{"q"}, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := ClaimResult{Now: 5, NextQueue: -1, NextExpiry: -1, Reclaimed: 1,
		Items: []Leased{{Serial: "a", Deadline: 3, Attempts: 1}, {Serial: "b", Deadline: 4}}}
	if !reflect.DeepEqual(res, want) {
		t.Fatalf("claim after NOSCRIPT = %+v, want %+v", res, want)
	}
	if got := f.commands(); !reflect.DeepEqual(got, []string{"evalsha", "evalsha", "script", "evalsha"}) {
		t.Fatalf("commands sent %q, want evalsha (raw), evalsha, script load, evalsha (runOnce)", got)
	}
}

// Any other error reply is the script's: returned as go-redis returns it,
// and the script is not run again.
func TestRunClaimReturnsTheScriptsError(t *testing.T) {
	f, rdb := newFakeRedis(t)
	f.reply("-ERR user_script:12: boom\r\n")
	_, err := runClaim(context.Background(), rdb, []string{"q"}, 1)
	if err == nil || err.Error() != "ERR user_script:12: boom" {
		t.Fatalf("error %v, want the reply's text", err)
	}
	if !redis.HasErrorPrefix(err, "user_script") {
		t.Fatalf("error %v is no redis.Error", err)
	}
	if got := f.commands(); !reflect.DeepEqual(got, []string{"evalsha"}) {
		t.Fatalf("commands sent %q, want one evalsha", got)
	}
}

// claimReplyOf500 is a drain's claim reply: 500 fresh entries.
func claimReplyOf500() string {
	fresh := make([]string, 0, 1000)
	for i := range 500 {
		fresh = append(fresh, bulk(fmt.Sprintf("ORD-2026-%06d", i)), bulk(strconv.FormatInt(1_700_000_000_000+int64(i), 10)))
	}
	return array(integer(1_700_000_100_000), integer(1_700_000_000_500), integer(-1), "*0\r\n", "*0\r\n", integer(0), array(fresh...))
}

// The claim's reply read the way Claim read it before (go-redis's parser,
// then parseClaim) and the way it does now, over a loopback connection.
func BenchmarkClaimReplyGoRedis(b *testing.B) {
	f, rdb := newFakeRedis(b)
	reply, ctx := claimReplyOf500(), context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := goRedisParse(ctx, rdb, f, reply); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkClaimReplyRaw(b *testing.B) {
	f, rdb := newFakeRedis(b)
	reply, ctx := claimReplyOf500(), context.Background()
	b.ReportAllocs()
	for b.Loop() {
		f.reply(reply)
		if _, err := runClaim(ctx, rdb, []string{"q"}, 1); err != nil {
			b.Fatal(err)
		}
	}
}

// Every reply that says the script did not run is sent again through
// Script.Run (on a cluster client, that is what follows MOVED and ASK);
// other error replies are not.
func TestRunClaimSendsAgainOnlyWhatDidNotRun(t *testing.T) {
	ok := array(integer(5), integer(-1), integer(-1), "*0\r\n", "*0\r\n", integer(0), array(bulk("b"), integer(4)))
	for _, c := range []struct {
		reply string
		again bool
	}{
		{"-MOVED 3999 127.0.0.1:6381\r\n", true},
		{"-ASK 3999 127.0.0.1:6381\r\n", true},
		{"-LOADING Redis is loading the dataset in memory\r\n", true},
		{"-READONLY You can't write against a read only replica.\r\n", true},
		{"-CLUSTERDOWN The cluster is down\r\n", true},
		{"-TRYAGAIN Multiple keys request during rehashing of slot\r\n", true},
		{"-MASTERDOWN Link with MASTER is down\r\n", true},
		{"-NOREPLICAS Not enough good replicas to write.\r\n", true},
		{"-ERR max number of clients reached\r\n", true},
		{"-BUSY Redis is busy running a script.\r\n", false},
		{"-OOM command not allowed when used memory > 'maxmemory'.\r\n", false},
		{"-ERR Error running script (call to f_x): @user_script:1: boom\r\n", false},
		{"!21\r\nERR blob error, RESP3\r\n", false},
	} {
		f, rdb := newFakeRedis(t)
		f.reply(c.reply, ok)
		res, err := runClaim(context.Background(), rdb, []string{"q"}, 1)
		cmds := f.commands()
		switch {
		case c.again && (err != nil || len(res.Items) != 1 || len(cmds) != 2):
			t.Errorf("%q: %+v, %v after %q; want the claim sent again and read", c.reply, res, err, cmds)
		case !c.again && (err == nil || len(cmds) != 1 || !strings.Contains(c.reply, err.Error())):
			t.Errorf("%q: %+v, %v after %q; want its error, sent once", c.reply, res, err, cmds)
		}
	}
}
