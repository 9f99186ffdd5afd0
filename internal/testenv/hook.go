package testenv

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// SentAfter is a go-redis hook (Client.AddHook) that reports the first
// command, or pipeline, sent once Arm was called: with a Proxy stalling
// the replies, a test knows its client is inside a call that waits.
type SentAfter struct {
	armed atomic.Bool
	once  sync.Once
	sent  chan struct{}
}

// NewSentAfter returns an unarmed hook.
func NewSentAfter() *SentAfter { return &SentAfter{sent: make(chan struct{})} }

// Arm makes the next command sent close Sent's channel.
func (h *SentAfter) Arm() { h.armed.Store(true) }

// Sent is closed when the first command after Arm was sent.
func (h *SentAfter) Sent() <-chan struct{} { return h.sent }

func (h *SentAfter) hit() {
	if h.armed.Load() {
		h.once.Do(func() { close(h.sent) })
	}
}

// DialHook passes dials through.
func (h *SentAfter) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook notes a command.
func (h *SentAfter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.hit()
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook notes a pipeline.
func (h *SentAfter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.hit()
		return next(ctx, cmds)
	}
}
