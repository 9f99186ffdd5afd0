package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

func cmdRun(ctx context.Context, args []string, stderr io.Writer, getenv func(string) (string, bool)) error {
	var migrateFirst bool
	cfg, pos, err := parse("run", args, stderr, getenv, func(fs *flag.FlagSet) {
		fs.BoolVar(&migrateFirst, "migrate", false, "apply the reference schema migrations before starting")
	})
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("run takes no arguments, got %q", pos)
	}
	log := newLogger(cfg, stderr)
	defer log.Sync() //nolint:errcheck // stderr
	return runDaemon(ctx, cfg, log, daemonOptions{migrate: migrateFirst})
}

// The db_name labels of the two pools' go_sql_* metrics.
const (
	dbNameOrders = "orderdelay"        // the order path's pool
	dbNameShared = "orderdelay_shared" // everything else
)

type daemonOptions struct {
	migrate bool
	// started, if set, runs once PostgreSQL is ready and the consumer is
	// about to start (the demo's simulated checkout).
	started func(ctx context.Context, d *daemon)
}

// daemon is the wired process.
type daemon struct {
	cfg   config.Config
	log   *zap.Logger
	rdb   redis.UniversalClient
	db    *sqlx.DB      // shared: start-up checks, task queues, relay, admin
	ordDB *sqlx.DB      // the order path's own: consumer and reconciler
	store *orders.Store // on ordDB
	m     *metrics.Metrics
	prod  *producer.Producer
	cons  *consumer.Group // one consumer per key of the order queue (shards)
	api   *httpapi.Server
	tasks *tasks.Manager // nil without a queues file
}

// loadQueues reads ORDERDELAY_QUEUES_FILE; a bad file is a configuration
// error (exit 2).
func loadQueues(cfg config.Config) (tasks.File, error) {
	f, err := tasks.Load(cfg.QueuesFile)
	if err != nil {
		return f, usageError{fmt.Errorf("ORDERDELAY_QUEUES_FILE (--queues-file): %w", err)}
	}
	return f, nil
}

// reminderQueue is the queue of the file that ORDERDELAY_REMINDER_QUEUE
// names; a name the file does not declare (an empty file included) is a
// configuration error (exit 2). ok is false when no reminder queue is set.
func reminderQueue(cfg config.Config, f tasks.File) (q tasks.Queue, ok bool, err error) {
	if cfg.ReminderQueue == "" {
		return q, false, nil
	}
	for _, q := range f.Queues {
		if q.Name == cfg.ReminderQueue && q.Durable {
			// Reminders are written beside the order entry, in Redis; a
			// durable queue takes tasks only through its durable tier.
			return q, false, usagef("ORDERDELAY_REMINDER_QUEUE: queue %q is durable; reminders need a queue that is not", q.Name)
		}
		if q.Name == cfg.ReminderQueue {
			return q, true, nil
		}
	}
	return q, false, usagef("ORDERDELAY_REMINDER_QUEUE: no queue %q in ORDERDELAY_QUEUES_FILE (%s declares %d queues)",
		cfg.ReminderQueue, cfg.QueuesFile, len(f.Queues))
}

// liveness is how long the scan loop may be silent before /healthz fails.
func liveness(cfg config.Config) time.Duration { return 3*cfg.ScanInterval + 30*time.Second }

// runDaemon runs until ctx ends. Unreachable Redis or PostgreSQL is not
// fatal: the daemon reports it (readiness, dependency_up) and retries. A
// statement that fails verification is (exit 2).
func runDaemon(ctx context.Context, cfg config.Config, log *zap.Logger, opts daemonOptions) error {
	log.Info("starting orderdelay", zap.String("version", version), zap.String("revision", revision),
		zap.String("redis_url", config.Mask(cfg.RedisURL)), zap.String("redis_mode", cfg.RedisMode),
		zap.String("database_url", config.Mask(cfg.DatabaseURL)), zap.String("queue_key", cfg.QueueKey),
		zap.Int("queue_shards", cfg.QueueShards),
		zap.Int("workers", cfg.Workers), zap.Int("batch_size", cfg.BatchSize), zap.Duration("lease", cfg.Lease),
		zap.Duration("scan_interval", cfg.ScanInterval), zap.String("api_auth", apiAuthMode(cfg)))
	d := &daemon{cfg: cfg, log: log}
	queuesFile, err := loadQueues(cfg)
	if err != nil {
		return err
	}
	reminders, withReminders, err := reminderQueue(cfg, queuesFile)
	if err != nil {
		return err
	}
	if d.rdb, err = newRedis(cfg); err != nil {
		return usageError{redactErr(err, cfg)}
	}
	defer d.rdb.Close()
	// The order path's pool is its own, so nothing else can take the
	// connections its batches need (and it carries the server-side
	// timeouts); everything else shares a small pool.
	if d.ordDB, err = openDB(cfg, orderPoolOptions(cfg)); err != nil {
		return usageError{err}
	}
	defer d.ordDB.Close()
	if d.db, err = openDB(cfg, sharedPoolOptions(queuesFile)); err != nil {
		return usageError{err}
	}
	defer d.db.Close()
	keys := queue.NewKeys(cfg.QueueKey)
	allKeys := queueKeys(cfg) // keys, then the shards' (ORDERDELAY_QUEUE_SHARDS)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewDBStatsCollector(d.ordDB.DB, dbNameOrders), collectors.NewDBStatsCollector(d.db.DB, dbNameShared))
	d.m = metrics.New(reg, version, revision)
	reg.MustRegister(consumer.NewGroupStatsCollector(d.rdb, allKeys, func(err error) {
		log.Debug("queue gauges unavailable for this scrape", zap.Error(err))
	}))
	d.store = orders.NewStore(d.ordDB, cfg.Statements())
	var closer consumer.Store = d.store
	if cfg.CloseEvents {
		closer = orders.WithOutbox{Store: d.store}
	}
	if cfg.DryRun {
		closer = orders.DryRun{Store: d.store}
		log.Warn("dry run: the close statement runs in transactions that are rolled back; nothing is closed, the queue is left as it is, and the reconciler, the dead-letter janitor and the task queues do not run")
	}
	cl, err := client.New(d.rdb, cfg.QueueKey, shardOpts(cfg)...)
	if err != nil {
		return usageError{err}
	}
	d.prod = producer.New(cl, d.m, nil)
	if len(queuesFile.Queues) > 0 {
		fam := metrics.NewTaskFamilies(reg, d.m)
		if d.tasks, err = tasks.NewManager(queuesFile, d.rdb, d.db, fam, log, replicaName()); err != nil {
			return usageError{err}
		}
		log.Info("task queues", zap.Strings("queues", d.tasks.Names()))
		reg.MustRegister(consumer.NewTaskStatsCollector(d.rdb, taskQueueKeys(d.tasks), func(q string, err error) {
			log.Debug("task queue gauges unavailable for this scrape", zap.String("queue", q), zap.Error(err))
		}))
	}
	if withReminders {
		rq, _ := d.tasks.Queue(reminders.Name) // declared: checked above
		d.prod.WithReminders(rq.Client, cfg.ReminderBefore)
	}
	d.cons = consumer.NewGroup(consumer.Config{
		Workers: cfg.Workers, BatchSize: cfg.BatchSize, ScanInterval: cfg.ScanInterval,
		Lease: cfg.Lease, StatementTimeout: cfg.StatementTimeout, DrainTimeout: cfg.DrainTimeout,
		MaxAttempts: cfg.MaxAttempts, BackoffMax: cfg.BackoffMax, Owner: replicaName(),
		CloseDelay: cfg.CloseDelay, MaxCloseRate: cfg.MaxCloseRate, DryRun: cfg.DryRun,
	}, allKeys, d.rdb, closer, d.m, log)
	live := liveness(cfg)
	d.api = httpapi.New(httpapi.Config{
		Tokens: cfg.APITokens,
		Live: func() error {
			if since := time.Since(d.cons.LastBeat()); since > live {
				return fmt.Errorf("scan loop silent for %s", since.Round(time.Second))
			}
			return nil
		},
		Ping: func(ctx context.Context) error { return d.rdb.Ping(ctx).Err() },
	}, d.prod, d.m, reg, log)
	if len(cfg.AdminTokens) > 0 {
		tools, err := admin.New(d.rdb, cfg.QueueKey, d.db, shardOpts(cfg)...)
		if err != nil {
			return usageError{err}
		}
		d.api.EnableAdmin(httpapi.AdminConfig{Tokens: cfg.AdminTokens, Tools: tools, ReferenceSchema: cfg.CloseSQL == ""})
	}

	if d.tasks != nil {
		d.api.EnableTasks(d.tasks)
	}

	stopHTTP, err := d.serveHTTP()
	if err != nil {
		return err
	}
	// Shutdown, step 1: readiness answers 503 as soon as the signal arrives,
	// before anything else stops, so load balancers move producers away.
	go func() { <-ctx.Done(); d.api.SetStopping() }()

	// Background actors (start-up checks, janitor, reconciler, event relay,
	// task queues, the demo's checkout) each return when bgCtx ends; bg.Wait
	// below is their one owner.
	bgCtx, cancelBg := context.WithCancel(ctx)
	defer cancelBg()
	var bg sync.WaitGroup
	spawn := func(f func(context.Context)) {
		bg.Add(1)
		go func() { defer bg.Done(); f(bgCtx) }()
	}
	spawn(d.checkRedis)
	if d.tasks != nil && !cfg.DryRun {
		// Before anything else: producers' scripts learn which queues
		// are durable (and refuse to write them) and each queue's cap.
		spawn(d.tasks.KeepMeta)
	}

	err = d.prepareDB(ctx, opts.migrate)
	if err == nil {
		if opts.started != nil {
			spawn(func(ctx context.Context) { opts.started(ctx, d) })
		}
		// A dry run changes nothing in Redis: no purge of dead letters,
		// no reconciler, no event relay, no task queue served.
		if !cfg.DryRun {
			spawn(d.janitor)
		}
		if reconciles(cfg) {
			rec := consumer.NewReconciler(consumer.ReconcilerConfig{Keys: keys, Shards: allKeys[1:], Interval: cfg.ReconcileInterval,
				Grace: cfg.ReconcileGrace, Outbox: cfg.CloseEvents}, d.rdb, d.store, d.m, log)
			spawn(func(ctx context.Context) { rec.Run(ctx) }) //nolint:errcheck // returns nil when ctx ends
		}
		if cfg.CloseEvents && !cfg.DryRun {
			r := &consumer.Relay{DB: d.db, Redis: d.rdb, Stream: keys.Events, MaxLen: cfg.CloseEventsMaxLen,
				Log: log, Relayed: d.m.EventsRelayed}
			spawn(r.Run)
		}
		if d.tasks != nil && !cfg.DryRun {
			spawn(d.tasks.Run) // each queue drains and hands back like the order queue
		}
		// Steps 2-4: stop claiming, finish in-flight batches within the
		// drain timeout, hand back what is left (consumer.Run, in order).
		d.cons.Run(ctx) //nolint:errcheck // returns nil when ctx ends
	}
	// Every background actor has stopped (task queues drained too) before
	// HTTP stops.
	cancelBg()
	bg.Wait()
	// Step 5: stop HTTP. Step 6: close the clients (deferred above).
	stopHTTP()
	if err != nil && ctx.Err() == nil {
		return err
	}
	log.Info("stopped")
	return nil
}

// serveHTTP serves the listeners openListeners decides and binds.
func (d *daemon) serveHTTP() (stop func(), err error) {
	ls, err := openListeners(d.cfg, d.api, d.log, nil)
	if err != nil {
		return func() {}, err
	}
	servers := make([]*http.Server, 0, len(ls))
	for _, l := range ls {
		srv := &http.Server{Handler: l.h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 16 << 10,
			ErrorLog: zap.NewStdLog(d.log)}
		servers = append(servers, srv)
		d.log.Info("listening", zap.String("what", l.what), zap.String("addr", l.ln.Addr().String()))
		go func() {
			if err := srv.Serve(l.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("http server stopped", zap.String("what", l.what), zap.Error(err))
			}
		}()
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, s := range servers {
			_ = s.Shutdown(ctx) // best effort: the process is ending
		}
	}, nil
}

// prepareDB waits for PostgreSQL (retrying with backoff, never fatal),
// migrates when asked, and verifies the statements (fatal when wrong).
func (d *daemon) prepareDB(ctx context.Context, migrate bool) error {
	b := backoff.NewExponentialBackOff()
	b.MaxInterval = 10 * time.Second
	for {
		err := d.tryPrepareDB(ctx, migrate)
		if err == nil {
			d.m.SetUp(metrics.DepPostgres, true)
			return nil
		}
		var se *orders.StatementError
		if errors.As(err, &se) {
			return usageError{fmt.Errorf("%w", redactErr(se, d.cfg))}
		}
		d.m.SetUp(metrics.DepPostgres, false)
		wait := b.NextBackOff()
		d.log.Warn("postgresql not ready; retrying", zap.Error(redactErr(err, d.cfg)), zap.Duration("retry_in", wait))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

func (d *daemon) tryPrepareDB(ctx context.Context, migrate bool) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := d.db.PingContext(ctx); err != nil {
		return err
	}
	if migrate {
		v, err := orders.Migrate(d.cfg.DatabaseURL)
		if err != nil {
			return err
		}
		d.log.Info("schema migrated", zap.Uint("version", v))
	}
	// Verified on the shared pool: the order pool is the batches'.
	if err := orders.NewStore(d.db, d.cfg.Statements()).Verify(ctx); err != nil {
		return err
	}
	if d.cfg.CloseEvents {
		if _, err := d.db.ExecContext(ctx, "SELECT 1 FROM "+orders.OutboxTable+" LIMIT 0"); err != nil {
			if orders.Unavailable(err) {
				return err
			}
			return &orders.StatementError{Name: "close events", Setting: "ORDERDELAY_CLOSE_EVENTS",
				Err: fmt.Errorf("the outbox table is missing (run orderdelay migrate): %w", err)}
		}
	}
	if d.tasks != nil {
		if err := d.tasks.Verify(ctx); err != nil {
			return err
		}
	}
	d.schemaWarnings(ctx)
	return nil
}

// schemaWarnings checks the reference schema, when the reference statements
// are in use: its version, and the partial index the reconciler needs.
func (d *daemon) schemaWarnings(ctx context.Context) {
	if d.cfg.CloseSQL != "" || d.cfg.OverdueSQL != "" {
		return // a shop's own schema: not ours to judge
	}
	var version int
	err := d.db.GetContext(ctx, &version, "SELECT version FROM "+orders.MigrationsTable+" WHERE NOT dirty")
	stale := err != nil || version < orders.SchemaVersion
	d.m.Warn(metrics.CheckSchemaVersion, stale)
	if stale {
		d.log.Warn("the reference schema is not at this release's version: run orderdelay migrate",
			zap.Int("found", version), zap.Int("want", orders.SchemaVersion), zap.NamedError("read_error", err))
	}
	var indexed bool
	err = d.db.GetContext(ctx, &indexed, `SELECT EXISTS (SELECT 1 FROM pg_indexes
		WHERE tablename = 'orders' AND indexdef ILIKE '%(expires_at)%' AND indexdef ILIKE '%WHERE%pending%')`)
	d.m.Warn(metrics.CheckPendingIndex, err != nil || !indexed)
	if err != nil || !indexed {
		d.log.Warn("no partial index on orders(expires_at) WHERE status = 'pending': the reconciler will scan the table",
			zap.NamedError("read_error", err))
	}
}

// janitor purges old dead letters (ORDERDELAY_DEAD_LETTER_RETENTION and
// _MAX, and each task queue's dead_retention and dead_max) once a minute,
// task payloads with them, so Redis memory cannot grow without bound.
func (d *daemon) janitor(ctx context.Context) {
	orderQueue := d.cfg.DeadRetention != 0 || d.cfg.DeadMax != 0
	taskQueues := d.tasks != nil && d.tasks.PurgesDead(d.cfg.DeadRetention, d.cfg.DeadMax)
	if !orderQueue && !taskQueues {
		return
	}
	for {
		if orderQueue {
			n, err := purgeDead(ctx, d.rdb, d.cfg)
			if err != nil && ctx.Err() == nil {
				d.log.Debug("dead-letter purge failed; retrying later", zap.Error(err))
			}
			if n > 0 {
				d.log.Info("purged old dead letters", zap.Int("count", n))
			}
		}
		if taskQueues {
			per, err := d.tasks.PurgeDead(ctx, d.cfg.DeadRetention, d.cfg.DeadMax)
			if err != nil && ctx.Err() == nil {
				d.log.Debug("task dead-letter purge failed; retrying later", zap.Error(err))
			}
			for q, n := range per {
				d.log.Info("purged old task dead letters and their payloads", zap.String("queue", q), zap.Int("count", n))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Minute):
		}
	}
}

// checkRedis warns, once Redis answers, about settings that can lose the
// queue: eviction (the whole queue is one key), no persistence, old Redis.
func (d *daemon) checkRedis(ctx context.Context) {
	for {
		if err := d.redisWarnings(ctx); err == nil || ctx.Err() != nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

func (d *daemon) redisWarnings(ctx context.Context) error {
	// On a cluster every master holds part of the keyspace: check each.
	nodes := []redis.UniversalClient{d.rdb}
	if cc, ok := d.rdb.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		nodes = nil
		err := cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
			mu.Lock()
			nodes = append(nodes, c)
			mu.Unlock()
			return nil
		})
		if err != nil {
			return err
		}
	}
	var old, evicts, volatile bool
	for _, n := range nodes {
		o, e, v, err := d.nodeWarnings(ctx, n)
		if err != nil {
			return err
		}
		old, evicts, volatile = old || o, evicts || e, volatile || v
	}
	d.m.Warn(metrics.CheckRedisVersion, old)
	d.m.Warn(metrics.CheckRedisEviction, evicts)
	d.m.Warn(metrics.CheckRedisPersistence, volatile)
	return nil
}

// nodeWarnings checks one Redis node and logs what it finds.
func (d *daemon) nodeWarnings(ctx context.Context, n redis.UniversalClient) (old, evicts, volatile bool, err error) {
	info, err := n.Info(ctx, "server").Result()
	if err != nil {
		return false, false, false, err
	}
	addr := infoField(info, "tcp_port")
	v := infoField(info, "redis_version")
	if old = v != "" && versionBelow(v, 6, 2); old {
		d.log.Warn("redis is older than 6.2; orderdelay needs ZRANGE BYSCORE and ZMSCORE",
			zap.String("redis_version", v), zap.String("port", addr))
	}
	cfgs, err := n.ConfigGet(ctx, "*").Result()
	if err != nil {
		d.log.Info("cannot read redis CONFIG (managed Redis?); check maxmemory-policy and persistence yourself", zap.Error(err))
		return old, false, false, nil
	}
	p := cfgs["maxmemory-policy"]
	if evicts = p != "" && p != "noeviction"; evicts {
		d.log.Warn("redis maxmemory-policy is not noeviction: under memory pressure Redis may evict the whole queue",
			zap.String("maxmemory-policy", p), zap.String("port", addr))
	}
	if volatile = cfgs["save"] == "" && cfgs["appendonly"] != "yes"; volatile {
		d.log.Warn("redis persists nothing (no RDB snapshots, no AOF): a restart empties the queue and only the reconciler recovers it",
			zap.String("port", addr))
	}
	return old, evicts, volatile, nil
}

func infoField(info, name string) string {
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

func versionBelow(v string, major, minor int) bool {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return false
	}
	return ma < major || (ma == major && mi < minor)
}
