package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

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
	"github.com/orderdelay/orderdelay/internal/lifecycle"
	"github.com/orderdelay/orderdelay/internal/maintain"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/preflight"
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
	gcDefaults(getenv)
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
	// listen, if set, replaces net.Listen for the HTTP listeners (tests).
	listen func(network, addr string) (net.Listener, error)
	// stopped, if set, is told each stage's name once it has stopped
	// (tests).
	stopped func(stage string)
}

// daemon is the wired process: its clients and the parts the actors run.
type daemon struct {
	cfg   config.Config
	log   *zap.Logger
	rdb   redis.UniversalClient
	db    *sqlx.DB      // shared: start-up checks, task queues, relay, admin
	ordDB *sqlx.DB      // the order path's own: consumer and reconciler
	store *orders.Store // on ordDB
	keys  []queue.Keys  // the order queue's: the queue key, then its shards
	m     *metrics.Metrics
	prod  *producer.Producer
	cons  *consumer.Group // one consumer per key of the order queue (shards)
	tools *admin.Tools    // the operator's tools (admin API, janitor), built once
	api   *httpapi.Server
	tasks *tasks.Manager // nil without a queues file
}

// poolCloseWait bounds how long closing a database pool may take at the
// end of a run. Closing a connection closes its prepared statements first,
// and lib/pq waits for each answer with no deadline: with PostgreSQL's
// answers held (a partition, a stalled failover) the process would wait for
// as long as the network does. By then every batch is finished or handed
// back; what is left is the connections' goodbyes.
const poolCloseWait = 2 * time.Second

// closeWithin returns close, waiting for it at most wait: past that it
// lets it finish on its own (the process is ending) and reports so.
func closeWithin(close func() error, wait time.Duration) func() error {
	return func() error {
		done := make(chan error, 1)
		go func() { done <- close() }()
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case err := <-done:
			return err
		case <-t.C:
			return fmt.Errorf("closing a database pool: no answer within %s; left to finish on its own", wait)
		}
	}
}

// wire builds the daemon from the configuration: clients (nothing is
// dialled yet), metrics, the consumer group, the task queues and the API.
// Every mistake it finds is a configuration error (exit 2). closeClients
// closes what it opened.
func wire(cfg config.Config, log *zap.Logger) (d *daemon, closeClients func(), err error) {
	d = &daemon{cfg: cfg, log: log}
	var closers []func() error
	closeAll := func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]() //nolint:errcheck // the process is ending
		}
	}
	defer func() {
		if err != nil {
			closeAll() // what was opened before the mistake
		}
	}()
	queuesFile, err := loadQueues(cfg)
	if err != nil {
		return nil, nil, err
	}
	reminders, withReminders, err := reminderQueue(cfg, queuesFile)
	if err != nil {
		return nil, nil, err
	}
	if d.rdb, err = newRedis(cfg); err != nil {
		return nil, nil, usageError{redactErr(err, cfg)}
	}
	closers = append(closers, d.rdb.Close)
	// The order path's pool is its own, so nothing else can take the
	// connections its batches need (and it carries the server-side
	// timeouts); everything else shares a small pool.
	if d.ordDB, err = openDB(cfg, orderPoolOptions(cfg)); err != nil {
		return nil, nil, usageError{err}
	}
	closers = append(closers, closeWithin(d.ordDB.Close, poolCloseWait))
	if d.db, err = openDB(cfg, sharedPoolOptions(queuesFile)); err != nil {
		return nil, nil, usageError{err}
	}
	closers = append(closers, closeWithin(d.db.Close, poolCloseWait))
	d.keys = queueKeys(cfg) // the queue key, then the shards' (ORDERDELAY_QUEUE_SHARDS)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewDBStatsCollector(d.ordDB.DB, dbNameOrders), collectors.NewDBStatsCollector(d.db.DB, dbNameShared))
	d.m = metrics.New(reg, version, revision)
	reg.MustRegister(consumer.NewGroupStatsCollector(d.rdb, d.keys, func(err error) {
		log.Debug("queue gauges unavailable for this scrape", zap.Error(err))
	}))
	d.store = orders.NewStore(d.ordDB, cfg.Statements())
	d.store.SetLogger(log)
	if !cfg.PreparedStatements {
		d.store.Unprepared()
	}
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
		return nil, nil, usageError{err}
	}
	d.prod = producer.New(cl, d.m, nil)
	if len(queuesFile.Queues) > 0 {
		fam := metrics.NewTaskFamilies(reg, d.m)
		if d.tasks, err = tasks.NewManager(queuesFile, d.rdb, d.db, fam, log, replicaName()); err != nil {
			return nil, nil, usageError{err}
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
	if d.cons, err = consumer.NewGroup(consumer.Config{
		Workers: cfg.Workers, BatchSize: cfg.BatchSize, ScanInterval: cfg.ScanInterval,
		Lease: cfg.Lease, StatementTimeout: cfg.StatementTimeout, DrainTimeout: cfg.DrainTimeout,
		MaxAttempts: cfg.MaxAttempts, BackoffMax: cfg.BackoffMax, Owner: replicaName(),
		CloseDelay: cfg.CloseDelay, MaxCloseRate: cfg.MaxCloseRate, DryRun: cfg.DryRun,
	}, d.keys, d.rdb, closer, d.m, log); err != nil {
		return nil, nil, usageError{err}
	}
	if d.tools, err = admin.New(d.rdb, cfg.QueueKey, d.db, shardOpts(cfg)...); err != nil {
		return nil, nil, usageError{err}
	}
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
		d.api.EnableAdmin(httpapi.AdminConfig{Tokens: cfg.AdminTokens, Tools: d.tools, ReferenceSchema: cfg.CloseSQL == ""})
	}
	if d.tasks != nil {
		d.api.EnableTasks(d.tasks)
	}
	return d, closeAll, nil
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

// runDaemon runs until SIGTERM or SIGINT (its signals actor), until ctx
// ends, or until one of its actors fails. Unreachable
// Redis or PostgreSQL is not fatal: the daemon reports it (readiness,
// dependency_up) and retries. A statement that fails verification, and a
// Redis user refused a command the daemon needs, are configuration errors
// (exit 2); a port that cannot be bound at start, and an HTTP server that
// fails mid-run, end the run (both exit 1).
func runDaemon(ctx context.Context, cfg config.Config, log *zap.Logger, opts daemonOptions) error {
	// Protected mode refuses before anything starts (openListeners checks
	// again, for its other callers).
	if err := cfg.CheckExposure(); err != nil {
		return usageError{err}
	}
	// Caught from here on, so that one arriving while the daemon is wired
	// and its ports bound is not lost: the signals actor acts on it as
	// soon as the run begins.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	log.Info("starting orderdelay", zap.String("version", version), zap.String("revision", revision),
		zap.String("redis_url", config.Mask(cfg.RedisURL)), zap.String("redis_mode", cfg.RedisMode),
		zap.String("database_url", config.Mask(cfg.DatabaseURL)), zap.String("queue_key", cfg.QueueKey),
		zap.Int("queue_shards", cfg.QueueShards),
		zap.Int("workers", cfg.Workers), zap.Int("batch_size", cfg.BatchSize), zap.Duration("lease", cfg.Lease),
		zap.Duration("scan_interval", cfg.ScanInterval), zap.String("api_auth", apiAuthMode(cfg)))
	d, closeClients, err := wire(cfg, log)
	if err != nil {
		return err
	}
	// Last of all, once every actor has returned: close the clients.
	defer closeClients()
	serve, err := d.serveHTTP(opts.listen)
	if err != nil {
		return err
	}
	err = d.actors(d.signals(sigs), serve, opts).Run(ctx)
	se, pe := (*orders.StatementError)(nil), (*preflight.PermissionError)(nil)
	if errors.As(err, &se) || errors.As(err, &pe) {
		return usageError{err}
	}
	if err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}

// actors is the daemon: its stages in start order. Shutdown — on SIGTERM
// or SIGINT (the signals actor), when ctx ends (the demo's --duration,
// tests), or when any actor fails — goes through them backwards, a stage
// stopped only once every actor of the stage after it has returned:
//
//  1. /readyz answers 503 (Stopping, before anything stops), so load
//     balancers move producers away;
//  2. work: every consumer stops claiming, finishes its in-flight batches
//     within the drain timeout and hands back what is left (the order
//     queue's and each task queue's, concurrently); the reconciler, the
//     relay, the janitor (and the demo's checkout) end their pass;
//  3. checks: the Redis check and the task queues' meta keeper end;
//  4. http: the listeners stop accepting and requests in progress finish
//     (up to httpShutdownTimeout) — the API serves producers, /metrics and
//     /healthz until the consumers have drained;
//  5. signals: the signal handler ends — until then a second SIGTERM or
//     SIGINT is caught and ignored, so it cannot cut the drain short;
//  6. the Redis and PostgreSQL clients close (runDaemon's defer); each
//     database pool gets at most poolCloseWait, so a stalled network
//     cannot hold the exit.
//
// Starting goes the other way: the signals are caught first, the
// listeners are bound before anything runs (runDaemon), the checks start
// with the Redis user's (checkRedisUser: no consumer, janitor, relay or
// task queue runs before Redis answered and allowed every command the
// daemon needs; the API serves meanwhile), and
// the work stage starts with the database's preflight: nothing that
// closes orders, relays or purges runs before PostgreSQL answered and the
// statements verified.
func (d *daemon) actors(signals, serve lifecycle.Actor, opts daemonOptions) lifecycle.Group {
	cfg := d.cfg
	checks := []lifecycle.Actor{{Name: "redis check", Start: d.checkRedisUser, Run: func(ctx context.Context) error {
		return preflight.WatchRedis(ctx, d.rdb, d.m, d.log)
	}}}
	if d.tasks != nil && !cfg.DryRun {
		// Producers' scripts learn which queues are durable (and refuse
		// to write them) and each queue's cap, before any queue runs.
		checks = append(checks, lifecycle.Actor{Name: "task queue meta", Run: func(ctx context.Context) error {
			d.tasks.KeepMeta(ctx)
			return nil
		}})
	}
	// The database preflight (ping, statements) is the work stage's first
	// Start, bounded like the stage's stop. With migrations it runs in a
	// stage of its own with no bound instead: golang-migrate marks the
	// schema dirty while a migration runs, and one cut by the process's
	// exit would leave it so, for an operator to force.
	var schema []lifecycle.Stage
	var work []lifecycle.Actor
	preflightDB := lifecycle.Actor{Name: "postgres", Start: func(ctx context.Context) error {
		return d.prepareDB(ctx, opts.migrate)
	}}
	if opts.migrate {
		schema = []lifecycle.Stage{{Name: "schema", Actors: []lifecycle.Actor{preflightDB}}}
	} else {
		work = append(work, preflightDB)
	}
	if opts.started != nil {
		work = append(work, lifecycle.Actor{Name: "started", Run: func(ctx context.Context) error {
			opts.started(ctx, d)
			return nil
		}})
	}
	// A dry run changes nothing in Redis: no purge of dead letters, no
	// reconciler, no event relay, no task queue served.
	if !cfg.DryRun {
		j := maintain.JanitorConfig{Retention: cfg.DeadRetention, Max: cfg.DeadMax}
		if d.tasks != nil && d.tasks.PurgesDead(cfg.DeadRetention, cfg.DeadMax) {
			j.Tasks = d.tasks
		}
		work = append(work, lifecycle.Actor{Name: "janitor", Run: maintain.NewJanitor(j, d.tools, d.log).Run})
	}
	if reconciles(cfg) {
		rec := maintain.NewReconciler(maintain.ReconcilerConfig{Keys: d.keys[0], Shards: d.keys[1:], Interval: cfg.ReconcileInterval,
			Grace: cfg.ReconcileGrace, Outbox: cfg.CloseEvents}, d.rdb, d.store, d.m, d.log)
		work = append(work, lifecycle.Actor{Name: "reconciler", Run: rec.Run})
	}
	if cfg.CloseEvents && !cfg.DryRun {
		r := maintain.NewRelay(maintain.RelayConfig{Keys: d.keys[0], MaxLen: cfg.CloseEventsMaxLen},
			d.db, d.rdb, d.m.EventsRelayed, d.log)
		work = append(work, lifecycle.Actor{Name: "close-event relay", Run: r.Run})
	}
	if d.tasks != nil && !cfg.DryRun {
		work = append(work, lifecycle.Actor{Name: "task queues", Run: func(ctx context.Context) error {
			d.tasks.Run(ctx) // each queue drains and hands back like the order queue
			return nil
		}})
	}
	work = append(work, lifecycle.Actor{Name: "consumer", Run: d.cons.Run})
	stages := []lifecycle.Stage{
		{Name: "signals", Actors: []lifecycle.Actor{signals}},
		{Name: "http", Actors: []lifecycle.Actor{serve}},
		{Name: "checks", Actors: checks},
	}
	stages = append(stages, schema...)
	stages = append(stages, lifecycle.Stage{Name: "work", Actors: work, StopWithin: d.workStopBound()})
	return lifecycle.Group{
		Stages: stages,
		Abandoned: func(stage string, actors []string) {
			d.log.Error("stopping: still running after the longest stop its dependencies' timeouts allow for a batch in flight and its hand-back; "+
				"left as they are, to end with the process, and what they held comes back when its leases expire "+
				"(PostgreSQL holding its replies: no timeout cuts a read of its driver; or a batch that committed as Redis hung, "+
				"recording its outcome call after call, each of which then fails)",
				zap.String("stage", stage), zap.Strings("actors", actors), zap.Duration("waited", d.workStopBound()))
		},
		Stopping: func(cause error) {
			d.api.SetStopping()
			if cause != nil {
				d.log.Error("stopping: an actor failed", zap.Error(cause))
			} else {
				d.log.Info("stopping: draining")
			}
		},
		Stopped: func(stage string) {
			d.log.Debug("stopped", zap.String("stage", stage))
			if opts.stopped != nil {
				opts.stopped(stage)
			}
		},
	}
}

// workStopBound is the longest the work stage's stop takes while every
// dependency answers within its timeouts (README: How it works,
// shutdown): the scan loop's Redis call in flight, the longest drain (the
// order queue's, or a task queue's half lease), the batch's Redis call in
// flight when it passes, and the hand-back (its deadline, or the read in
// flight past it). What still runs then waits on something no timeout
// cuts — PostgreSQL holding its replies: lib/pq cannot cut a read, and its
// cancel request is held too — and is abandoned (lifecycle.Stage), to end
// with the process; the leases bring back what it held. 0 (no bound) when
// the Redis client has no read timeout: then nothing bounds the stop.
func (d *daemon) workStopBound() time.Duration {
	read := readTimeoutOf(d.rdb)
	if read <= 0 {
		return 0
	}
	drain := d.cfg.DrainTimeout
	if d.tasks != nil && !d.cfg.DryRun {
		drain = max(drain, d.tasks.LongestDrain())
	}
	return read + drain + read + max(consumer.BookkeepingTimeout, read)
}

// signals is the actor that ends the run, cleanly, on the first SIGTERM or
// SIGINT received on sigs. It goes on catching them until its stage is
// stopped — the last, once HTTP has stopped — and ignores the later ones:
// the drain is never cut short.
func (d *daemon) signals(sigs <-chan os.Signal) lifecycle.Actor {
	return lifecycle.Actor{Name: "signals", Watch: func(ctx context.Context, stop func()) error {
		stopping := false
		for {
			select {
			case s := <-sigs:
				if stopping {
					d.log.Warn("signal ignored: already stopping", zap.Stringer("signal", s))
					continue
				}
				d.log.Info("signal received: stopping", zap.Stringer("signal", s))
				stopping = true
				stop()
			case <-ctx.Done():
				return nil
			}
		}
	}}
}

// httpShutdownTimeout is how long requests in progress may finish once the
// listeners stop accepting.
const httpShutdownTimeout = 5 * time.Second

// serveHTTP binds the listeners openListeners decides — a port that cannot
// be bound is fatal: another process owns it — and returns the actor that
// serves them. A server that fails (its listener breaks) ends the run; on
// stop, every server stops accepting and lets requests in progress finish.
func (d *daemon) serveHTTP(listen func(network, addr string) (net.Listener, error)) (lifecycle.Actor, error) {
	ls, err := openListeners(d.cfg, d.api, d.log, listen)
	if err != nil {
		return lifecycle.Actor{}, err
	}
	servers := make([]*http.Server, len(ls))
	for i, l := range ls {
		servers[i] = &http.Server{Handler: l.h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 16 << 10,
			ErrorLog: zap.NewStdLog(d.log)}
		d.log.Info("listening", zap.String("what", l.what), zap.String("addr", l.ln.Addr().String()))
	}
	return lifecycle.Actor{Name: "http", Run: func(ctx context.Context) error {
		errc := make(chan error, len(ls))
		for i, l := range ls {
			go func() { errc <- fmt.Errorf("%s server: %w", l.what, servers[i].Serve(l.ln)) }()
		}
		var failed error
		select {
		case failed = <-errc: // Serve returns only on failure until Shutdown
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), httpShutdownTimeout)
		defer cancel()
		for _, s := range servers {
			_ = s.Shutdown(sctx) // best effort: the run is ending
		}
		running := len(servers)
		if failed != nil {
			running--
		}
		for range running {
			<-errc // http.ErrServerClosed
		}
		return failed
	}}, nil
}

// prepareDB is the database's start-up check (see preflight.Database).
func (d *daemon) prepareDB(ctx context.Context, migrate bool) error {
	pf := preflight.Database{
		DB: d.db, URL: d.cfg.DatabaseURL, Migrate: migrate, Statements: d.cfg.Statements(),
		ReferenceSchema: d.cfg.CloseSQL == "" && d.cfg.OverdueSQL == "",
		CloseEvents:     d.cfg.CloseEvents, Metrics: d.m, Log: d.log,
		Secrets: []string{d.cfg.DatabaseURL, d.cfg.RedisURL},
	}
	if d.tasks != nil {
		pf.Verify = d.tasks.Verify
	}
	return pf.Prepare(ctx)
}
