// Package metrics owns the Prometheus metrics of the order queue: their
// names, help texts, label sets and buckets. Every component receives the
// same *Metrics, built once from a Registerer the caller passes in (never
// the global registry), so tests use a fresh registry each.
//
// Label values come from fixed sets and are created at zero, so dashboards
// and alerts see every series from the first scrape.
package metrics

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Stages label orderdelay_errors_total.
const (
	StageClaim     = "claim"
	StageClose     = "close"
	StageLookup    = "lookup"
	StageRemove    = "remove"
	StageReconcile = "reconcile"
	StageAPI       = "api"
)

// Skip reasons label orderdelay_orders_skipped_total.
const (
	SkipSettled  = "settled"
	SkipNotFound = "not_found"
)

// Dependencies label orderdelay_dependency_up.
const (
	DepRedis    = "redis"
	DepPostgres = "postgres"
)

// Metrics are the order queue's metrics.
type Metrics struct {
	Enqueued     prometheus.Counter
	Claimed      prometheus.Counter
	Reclaimed    prometheus.Counter
	Closed       prometheus.Counter
	Reconciled   prometheus.Counter
	InDoubt      prometheus.Counter
	Skipped      *prometheus.CounterVec
	DeadLettered *prometheus.CounterVec
	Errors       *prometheus.CounterVec
	Lateness     prometheus.Observer
	Inflight     prometheus.Gauge
	LastScan     prometheus.Gauge
	DependencyUp *prometheus.GaugeVec
	// Operator tools.
	Paused           prometheus.Gauge
	CloseRateLimited prometheus.Counter
	DryRunWouldClose prometheus.Counter
	ConfigWarning    *prometheus.GaugeVec
	// Forwarded counts tasks moved to a stream or list (task queues only).
	Forwarded prometheus.Counter
	// ReadyFull is 1 while a list queue's ready list is full (max_len)
	// and due tasks wait in the queue (task queues only).
	ReadyFull prometheus.Gauge
	// EventsRelayed counts close events published on the events stream.
	EventsRelayed prometheus.Counter
}

// Config-warning checks label orderdelay_config_warning.
const (
	CheckRedisEviction    = "redis_eviction"
	CheckRedisPersistence = "redis_persistence"
	CheckRedisVersion     = "redis_version"
	CheckSchemaVersion    = "schema_version"
	CheckPendingIndex     = "pending_index"
	// CheckRedisPermissions: the daemon's Redis user may not run a
	// command the daemon can do without (preflight.Permissions).
	CheckRedisPermissions = "redis_permissions"
)

// ConfigChecks lists every config-warning check.
var ConfigChecks = []string{CheckRedisEviction, CheckRedisPersistence, CheckRedisVersion, CheckSchemaVersion, CheckPendingIndex, CheckRedisPermissions}

// New creates the metrics and registers them, with build information, on
// reg.
func New(reg prometheus.Registerer, version, revision string) *Metrics {
	lateness := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "orderdelay_close_lateness_seconds",
		Help:    "Time from an order's deadline to the commit of its close.",
		Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 1800, 3600, 7200},
	})
	m := &Metrics{
		Enqueued: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_enqueued_total",
			Help: "Entries added through this daemon's API or CLI.",
		}),
		Claimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_claimed_total",
			Help: "Entries claimed by this replica because they became due: the true arrival rate.",
		}),
		Reclaimed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_reclaimed_total",
			Help: "Claims of entries whose earlier lease expired before the holder finished.",
		}),
		Closed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_orders_closed_total",
			Help: "Orders closed by the fast path.",
		}),
		Reconciled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_orders_reconciled_total",
			Help: "Orders closed by the reconciler; above zero means the fast path lost orders.",
		}),
		InDoubt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_orders_in_doubt_total",
			Help: "Orders a close of this replica closed whose COMMIT got no answer the server could then confirm: they may have closed, uncounted.",
		}),
		Skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "orderdelay_orders_skipped_total",
			Help: "Due entries not closed, by reason: settled (paid or already closed) or not_found (no order row yet).",
		}, []string{"reason"}),
		DeadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "orderdelay_dead_lettered_total",
			Help: "Entries moved to the dead-letter set, by reason.",
		}, []string{"reason"}),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "orderdelay_errors_total",
			Help: "Errors, by stage of the pipeline.",
		}, []string{"stage"}),
		Lateness: lateness,
		Inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "orderdelay_inflight_orders",
			Help: "Entries this replica holds under a lease right now.",
		}),
		LastScan: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "orderdelay_last_scan_timestamp_seconds",
			Help: "Unix time at which this replica last completed a scan of the queue.",
		}),
		DependencyUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "orderdelay_dependency_up",
			Help: "Whether the last use of a dependency succeeded (1) or failed (0).",
		}, []string{"dependency"}),
		Paused: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "orderdelay_paused",
			Help: "1 while an operator has paused closing on this queue (seen by this replica at its last scan), else 0.",
		}),
		CloseRateLimited: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_close_rate_limited_total",
			Help: "Times ORDERDELAY_MAX_CLOSE_RATE held back a claim.",
		}),
		DryRunWouldClose: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orderdelay_dry_run_would_close_total",
			Help: "Orders the close statement would have closed in dry-run mode (nothing was closed).",
		}),
		ConfigWarning: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "orderdelay_config_warning",
			Help: "1 when a start-up check found a risky setup (see the log line), or for redis_permissions when Redis refused the daemon's user a command while it runs; else 0.",
		}, []string{"check"}),
	}
	for _, c := range ConfigChecks {
		m.ConfigWarning.WithLabelValues(c)
	}
	m.Forwarded = prometheus.NewCounter(prometheus.CounterOpts{Name: "unused"}) // order queue: nothing forwarded
	m.ReadyFull = prometheus.NewGauge(prometheus.GaugeOpts{Name: "unused"})
	m.EventsRelayed = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "orderdelay_close_events_relayed_total",
		Help: "Close events this replica published on the events stream (ORDERDELAY_CLOSE_EVENTS).",
	})
	reg.MustRegister(m.EventsRelayed)
	for _, r := range []string{SkipSettled, SkipNotFound} {
		m.Skipped.WithLabelValues(r)
	}
	for _, r := range queue.DeadReasons {
		m.DeadLettered.WithLabelValues(r)
	}
	for _, s := range []string{StageClaim, StageClose, StageLookup, StageRemove, StageReconcile, StageAPI} {
		m.Errors.WithLabelValues(s)
	}
	for _, d := range []string{DepRedis, DepPostgres} {
		m.DependencyUp.WithLabelValues(d)
	}
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "orderdelay_build_info",
		Help:        "Build information; the value is always 1.",
		ConstLabels: prometheus.Labels{"version": version, "revision": revision, "goversion": runtime.Version()},
	})
	info.Set(1)
	reg.MustRegister(m.Enqueued, m.Claimed, m.Reclaimed, m.Closed, m.Reconciled, m.InDoubt, m.Skipped,
		m.DeadLettered, m.Errors, lateness, m.Inflight, m.LastScan, m.DependencyUp, info,
		m.Paused, m.CloseRateLimited, m.DryRunWouldClose, m.ConfigWarning)
	return m
}

// SetUp records whether dependency dep answered.
func (m *Metrics) SetUp(dep string, up bool) {
	v := 0.0
	if up {
		v = 1
	}
	m.DependencyUp.WithLabelValues(dep).Set(v)
}

// Warn sets the config-warning gauge of check.
func (m *Metrics) Warn(check string, on bool) {
	v := 0.0
	if on {
		v = 1
	}
	m.ConfigWarning.WithLabelValues(check).Set(v)
}
