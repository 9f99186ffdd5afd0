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
