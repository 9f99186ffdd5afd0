package queue_test

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A retry's backoff ends no sooner than its delay after the retry ran, to
// the microsecond of Redis's clock: the scripts read the clock to the
// millisecond rounded down, so a backoff of now_ms + delay could end up
// to a millisecond early (worker.RetryAfter promises "no sooner than d";
// TestRetryAfterDelayHonoured in package worker saw 1.4992 s for 1.5 s).
// Each round reads Redis's clock just before the retry: the backoff's end
// must lie at least the delay after it. No delay stays due at once: the
// next claim takes it back.
func TestRetryBackoffEndsNoSoonerThanItsDelay(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	for i, delay := range []time.Duration{0, time.Millisecond, 1500 * time.Millisecond, 1500*time.Millisecond + 400*time.Microsecond, time.Minute} {
		for round := range 25 {
			s := fmt.Sprintf("RD-%d-%d", i, round)
			now, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(queue.DeadlineMillis(now.Add(-time.Second))), Member: s}).Err(); err != nil {
				t.Fatal(err)
			}
			tok := fmt.Sprintf("rd:%d.%d", i, round)
			if res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1, Lease: time.Minute, Token: tok, Batch: true}); err != nil || len(res.Items) != 1 {
				t.Fatalf("claim: %+v, %v", res, err)
			}
			before, err := st.Now(ctx)
			if err != nil {
				t.Fatal(err)
			}
			res, err := st.Retry(ctx, queue.RetryArgs{Token: tok, Serials: []string{s}, Delay: delay})
			if err != nil || res.Moved != 1 {
				t.Fatalf("retry: %+v, %v", res, err)
			}
			if delay == 0 {
				if again, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1, Lease: time.Minute, Token: tok + "b", Batch: true}); err != nil || len(again.Items) != 1 {
					t.Fatalf("a retry with no delay is not due at once: the claim after it took %+v, %v", again, err)
				}
				testenv.DeleteQueue(rdb, k)
				continue
			}
			if end, earliest := time.UnixMilli(res.At), before.Add(delay); end.Before(earliest) {
				t.Fatalf("delay %v: the backoff ends at %s, %v after the clock read just before the retry (%s)",
					delay, end.Format("15:04:05.000000"), end.Sub(before), before.Format("15:04:05.000000"))
			}
			if score, err := rdb.ZScore(ctx, k.Inflight, s).Result(); err != nil || int64(score) != res.At {
				t.Fatalf("the backoff's entry: %v, %v; want %d", score, err, res.At)
			}
			testenv.DeleteQueue(rdb, k) // the next round's claim takes its own entry, not this backoff
		}
	}
}

// A retry with the longest delay a time.Duration holds (worker.RetryAfter
// of math.MaxInt64, a policy or BackoffMax set to "never") must stay in
// backoff for about 292 years, not come due at once: rounding the delay up
// to the millisecond must not overflow into a negative delay.
func TestRetryHugeDelayStaysInBackoff(t *testing.T) {
	rdb, k := testenv.Redis(t)
	ctx := context.Background()
	st := queue.NewStore(rdb, k)
	for i, delay := range []time.Duration{math.MaxInt64, math.MaxInt64 - 1, math.MaxInt64 - 999_998, 200 * 365 * 24 * time.Hour} {
		s := fmt.Sprintf("HUGE-%d", i)
		now, err := st.Now(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := rdb.ZAdd(ctx, k.Queue, redis.Z{Score: float64(queue.DeadlineMillis(now.Add(-time.Second))), Member: s}).Err(); err != nil {
			t.Fatal(err)
		}
		tok := fmt.Sprintf("huge:%d", i)
		if res, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1, Lease: time.Minute, Token: tok, Batch: true}); err != nil || len(res.Items) != 1 {
			t.Fatalf("claim: %+v, %v", res, err)
		}
		res, err := st.Retry(ctx, queue.RetryArgs{Token: tok, Serials: []string{s}, Delay: delay})
		if err != nil || res.Moved != 1 {
			t.Fatalf("retry: %+v, %v", res, err)
		}
		if want := now.Add(100 * 365 * 24 * time.Hour).UnixMilli(); res.At < want {
			t.Errorf("delay %v (%d ns): the backoff ends at %d ms (%v from now), want after %d ms (100 years on)",
				delay, int64(delay), res.At, time.Duration(res.At-now.UnixMilli())*time.Millisecond, want)
		}
		if again, err := st.Claim(ctx, queue.ClaimArgs{Limit: 1, Lease: time.Minute, Token: tok + "b", Batch: true}); err != nil || len(again.Items) != 0 {
			t.Errorf("delay %v: a claim right after the retry took %+v, %v; want nothing (the retry is due in centuries)", delay, again.Items, err)
		}
		testenv.DeleteQueue(rdb, k)
	}
}
