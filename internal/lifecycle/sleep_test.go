package lifecycle

import (
	"context"
	"testing"
	"time"
)

// TestSleep: a pause runs its length unless its context ends, which cuts
// it short and says so.
func TestSleep(t *testing.T) {
	if !Sleep(context.Background(), time.Millisecond) {
		t.Error("Sleep(1ms) on a live context: false, want true (it waited)")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Sleep(ctx, time.Hour) {
		t.Error("Sleep(1h) on an ended context: true, want false at once")
	}
	ctx, cancel = context.WithCancel(context.Background())
	ended := make(chan bool)
	go func() { ended <- Sleep(ctx, time.Hour) }()
	cancel()
	if <-ended {
		t.Error("Sleep(1h) whose context ends midway: true, want false")
	}
}

// TestJitter: a spread of d/n stays within d ± d/n and reaches both ends'
// neighbourhood; n 0 is d itself.
func TestJitter(t *testing.T) {
	const d = 100 * time.Millisecond
	if got := Jitter(d, 0); got != d {
		t.Errorf("Jitter(d, 0) = %v, want d", got)
	}
	lo, hi := d, d
	for range 10000 {
		got := Jitter(d, 5)
		if got < d-d/5 || got > d+d/5 {
			t.Fatalf("Jitter(%v, 5) = %v, outside ±20%%", d, got)
		}
		lo, hi = min(lo, got), max(hi, got)
	}
	if lo > d-d/6 || hi < d+d/6 {
		t.Errorf("10,000 draws spanned %v to %v, want about %v to %v", lo, hi, d-d/5, d+d/5)
	}
}
