package queue_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Redis keeps a hash of up to hash-max-listpack-entries fields (512 by
// default) as a listpack, where every field a command names is found by a
// scan of the whole hash: one batch of 500 records there costs its claim,
// fence and finish about 500 × 250 comparisons each (BenchmarkDrainScripts,
// listpack=512 against 128). The claim keeps the lease hash a hash table
// once it holds more than leaseHashCompact records, whatever the server's
// setting, and small hashes compact.
const leaseHashCompact = 128

func TestLeaseHashOfABigBatchIsAHashTable(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	// The names Redis 6.2 knows, still aliases in 7.x.
	if v, err := rdb.ConfigGet(ctx, "hash-max-ziplist-*").Result(); err == nil {
		if n, _ := strconv.Atoi(v["hash-max-ziplist-entries"]); n <= leaseHashCompact {
			t.Logf("this server keeps hashes of only %d fields compact: the test passes without the claim's help", n)
		}
		if n, _ := strconv.Atoi(v["hash-max-ziplist-value"]); n >= 1024 {
			t.Skipf("this server keeps values of up to %d bytes compact: the claim cannot make its lease hash a table", n)
		}
	}
	for _, tc := range []struct {
		name      string
		before    int // records leased by an earlier claim
		claim     int
		wantTable bool
	}{
		{"a small batch alone stays compact", 0, leaseHashCompact, false},
		{"a big batch into an empty hash", 0, 500, true},
		{"a small batch that takes the hash past the bound", 100, 40, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := rdb.Del(ctx, k.Queue, k.Lease, k.Leases, k.LeaseBatch).Err(); err != nil {
				t.Fatal(err)
			}
			base := dueAt(t, st, 0)
			add := func(prefix string, n int) {
				zs := make([]redis.Z, n)
				for i := range zs {
					zs[i] = redis.Z{Score: base + float64(i), Member: fmt.Sprintf("%s-%04d", prefix, i)}
				}
				if n > 0 {
					if err := rdb.ZAdd(ctx, k.Queue, zs...).Err(); err != nil {
						t.Fatal(err)
					}
				}
			}
			claim := func(tok string, n int) {
				res, err := st.Claim(ctx, queue.ClaimArgs{Limit: n, Lease: time.Minute, Token: tok, Batch: true})
				if err != nil || len(res.Items) != n {
					t.Fatalf("claim %s: %d items, %v; want %d", tok, len(res.Items), err, n)
				}
			}
			if tc.before > 0 {
				add("A", tc.before)
				claim("test:a.1", tc.before)
			}
			add("B", tc.claim)
			claim("test:b.1", tc.claim)
			enc, err := rdb.ObjectEncoding(ctx, k.Lease).Result()
			if err != nil {
				t.Fatal(err)
			}
			if got := enc == "hashtable"; got != tc.wantTable {
				t.Errorf("lease hash of %d records is a %s, want a hash table: %v", tc.before+tc.claim, enc, tc.wantTable)
			}
			// Only the records of what was leased: nothing the claim used
			// to make the hash a table is left behind.
			if n := rdb.HLen(ctx, k.Lease).Val(); n != int64(tc.before+tc.claim) {
				t.Errorf("lease hash holds %d fields, want %d (one per leased serial)", n, tc.before+tc.claim)
			}
			keys, err := rdb.HKeys(ctx, k.Lease).Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range keys {
				if err := queue.ValidateSerial(f); err != nil {
					t.Errorf("lease hash holds field %q, which is no serial: %v", f, err)
				}
			}
		})
	}
}
