// Package preflight holds the daemon's start-up checks: it waits for
// PostgreSQL, migrates when asked, verifies the configured statements
// (fatal when wrong: exit 2), and warns — in the log and as
// orderdelay_config_warning gauges — about what can lose or slow the queue:
// a stale reference schema, no partial index for the reconciler, Redis
// that evicts, persists nothing or is older than 6.2.
//
// Permissions (permissions.go) checks the Redis user before anything runs:
// commands is the one list of the Redis commands the daemon sends (its Lua
// scripts' and its go-redis calls'; tests hold it to both), and ACL DRYRUN
// (Redis ≥ 7.0) is asked, for the user ACL WHOAMI names, about each of
// them on each key and wake channel of the order queue, its shards and the
// task queues, on every master of a cluster. A command the daemon needs
// that is refused, on any of them, or renamed away (rename-command) is
// fatal (*PermissionError: exit 2) — a script that meets one halfway keeps
// the writes it made before. One it can do without (OBJECT, which the
// claim asks with pcall; SUBSCRIBE and UNSUBSCRIBE; INFO and CONFIG GET;
// on Redis Cluster COMMAND and ASKING) is warned about
// (redis_permissions). A server that cannot say — before 7.0, a user
// without ACL DRYRUN or ACL WHOAMI, an answer the check does not know — is
// warned about once and the check skipped.
//
// Unreachable dependencies are never fatal here: Database retries with
// backoff, and Redis and WatchPermissions retry until they get an answer,
// so the daemon reports not-ready instead. The SQL these checks run
// belongs to the packages that own the tables (orders, tasks), the Redis
// keys to package queue; this package only decides what to check and what
// to say.
package preflight

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/lifecycle"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// Defaults of the checks.
const (
	// DefaultAttemptTimeout bounds one attempt at preparing the database.
	DefaultAttemptTimeout = 30 * time.Second
	// DefaultRetryMax caps the backoff between attempts.
	DefaultRetryMax = 10 * time.Second
	// DefaultRedisRetry is the wait before asking Redis again.
	DefaultRedisRetry = 5 * time.Second
)

// Database prepares PostgreSQL for the daemon.
type Database struct {
	DB         *sqlx.DB // the shared pool (the order pool is the batches')
	URL        string   // ORDERDELAY_DATABASE_URL, for the migrations' own connection
	Migrate    bool     // apply the reference schema's migrations first
	Statements orders.Statements
	// ReferenceSchema: the reference close and overdue statements are in
	// use, so the reference schema's version and index are ours to check.
	ReferenceSchema bool
	CloseEvents     bool                            // the outbox table must exist
	Verify          func(ctx context.Context) error // further checks (task queues); nil: none
	Metrics         *metrics.Metrics
	Log             *zap.Logger
	// Secrets are the connection strings whose passwords never reach a
	// log line or an error.
	Secrets []string
	// AttemptTimeout and RetryMax: zero takes the defaults above.
	AttemptTimeout, RetryMax time.Duration
}

// Prepare waits for PostgreSQL (retrying with backoff, never fatal),
// migrates when asked, verifies the statements and warns about the
// schema. A statement that fails verification is returned as an
// *orders.StatementError (the daemon exits 2); ctx ending returns ctx.Err().
func (d Database) Prepare(ctx context.Context) error {
	if d.AttemptTimeout <= 0 {
		d.AttemptTimeout = DefaultAttemptTimeout
	}
	if d.RetryMax <= 0 {
		d.RetryMax = DefaultRetryMax
	}
	b := backoff.NewExponentialBackOff()
	b.MaxInterval = d.RetryMax
	for {
		err := d.attempt(ctx)
		if err == nil {
			d.Metrics.SetUp(metrics.DepPostgres, true)
			return nil
		}
		if se := (*orders.StatementError)(nil); errors.As(err, &se) {
			return d.redact(se)
		}
		d.Metrics.SetUp(metrics.DepPostgres, false)
		wait := b.NextBackOff()
		d.Log.Warn("postgresql not ready; retrying", zap.Error(d.redact(err)), zap.Duration("retry_in", wait))
		if !lifecycle.Sleep(ctx, wait) {
			return ctx.Err()
		}
	}
}

func (d Database) attempt(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, d.AttemptTimeout)
	defer cancel()
	if err := d.DB.PingContext(ctx); err != nil {
		return err
	}
	if d.Migrate {
		v, err := orders.Migrate(d.URL)
		if err != nil {
			return err
		}
		d.Log.Info("schema migrated", zap.Uint("version", v))
	}
	if err := orders.NewStore(d.DB, d.Statements).Verify(ctx); err != nil {
		return err
	}
	if d.CloseEvents {
		if err := orders.CheckOutbox(ctx, d.DB); err != nil {
			return err
		}
	}
	if d.Verify != nil {
		if err := d.Verify(ctx); err != nil {
			return err
		}
	}
	if d.ReferenceSchema {
		d.schemaWarnings(ctx)
	}
	return nil
}

// schemaWarnings checks the reference schema: its version, and the partial
// index the reconciler needs.
func (d Database) schemaWarnings(ctx context.Context) {
	v, err := orders.AppliedVersion(ctx, d.DB)
	stale := err != nil || v < orders.SchemaVersion
	d.Metrics.Warn(metrics.CheckSchemaVersion, stale)
	if stale {
		d.Log.Warn("the reference schema is not at this release's version: run orderdelay migrate",
			zap.Int("found", v), zap.Int("want", orders.SchemaVersion), zap.NamedError("read_error", err))
	}
	indexed, err := orders.HasPendingIndex(ctx, d.DB)
	d.Metrics.Warn(metrics.CheckPendingIndex, err != nil || !indexed)
	if err != nil || !indexed {
		d.Log.Warn("no partial index on orders(expires_at) WHERE status = 'pending': the reconciler will scan the table",
			zap.NamedError("read_error", err))
	}
}

func (d Database) redact(err error) error {
	if err == nil {
		return nil
	}
	var se *orders.StatementError
	if errors.As(err, &se) {
		// Keep the type (the daemon exits 2 on it), hide the secrets.
		return &orders.StatementError{Name: se.Name, Setting: se.Setting, Err: errors.New(config.Redact(se.Err.Error(), d.Secrets...))}
	}
	return errors.New(config.Redact(err.Error(), d.Secrets...))
}

// WatchRedis asks Redis for its settings until it answers once (retrying
// every DefaultRedisRetry), warns about what it finds, and returns nil; it
// returns nil when ctx ends too. It is the daemon's one-shot Redis check.
func WatchRedis(ctx context.Context, rdb redis.UniversalClient, m *metrics.Metrics, log *zap.Logger) error {
	for {
		if err := Redis(ctx, rdb, m, log); err == nil || ctx.Err() != nil {
			return nil
		}
		if !lifecycle.Sleep(ctx, DefaultRedisRetry) {
			return nil
		}
	}
}

// Redis warns about settings that can lose the queue — eviction (the whole
// queue is one key), no persistence, Redis older than 6.2 — on every master
// of a cluster, and sets the matching warning gauges.
func Redis(ctx context.Context, rdb redis.UniversalClient, m *metrics.Metrics, log *zap.Logger) error {
	nodes, err := masters(ctx, rdb)
	if err != nil {
		return err
	}
	var old, evicts, volatile bool
	for _, n := range nodes {
		o, e, v, err := nodeWarnings(ctx, n, log)
		if err != nil {
			return err
		}
		old, evicts, volatile = old || o, evicts || e, volatile || v
	}
	m.Warn(metrics.CheckRedisVersion, old)
	m.Warn(metrics.CheckRedisEviction, evicts)
	m.Warn(metrics.CheckRedisPersistence, volatile)
	return nil
}

// nodeWarnings checks one Redis node and logs what it finds.
func nodeWarnings(ctx context.Context, n redis.UniversalClient, log *zap.Logger) (old, evicts, volatile bool, err error) {
	info, err := n.Info(ctx, "server").Result()
	if err != nil && transient(err) {
		return false, false, false, fmt.Errorf("redis INFO: %w", err)
	}
	if err != nil {
		// Refused (an ACL, rename-command): asking again would not help.
		log.Info("cannot read redis INFO; check that Redis is 6.2 or later yourself", zap.Error(err))
	}
	port := infoField(info, "tcp_port")
	v := infoField(info, "redis_version")
	if old = v != "" && versionBelow(v, 6, 2); old {
		log.Warn("redis is older than 6.2; orderdelay needs ZRANGE BYSCORE and ZMSCORE",
			zap.String("redis_version", v), zap.String("port", port))
	}
	cfgs, err := n.ConfigGet(ctx, "*").Result()
	if err != nil {
		log.Info("cannot read redis CONFIG (managed Redis?); check maxmemory-policy and persistence yourself", zap.Error(err))
		return old, false, false, nil
	}
	p := cfgs["maxmemory-policy"]
	if evicts = p != "" && p != "noeviction"; evicts {
		log.Warn("redis maxmemory-policy is not noeviction: under memory pressure Redis may evict the whole queue",
			zap.String("maxmemory-policy", p), zap.String("port", port))
	}
	if volatile = cfgs["save"] == "" && cfgs["appendonly"] != "yes"; volatile {
		log.Warn("redis persists nothing (no RDB snapshots, no AOF): a restart empties the queue and only the reconciler recovers it",
			zap.String("port", port))
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
