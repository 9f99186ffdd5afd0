package maintain

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// taskPurger records what the janitor asked of the task queues.
type taskPurger struct {
	calls []string
	err   error
}

func (p *taskPurger) PurgeDead(ctx context.Context, age time.Duration, keep int) (map[string]int, error) {
	if _, ok := ctx.Deadline(); !ok {
		return nil, errors.New("a pass without a deadline")
	}
	p.calls = append(p.calls, fmt.Sprintf("%s/%d", age, keep))
	return map[string]int{"mail": 1}, p.err
}

// TestJanitorPassPurgesBothSidesUnderItsDeadline: one pass trims the order
// queue's dead letters to the cap and hands the task queues the global
// retention; a failure on one side does not skip the other.
func TestJanitorPassPurgesBothSidesUnderItsDeadline(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	ctx := context.Background()
	now := time.Now().UnixMilli()
	for i := range 5 {
		if err := rdb.ZAdd(ctx, keys.Dead, redis.Z{Score: float64(now - int64(i)), Member: fmt.Sprintf("d-%d", i)}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	tools, err := admin.New(rdb, keys.Queue, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp := &taskPurger{err: errors.New("task queue redis down")}
	j := NewJanitor(JanitorConfig{Retention: time.Hour, Max: 2, Tasks: tp}, tools, zap.NewNop())
	res, err := j.RunOnce(ctx)
	if !errors.Is(err, tp.err) {
		t.Errorf("RunOnce error %v, want the task side's", err)
	}
	if res.Orders != 3 || res.Tasks["mail"] != 1 {
		t.Errorf("purged %+v, want 3 order dead letters and the task side's count", res)
	}
	if n, _ := rdb.ZCard(ctx, keys.Dead).Result(); n != 2 {
		t.Errorf("%d dead letters left, want the cap of 2", n)
	}
	if len(tp.calls) != 1 || tp.calls[0] != "1h0m0s/2" {
		t.Errorf("task queues asked %q, want one call with the global retention 1h0m0s/2", tp.calls)
	}
}

// TestJanitorWithNothingToPurgeReturnsAtOnce: no retention, no cap and no
// task queues: Run has nothing to do and ends (a one-shot actor).
func TestJanitorWithNothingToPurgeReturnsAtOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := NewJanitor(JanitorConfig{}, nil, zap.NewNop()).Run(ctx); err != nil {
		t.Fatal(err)
	}
}
