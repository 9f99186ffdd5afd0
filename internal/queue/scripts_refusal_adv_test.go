package queue_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// The claim is not the only script whose writes stay when a later
// command is refused: retry, bury and hand-back take their members off
// the batch count (release, which drops the batch with the last one)
// before they write where the members go. Refused there, the members
// keep records carrying a batch that no longer exists, and are in no
// other key: no claim finds them, and the reconciler leaves a serial with
// a record alone. (The consumer's refusal log says "nothing is lost".)
func TestAdvLeaseScriptsRefusedAfterReleaseLoseTheBatch(t *testing.T) {
	for _, tc := range []struct {
		name, refuse string
		do           func(st *queue.Store, serials []string) error
	}{
		{"retry/-hset", "-hset", func(st *queue.Store, s []string) error {
			_, err := st.Retry(context.Background(), queue.RetryArgs{Token: "t:1", Serials: s, Delay: time.Second, LastError: "db down"})
			return err
		}},
		{"hand back/-zadd", "-zadd", func(st *queue.Store, s []string) error {
			_, err := st.HandBack(context.Background(), "t:1", s)
			return err
		}},
		{"bury/-zadd", "-zadd", func(st *queue.Store, s []string) error {
			_, err := st.Bury(context.Background(), queue.BuryArgs{Token: "t:1", Serials: s, Reason: queue.ReasonCloseFailed, LastError: "x", CountRun: true})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			admin, k, st, claimer, acl := aclClaimer(t, "adv:scripts")
			ctx := context.Background()
			base := dueAt(t, st, 0)
			serials := []string{"S-0", "S-1", "S-2"}
			for i, s := range serials {
				admin.ZAdd(ctx, k.Queue, redis.Z{Score: base + float64(i), Member: s})
			}
			if r, err := st.Claim(ctx, queue.ClaimArgs{Limit: 10, Lease: time.Minute, Token: "t:1", Batch: true}); err != nil || len(r.Items) != 3 {
				t.Fatalf("claim: %+v, %v", r, err)
			}
			acl(tc.refuse)
			err := tc.do(claimer, serials)
			t.Logf("%s, %s refused: %v", tc.name, tc.refuse, err)
			acl()
			for _, s := range serials {
				if where := findable(t, admin, k, s); where == "" && admin.ZScore(ctx, k.Dead, s).Err() != nil {
					held, _ := st.InQueue(ctx, []string{s})
					t.Errorf("%s: in no place a claim looks, not dead-lettered (%s); InQueue %v", s, leaseState(t, admin, k, s), held)
				}
			}
		})
	}
}
