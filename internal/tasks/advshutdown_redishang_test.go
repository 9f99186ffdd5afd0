package tasks

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Redis hangs (connections open, no answers) when the daemon is stopped
// while a webhook batch is in flight. README ("How it works", shutdown)
// bounds the stop by one Redis call's read timeout for the hand-back of a
// batch cut at the drain, whatever its size: the drain's cut must hand
// the batch back in one call, not one call per task (each of which waits
// out the read timeout, 5 s: minutes for a batch of 100, the task queues'
// default). Each failed hand-back call logs once; the batch's stop must
// log one.
func TestAdvShutdownWithRedisHangingHandsBackABatchInOneCall(t *testing.T) {
	t.Setenv("OD_SHUT_SECRET", "0123456789abcdef0123456789abcdef")
	const n = 5
	var inFlight atomic.Int32
	all := make(chan struct{})
	var once sync.Once
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) //nolint:errcheck // only counted
		if inFlight.Add(1) == n {
			once.Do(func() { close(all) })
		}
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer srv.Close()
	defer close(release)
	s := newShutdownEnv(t, `lease: 1m, batch_size: 5, workers: 1, action: {type: webhook, url: '`+srv.URL+`', timeout: 20s, secret_env: OD_SHUT_SECRET}`, nil)
	px := testenv.NewProxy(t, s.rdb.Options().Addr)
	via := redis.NewClient(&redis.Options{Addr: px.Addr(), DB: s.rdb.Options().DB})
	t.Cleanup(func() { via.Close() })
	s.put("h", n, time.Now().Add(-time.Second))

	cfg := s.m.consumerConfig(s.r)
	cfg.DrainTimeout = 300 * time.Millisecond
	core, logs := observer.New(zap.WarnLevel)
	c, err := consumer.New(cfg, via, nil, s.r.Metrics, zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Core())))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); c.Run(ctx) }() //nolint:errcheck // nil when ctx ends
	t.Cleanup(func() { px.Stall(0); cancel(); <-stopped })
	select {
	case <-all:
	case <-time.After(30 * time.Second):
		t.Fatalf("%d of %d requests in flight", inFlight.Load(), n)
	}
	px.Stall(time.Hour) // every answer Redis sends from now on is held
	cancel()
	select {
	case <-stopped:
	case <-time.After(3 * time.Minute): // a call per task ends in 25 s; this only keeps a hang from holding the test
		px.Stall(0)
		<-stopped
		t.Fatal("the stop did not end with Redis hanging")
	}
	if calls := logs.FilterMessageSnippet("hand-back failed").Len(); calls != 1 {
		t.Errorf("with Redis's answers held, the stop of a batch of %d tasks made %d hand-back calls, each waiting out the read timeout; want one for the batch", n, calls)
	}
}
