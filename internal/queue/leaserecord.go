package queue

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// BackoffToken is the token of a lease record whose entry is backing off
// (a retry is due at its expiry) rather than leased.
const BackoffToken = "-"

// LeaseRecord is the record {Q}:lease keeps for each leased or backing-off
// entry, "deadline|attempts|token|last error" — the Go side of the lease
// scripts' parse() (luaHelpers). Every Go reader of the lease hash goes
// through ParseLeaseRecord.
type LeaseRecord struct {
	Deadline  int64  // the entry's true deadline, Unix ms; 0 when the field is not an integer
	Attempts  int    // attempts spent; 0 when the field is not an integer
	Token     string // the lease token of the claim that holds it, or BackoffToken
	LastError string // the last failure's message ("" if none)
}

// ParseLeaseRecord reads a lease record. ok is false when rec has fewer
// than three fields (no token): not a record any script writes. The last
// error may itself hold '|' (scripts write it as '/', but a raw write may
// not); everything after the third '|' is the last error.
func ParseLeaseRecord(rec string) (r LeaseRecord, ok bool) {
	f := strings.SplitN(rec, "|", 4)
	if len(f) < 3 {
		return LeaseRecord{}, false
	}
	r.Deadline, _ = strconv.ParseInt(f[0], 10, 64)
	r.Attempts, _ = strconv.Atoi(f[1])
	r.Token = f[2]
	if len(f) == 4 {
		r.LastError = f[3]
	}
	return r, true
}

// String encodes r as the scripts write it ('|' in the last error becomes
// '/', as retryScript and buryScript do).
func (r LeaseRecord) String() string {
	return strconv.FormatInt(r.Deadline, 10) + "|" + strconv.Itoa(r.Attempts) + "|" + r.Token + "|" +
		strings.ReplaceAll(r.LastError, "|", "/")
}

// Backoff reports whether the record is a backoff's, not a lease's.
func (r LeaseRecord) Backoff() bool { return r.Token == BackoffToken }

// LeaseRecords reads the lease records of serials in one command; ok[i] is
// false when serials[i] has none (it is not leased or backing off) or a
// damaged one.
func (s *Store) LeaseRecords(ctx context.Context, serials []string) (recs []LeaseRecord, ok []bool, err error) {
	recs, ok = make([]LeaseRecord, len(serials)), make([]bool, len(serials))
	if len(serials) == 0 {
		return recs, ok, nil
	}
	raw, err := s.rdb.HMGet(ctx, s.keys.Lease, serials...).Result()
	if err != nil {
		return nil, nil, fmt.Errorf("read lease records: %w", err)
	}
	for i, v := range raw {
		if rec, isStr := v.(string); isStr {
			recs[i], ok[i] = ParseLeaseRecord(rec)
		}
	}
	return recs, ok, nil
}
