package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// The claim's reply read without go-redis's generic parser.
//
// go-redis reads a script's reply into []any: every serial of a claim
// becomes a string boxed into an interface, and every deadline an int64
// boxed into one, three allocations per claimed order, the largest share
// of the daemon's allocations in a drain after the driver's (issue 13).
// runClaim asks go-redis for the reply's bytes instead (RawCmd) and
// parseClaimReply reads the claim's fields straight out of them: the reply
// becomes one string, each serial a part of it, so a claim allocates a
// handful of times whatever its size. (The serials keep the reply's
// string alive while any of them lives: a batch's lifetime.)
//
// A raw reply carries an error reply as bytes, where go-redis would have
// acted on it: run the script source after NOSCRIPT, follow a cluster
// redirection (MOVED, ASK), retry a server that is loading, read-only,
// or otherwise says "not now". Those replies mean the script did not run,
// and the claim is sent again the usual way (claimScript.Run), which does
// all of that; any other error reply is the script's own and is returned
// as go-redis returns it, a redis.Error with the reply's text.

// runClaim runs claimScript with keys and args and reads its reply.
func runClaim(ctx context.Context, rdb redis.UniversalClient, keys []string, args ...any) (ClaimResult, error) {
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, "evalsha", claimScript.Hash(), len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmdArgs = append(cmdArgs, args...)
	cmd := redis.NewRawCmd(ctx, cmdArgs...)
	if len(keys) > 0 {
		cmd.SetFirstKeyPos(3) // the cluster client routes by the first key
	}
	// Never resent by the client: a second run would claim more under the
	// same token (onceCmd).
	if err := rdb.Process(ctx, onceRawCmd{cmd}); err != nil {
		return ClaimResult{}, err
	}
	res, err := parseClaimReply(cmd.Val())
	var rerr replyError
	if errors.As(err, &rerr) && rerr.notRun() {
		// The script did not run (NOSCRIPT, a redirection, a loading or
		// read-only server): go-redis acts on these only for replies it
		// parses itself, so run it the ordinary way, still never resent.
		raw, err := runOnce(ctx, rdb, claimScript, keys, args...).Slice()
		if err != nil {
			return ClaimResult{}, err
		}
		return parseClaim(raw)
	}
	return res, err
}

// onceRawCmd is onceCmd for the claim's raw reply.
type onceRawCmd struct{ *redis.RawCmd }

// NoRetry tells go-redis not to resend the command once it may have
// reached the server.
func (onceRawCmd) NoRetry() bool { return true }

// replyError is an error reply of Redis: a redis.Error, as go-redis
// returns them (redis.HasErrorPrefix reads it).
type replyError string

func (e replyError) Error() string { return string(e) }

// RedisError marks it as a redis.Error.
func (replyError) RedisError() {}

// notRunPrefixes begin the error replies that say a command was not run,
// those go-redis acts on (Script.Run, the cluster client, shouldRetry).
var notRunPrefixes = []string{"NOSCRIPT", "MOVED ", "ASK ", "LOADING ", "READONLY ", "CLUSTERDOWN ",
	"TRYAGAIN ", "MASTERDOWN ", "NOREPLICAS ", "ERR max number of clients reached"}

func (e replyError) notRun() bool {
	for _, p := range notRunPrefixes {
		if strings.HasPrefix(string(e), p) {
			return true
		}
	}
	return false
}

// parseClaimReply is parseClaim for the claim's reply as Redis sent it
// (RESP2 or RESP3): the same checks, the same result. An error reply is
// returned as a replyError; an error within the reply is a value of the
// wrong type, as it is to go-redis.
func parseClaimReply(raw []byte) (ClaimResult, error) {
	var r ClaimResult
	rd := respReader{s: string(raw)}
	k, n, msg := rd.next()
	switch {
	case rd.err != nil:
		return r, rd.err
	case k == respErr:
		return r, replyError(msg)
	case k != respArr:
		return r, fmt.Errorf("%w: the reply is not an array", ErrReply)
	case n != 6 && n != 7:
		return r, fmt.Errorf("%w: %d fields, want 6 or 7", ErrReply, n)
	}
	// One pass over the fields, each list skipped and its place kept; the
	// claimed and fresh lists are read once their lengths size Items.
	type field struct {
		kind respKind
		n    int64 // an integer's value, a list's length
		at   int   // where a list's elements begin
	}
	var fs [7]field
	fs[6] = field{kind: respArr} // a peek's or forward's six fields: no fresh list
	for i := range int(n) {
		k, v, _ := rd.next()
		fs[i] = field{kind: k, n: v, at: rd.pos}
		rd.skipRest(k, v)
		if rd.err != nil {
			return r, rd.err
		}
	}
	if rd.pos != len(rd.s) {
		return r, fmt.Errorf("%w: %d bytes after the reply", ErrReply, len(rd.s)-rd.pos)
	}
	for i, p := range [...]*int64{0: &r.Now, 1: &r.NextQueue, 2: &r.NextExpiry} {
		if fs[i].kind != respInt {
			return r, fmt.Errorf("%w: field %d is %s", ErrReply, i, fs[i].kind)
		}
		*p = fs[i].n
	}
	if fs[5].kind != respInt {
		return r, fmt.Errorf("%w: field 5 is %s", ErrReply, fs[5].kind)
	}
	r.Paused = fs[5].n == 1
	claimed, dead, fresh := fs[3], fs[4], fs[6]
	if claimed.kind != respArr || dead.kind != respArr || fresh.kind != respArr ||
		claimed.n%4 != 0 || dead.n%2 != 0 || fresh.n%2 != 0 {
		return r, fmt.Errorf("%w: malformed claimed, dead or fresh list", ErrReply)
	}
	r.Items = make([]Leased, 0, claimed.n/4+fresh.n/2)
	rd.pos = claimed.at
	for i := range claimed.n / 4 {
		ks, _, s := rd.next()
		kd, d, _ := rd.next()
		ka, a, _ := rd.next()
		kg, again, _ := rd.next()
		if ks != respStr || kd != respInt || ka != respInt || kg != respInt {
			return r, fmt.Errorf("%w: malformed claimed entry %d", ErrReply, i)
		}
		r.Items = append(r.Items, Leased{Serial: s, Deadline: d, Attempts: int(a)})
		if again == 1 {
			r.Reclaimed++
		}
	}
	rd.pos = fresh.at
	for i := range fresh.n / 2 {
		ks, _, s := rd.next()
		kd, d, ds := rd.next()
		if kd == respStr {
			var ok bool
			if d, ok = plainDeadline(ds); !ok {
				kd = respOther
			} else {
				kd = respInt
			}
		}
		if ks != respStr || kd != respInt {
			return r, fmt.Errorf("%w: malformed fresh entry %d", ErrReply, i)
		}
		r.Items = append(r.Items, Leased{Serial: s, Deadline: d})
	}
	if dead.n > 0 {
		r.Dead = map[string]int{}
		rd.pos = dead.at
		for range dead.n / 2 {
			rd.skip() // the serial
			k, m, reason := rd.next()
			if k != respStr {
				reason = "" // as parseClaim: a reason that is no string counts as ""
				rd.skipRest(k, m)
			}
			r.Dead[reason]++
		}
	}
	return r, nil
}

// respKind is what a RESP value is, as far as a claim's reply goes.
type respKind uint8

const (
	respOther respKind = iota // null, double, boolean, big number, map
	respInt
	respStr // bulk, simple or verbatim string
	respArr // array, set or push: n elements follow
	respErr
)

func (k respKind) String() string {
	return [...]string{"another type", "an integer", "a string", "an array", "an error"}[k]
}

// respReader reads RESP values out of s. The first malformed byte sets
// err (an ErrReply); what is read after that is empty.
type respReader struct {
	s   string
	pos int
	err error
}

// line returns the type byte at pos and the rest of its line.
func (r *respReader) line() (byte, string) {
	if r.err != nil {
		return 0, ""
	}
	end := strings.Index(r.s[r.pos:], "\r\n")
	if end < 1 {
		r.fail("a line without its CRLF")
		return 0, ""
	}
	t, rest := r.s[r.pos], r.s[r.pos+1:r.pos+end]
	r.pos += end + 2
	return t, rest
}

func (r *respReader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s at byte %d", ErrReply, what, r.pos)
	}
}

func (r *respReader) length(s string) int64 {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < -1 {
		r.fail("a bad length")
		return 0
	}
	return n
}

// next reads one value's head: an integer's value, a string's text (a
// part of s), an array's length (its elements come next), an error's
// text. Other values are read whole.
func (r *respReader) next() (k respKind, n int64, s string) {
	t, line := r.line()
	switch t {
	case 0:
		return respOther, 0, ""
	case ':':
		v, err := strconv.ParseInt(line, 10, 64)
		if err != nil {
			r.fail("a bad integer")
			return respOther, 0, ""
		}
		return respInt, v, ""
	case '+':
		return respStr, 0, line
	case '-':
		return respErr, 0, line
	case '$', '=', '!':
		l := r.length(line)
		if l < 0 || r.err != nil {
			return respOther, 0, "" // a null string
		}
		if int64(len(r.s)-r.pos) < l+2 || r.s[r.pos+int(l):r.pos+int(l)+2] != "\r\n" {
			r.fail("a string shorter than its length")
			return respOther, 0, ""
		}
		s = r.s[r.pos : r.pos+int(l)]
		r.pos += int(l) + 2
		switch t {
		case '!':
			return respErr, 0, s
		case '=':
			if len(s) < 4 || s[3] != ':' {
				r.fail("a verbatim string without its format")
				return respOther, 0, ""
			}
			return respStr, 0, s[4:] // "txt:" and the like, as go-redis drops them
		}
		return respStr, 0, s
	case '*', '~', '>':
		l := r.length(line)
		if l < 0 || r.err != nil {
			return respOther, 0, "" // a null array
		}
		return respArr, l, ""
	case '%':
		l := r.length(line)
		for i := int64(0); i < 2*l && r.err == nil; i++ {
			r.skip()
		}
		return respOther, 0, ""
	case '_', ',', '#', '(':
		return respOther, 0, ""
	}
	r.fail(fmt.Sprintf("type %q", t))
	return respOther, 0, ""
}

// skip reads one value whole.
func (r *respReader) skip() {
	k, n, _ := r.next()
	r.skipRest(k, n)
}

// skipRest reads the elements of an array whose head next returned. It
// stops at the first error: a cut reply's header may count far more
// elements than follow (2^62), and each would be "read" as nothing.
func (r *respReader) skipRest(k respKind, n int64) {
	if k == respArr {
		for i := int64(0); i < n && r.err == nil; i++ {
			r.skip()
		}
	}
}

// plainDeadline reads a fresh entry's deadline as the claim answers it:
// the score as Redis printed it, 1 to 18 decimal digits (a whole score
// prints so, and a due one, at most now, has 13).
func plainDeadline(s string) (int64, bool) {
	if len(s) == 0 || len(s) > 18 {
		return 0, false
	}
	var d int64
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		d = d*10 + int64(c-'0')
	}
	return d, true
}
