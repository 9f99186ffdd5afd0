package queue_test

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

var leaseRecordCases = []struct {
	rec  string
	want queue.LeaseRecord
	ok   bool
}{
	{"1700000000000|2|A:x.1|boom", queue.LeaseRecord{Deadline: 1700000000000, Attempts: 2, Token: "A:x.1", LastError: "boom"}, true},
	{"1700000000000|0|A:x.1|", queue.LeaseRecord{Deadline: 1700000000000, Token: "A:x.1"}, true},
	{"1700000000000|0|A:x.1", queue.LeaseRecord{Deadline: 1700000000000, Token: "A:x.1"}, true}, // written before last errors
	{"1700000000000|3|-|timeout", queue.LeaseRecord{Deadline: 1700000000000, Attempts: 3, Token: "-", LastError: "timeout"}, true},
	{"1700000000000|1|poll.X|a|b", queue.LeaseRecord{Deadline: 1700000000000, Attempts: 1, Token: "poll.X", LastError: "a|b"}, true},
	{"garbage|x|tok|e", queue.LeaseRecord{Token: "tok", LastError: "e"}, true}, // damaged numbers read as 0
	{"1700000000000|2", queue.LeaseRecord{}, false},
	{"1700000000000", queue.LeaseRecord{}, false},
	{"", queue.LeaseRecord{}, false},
}

func TestParseLeaseRecord(t *testing.T) {
	for _, tt := range leaseRecordCases {
		got, ok := queue.ParseLeaseRecord(tt.rec)
		if got != tt.want || ok != tt.ok {
			t.Errorf("ParseLeaseRecord(%q) = %+v, %v; want %+v, %v", tt.rec, got, ok, tt.want, tt.ok)
		}
	}
	r := queue.LeaseRecord{Deadline: 1700000000000, Attempts: 4, Token: "-", LastError: "a|b"}
	if got, ok := queue.ParseLeaseRecord(r.String()); !ok || got.LastError != "a/b" || got.Deadline != r.Deadline ||
		got.Attempts != 4 || !got.Backoff() {
		t.Errorf("round trip of %+v: %+v, %v", r, got, ok)
	}
}

// The Go codec and the scripts' parse() read every record alike: the
// token decides every compare-and-set, the deadline a hand-back.
func TestParseLeaseRecordAgreesWithLua(t *testing.T) {
	rdb, _ := testenv.Redis(t)
	script := redis.NewScript(queue.LuaHelpers + `
local d, a, tok, e = parse(ARGV[1])
return {tostring(d), tostring(a), tok or false, e or false}
`)
	for _, tt := range leaseRecordCases {
		if !tt.ok {
			continue // parse() of a record without a token is nil to every caller
		}
		v, err := script.Run(context.Background(), rdb, nil, tt.rec).Slice()
		if err != nil && !errors.Is(err, redis.Nil) {
			t.Fatal(err)
		}
		got, _ := queue.ParseLeaseRecord(tt.rec)
		tok, _ := v[2].(string)
		if tok != got.Token {
			t.Errorf("%q: Lua token %q, Go %q", tt.rec, tok, got.Token)
		}
		if d, _ := v[0].(string); d != "nil" && d != strconv.FormatInt(got.Deadline, 10) {
			t.Errorf("%q: Lua deadline %s, Go %d", tt.rec, d, got.Deadline)
		}
		if a, _ := v[1].(string); a != strconv.Itoa(got.Attempts) {
			t.Errorf("%q: Lua attempts %s, Go %d", tt.rec, a, got.Attempts)
		}
	}
}

// LeaseRecords reads what the claim wrote and reports entries without a
// record, or with a damaged one, as not held.
func TestStoreLeaseRecords(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	st := queue.NewStore(rdb, keys)
	ctx := context.Background()
	if err := rdb.HSet(ctx, keys.Lease, "a", "1700000000000|1|T|", "junk", "17").Err(); err != nil {
		t.Fatal(err)
	}
	recs, ok, err := st.LeaseRecords(ctx, []string{"a", "none", "junk"})
	if err != nil {
		t.Fatal(err)
	}
	if !ok[0] || recs[0].Token != "T" || recs[0].Attempts != 1 || ok[1] || ok[2] {
		t.Errorf("LeaseRecords = %+v, %v", recs, ok)
	}
}
