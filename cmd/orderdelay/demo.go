package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/producer"
)

// Demo isolation: the demo never touches real orders or a real queue.
const (
	demoDatabase = "orderdelay_demo"
	demoQueueKey = "orderdelay-demo:order"
)

func cmdDemo(ctx context.Context, args []string, stderr io.Writer, getenv func(string) (string, bool)) error {
	var duration time.Duration
	var rate float64
	cfg, pos, err := parse("demo", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.DurationVar(&duration, "duration", 0, "stop after this long (0: run until Ctrl-C)")
		fs.Float64Var(&rate, "rate", 2, "orders the simulated checkout creates per second")
	})
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("demo takes no arguments, got %q", pos)
	}
	if rate <= 0 || rate > 10000 {
		return usagef("--rate: want 0 < rate <= 10000, got %g", rate)
	}
	// People watch the demo: readable logs, with each batch's closes.
	if _, set := getenv("ORDERDELAY_LOG_FORMAT"); !set {
		cfg.LogFormat = "console"
	}
	if _, set := getenv("ORDERDELAY_LOG_LEVEL"); !set {
		cfg.LogLevel = zapcore.DebugLevel
	}
	log := newLogger(cfg, stderr)
	defer log.Sync() //nolint:errcheck // stderr

	dsn, err := ensureDemoDatabase(ctx, cfg.DatabaseURL)
	if err != nil {
		return redactErr(fmt.Errorf("demo database: %w", err), cfg)
	}
	cfg.DatabaseURL = dsn
	cfg.QueueKey = demoQueueKey
	log.Info("demo: orders live in their own database and queue key; real orders are never touched",
		zap.String("database", demoDatabase), zap.String("queue_key", demoQueueKey),
		zap.String("metrics", metricsURL(cfg.HTTPAddr)))
	if duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	}
	return runDaemon(ctx, cfg, log, daemonOptions{migrate: true, started: func(ctx context.Context, d *daemon) {
		checkout(ctx, d, rate)
	}})
}

// metricsURL is where a browser on this machine finds /metrics of a
// daemon listening on addr.
func metricsURL(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "localhost"
	}
	return "http://" + net.JoinHostPort(host, port) + "/metrics"
}

// withDatabase returns dsn pointed at database name.
func withDatabase(dsn, name string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + name
		return u.String()
	}
	return dsn + " dbname=" + name
}

// ensureDemoDatabase creates the demo database if it is missing, connecting
// to the server's "postgres" database with the configured credentials.
func ensureDemoDatabase(ctx context.Context, dsn string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := orders.EnsureDatabase(ctx, withDatabase(dsn, "postgres"), demoDatabase); err != nil {
		return "", err
	}
	return withDatabase(dsn, demoDatabase), nil
}

// checkout simulates a shop: it creates orders with short payment windows,
// enqueues half through the API's producer and half with a raw ZADD (as a
// service in another language would), and pays about a third of them before
// their deadline. Every few seconds it reports what the orders table says.
func checkout(ctx context.Context, d *daemon, rate float64) {
	log := d.log.Named("checkout")
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	report := time.NewTicker(5 * time.Second)
	defer report.Stop()
	prefix := fmt.Sprintf("demo-%d-", time.Now().Unix())
	n := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-report.C:
			demoReport(ctx, d, log, prefix)
			continue
		case <-tick.C:
		}
		n++
		serial := fmt.Sprintf("%s%05d", prefix, n)
		timeout := 2*time.Second + rand.N(6*time.Second)
		deadline := time.Now().Add(timeout)
		if err := orders.Create(ctx, d.db, serial, deadline); err != nil {
			log.Warn("create order", zap.Error(err))
			continue
		}
		var err error
		how := "api"
		if n%2 == 0 {
			_, _, err = d.prod.Put(ctx, producer.Request{Serial: serial, At: deadline})
		} else {
			how = "raw ZADD"
			err = d.rdb.ZAdd(ctx, d.cfg.QueueKey, redisZ(serial, deadline)).Err()
		}
		if err != nil {
			log.Warn("enqueue", zap.Error(err))
			continue
		}
		pays := rand.N(3) == 0
		log.Info("order created", zap.String("serial", serial), zap.Duration("pay_within", timeout.Round(time.Millisecond)),
			zap.String("enqueued_by", how), zap.Bool("will_pay", pays))
		if pays {
			after := timeout/4 + rand.N(timeout/2)
			time.AfterFunc(after, func() { pay(ctx, d, log, serial) })
		}
	}
}

func pay(ctx context.Context, d *daemon, log *zap.Logger, serial string) {
	if ctx.Err() != nil {
		return
	}
	paid, err := orders.Pay(ctx, d.db, serial)
	if err != nil {
		log.Warn("pay", zap.Error(err))
		return
	}
	if paid {
		log.Info("order paid", zap.String("serial", serial))
		if err := d.prod.Cancel(ctx, serial); err != nil && !errors.Is(err, client.ErrNotFound) {
			log.Warn("cancel timeout", zap.Error(err))
		}
	}
}

// demoReport logs what the orders table says of this run's orders (the
// demo database keeps earlier runs' orders too).
func demoReport(ctx context.Context, d *daemon, log *zap.Logger, prefix string) {
	counts, err := orders.CountByStatus(ctx, d.db, prefix)
	if err != nil {
		return
	}
	fields := make([]zap.Field, 0, len(counts))
	for _, c := range counts {
		fields = append(fields, zap.Int(c.Status, c.N))
	}
	log.Info("orders table", fields...)
}
