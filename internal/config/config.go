// Package config owns orderdelay's settings: their names, groups, kinds,
// defaults, help texts and validation. Every setting has an environment
// variable and a flag typed by its Kind (a boolean setting's flag needs no
// value); a flag given on the command line wins over the variable, which
// wins over the default. Register's loader refuses invalid values and
// inconsistent combinations with an error that names the setting; the
// command exits 2.
//
// The README's configuration tables are generated from Settings, one per
// Group (and a test keeps the two equal), so documentation cannot drift
// from the code; `-h` lists the settings by group too (WriteHelp).
package config

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/lib/pq"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/maintain"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Config is the daemon's configuration, defaults applied and validated.
type Config struct {
	RedisURL          string
	RedisMode         string // standalone | sentinel | cluster
	DatabaseURL       string
	QueueKey          string
	QueueShards       int // shard keys the order queue is spread over; 1: the queue key only
	ScanInterval      time.Duration
	Workers           int
	BatchSize         int
	Lease             time.Duration
	StatementTimeout  time.Duration
	DrainTimeout      time.Duration
	MaxAttempts       int
	BackoffMax        time.Duration
	ReconcileInterval time.Duration // 0 disables the reconciler
	ReconcileGrace    time.Duration
	HTTPAddr          string // empty disables the HTTP server
	PprofAddr         string // empty: pprof off
	APITokens         []string
	APIAuth           string // token | none (see Protected)
	LogLevel          zapcore.Level
	LogFormat         string // json | console
	CloseSQL          string
	LookupSQL         string
	OverdueSQL        string
	CloseDelay        time.Duration // closing waits this long past the deadline
	MaxCloseRate      float64       // orders/s per replica; 0 = unlimited
	AdminTokens       []string      // bearer tokens for /admin/v1; none: admin API off
	AdminAddr         string        // the admin API's own listener (with AdminTokens)
	DryRun            bool          // report what would close; close nothing
	DeadRetention     time.Duration // dead letters older than this are purged; 0 keeps them
	DeadMax           int           // most dead letters kept (oldest purged first); 0: no cap
	QueuesFile        string        // named task queues; empty: none
	CloseEvents       bool          // publish a close event per closed order
	CloseEventsMaxLen int64         // approximate cap of the events stream
	// PreparedStatements runs a batch's statements prepared, once per
	// connection; false sends them unprepared (a pooler that hands
	// transactions to any server session and does not track prepared
	// statements).
	PreparedStatements bool
	ReminderQueue      string        // task queue that gets a reminder per order; empty: none
	ReminderBefore     time.Duration // how long before the deadline the reminder is due
}

// Setting describes one setting.
type Setting struct {
	Env     string
	Group   Group // the heading it is listed under (-h, README)
	Kind    Kind  // how its flag parses; zero: a string
	Default string
	Help    string
	Secret  bool // masked wherever it is shown
	set     func(c *Config, v string) error
}

// Flag is the flag name of the setting: the variable without its prefix,
// lower-cased, underscores as dashes.
func (s Setting) Flag() string {
	return strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(s.Env, "ORDERDELAY_")), "_", "-")
}

// Settings lists every setting, in the order the README shows them. The
// defaults of the order path's settings are the consumer's own (its
// Default* constants, which apply where its Config is left zero): each
// number is written once, there.
var Settings = []Setting{
	{Env: "ORDERDELAY_REDIS_URL", Group: GroupConnection, Default: "redis://127.0.0.1:6379/0", Secret: true,
		Help: "Redis URL (`redis://` or `rediss://`, user and password in the URL); for sentinel and cluster see `ORDERDELAY_REDIS_MODE`",
		set:  func(c *Config, v string) error { c.RedisURL = v; return nil }},
	{Env: "ORDERDELAY_REDIS_MODE", Group: GroupConnection, Default: "standalone",
		Help: "`standalone`, `sentinel` (URL: `redis://[sentinel-user:sentinel-pass@]sentinel:26379?master_name=NAME&addr=sentinel2:26379&password=MASTER-PASS`; the userinfo logs in to the sentinels, `password=` to the master) or `cluster` (URL: `redis://node1:6379?addr=node2:6379`)",
		set:  func(c *Config, v string) error { c.RedisMode = v; return nil }},
	{Env: "ORDERDELAY_DATABASE_URL", Group: GroupConnection, Default: "postgres://127.0.0.1:5432/orderdelay?sslmode=disable", Secret: true,
		Help: "PostgreSQL URL or key=value DSN; `sslmode` is honoured",
		set:  func(c *Config, v string) error { c.DatabaseURL = v; return nil }},
	{Env: "ORDERDELAY_QUEUE_KEY", Group: GroupConnection, Default: queue.DefaultKey,
		Help: "the queue's sorted set; companions are named `{KEY}:suffix`",
		set:  func(c *Config, v string) error { c.QueueKey = v; return queue.ValidateKey(v) }},
	{Env: "ORDERDELAY_QUEUE_SHARDS", Group: GroupConnection, Kind: KindInt, Default: "1", Help: "spread the order queue over this many shard keys (`KEY#<n>.<k>`, each in a Redis Cluster slot of its own; an order goes to shard CRC-32(serial) mod this number); the queue key itself is still served (`1`: the queue key only; see `docs/scaling.md`)",
		set: intIn(func(c *Config) *int { return &c.QueueShards }, 1, queue.MaxShards)},
	{Env: "ORDERDELAY_SCAN_INTERVAL", Group: GroupClosing, Kind: KindDuration, Default: duration(consumer.DefaultScanInterval), Help: "longest sleep between scans",
		set: durationIn(func(c *Config) *time.Duration { return &c.ScanInterval }, 10*time.Millisecond, time.Hour)},
	{Env: "ORDERDELAY_WORKERS", Group: GroupClosing, Kind: KindInt, Default: strconv.Itoa(consumer.DefaultWorkers), Help: "batches closed concurrently (= connections of the order path's own pool, plus one for the reconciler)",
		set: intIn(func(c *Config) *int { return &c.Workers }, 1, 256)},
	{Env: "ORDERDELAY_BATCH_SIZE", Group: GroupClosing, Kind: KindInt, Default: strconv.Itoa(consumer.DefaultBatchSize), Help: "serials per claim and per close",
		set: intIn(func(c *Config) *int { return &c.BatchSize }, 1, 5000)},
	{Env: "ORDERDELAY_LEASE", Group: GroupClosing, Kind: KindDuration, Default: duration(consumer.DefaultLease), Help: "how long a claim is held before another replica may take it",
		set: durationIn(func(c *Config) *time.Duration { return &c.Lease }, time.Second, 24*time.Hour)},
	{Env: "ORDERDELAY_STATEMENT_TIMEOUT", Group: GroupClosing, Kind: KindDuration, Default: duration(consumer.DefaultStatementTimeout), Help: "deadline of one batch; must be below the lease. Also the server's statement_timeout on the order path's connections, with lock_timeout a quarter of it (at least 10 ms)",
		set: durationIn(func(c *Config) *time.Duration { return &c.StatementTimeout }, 10*time.Millisecond, 24*time.Hour)},
	{Env: "ORDERDELAY_DRAIN_TIMEOUT", Group: GroupClosing, Kind: KindDuration, Default: duration(consumer.DefaultDrainTimeout), Help: "how long in-flight batches may finish on SIGTERM (at least 10ms; `0` is refused, not a default); must be below the lease",
		set: durationIn(func(c *Config) *time.Duration { return &c.DrainTimeout }, 10*time.Millisecond, 24*time.Hour)},
	{Env: "ORDERDELAY_MAX_ATTEMPTS", Group: GroupClosing, Kind: KindInt, Default: strconv.Itoa(consumer.DefaultMaxAttempts), Help: "attempts before an order without a row is dead-lettered",
		set: intIn(func(c *Config) *int { return &c.MaxAttempts }, 1, 1000)},
	{Env: "ORDERDELAY_BACKOFF_MAX", Group: GroupClosing, Kind: KindDuration, Default: duration(consumer.DefaultBackoffMax), Help: "cap of the exponential retry backoff (with jitter); also caps the wait after a failed Redis or PostgreSQL call (at most 10s)",
		set: durationIn(func(c *Config) *time.Duration { return &c.BackoffMax }, time.Second, 24*time.Hour)},
	{Env: "ORDERDELAY_RECONCILE_INTERVAL", Group: GroupReconciler, Kind: KindDuration, Default: duration(maintain.DefaultReconcileInterval), Help: "reconciler period (`0` disables it)",
		set: durationIn(func(c *Config) *time.Duration { return &c.ReconcileInterval }, 0, 24*time.Hour)},
	{Env: "ORDERDELAY_RECONCILE_GRACE", Group: GroupReconciler, Kind: KindDuration, Default: duration(maintain.DefaultReconcileGrace), Help: "how long past its deadline a pending order missing from the queue must be before the reconciler closes it; must exceed the lease",
		set: durationIn(func(c *Config) *time.Duration { return &c.ReconcileGrace }, time.Second, 30*24*time.Hour)},
	{Env: "ORDERDELAY_HTTP_ADDR", Group: GroupHTTP, Default: "127.0.0.1:8080", Help: "listener of the producer API `/v1`, `/metrics` and the health checks (empty: off); loopback by default: any other address, such as `:8080` in a container, needs `ORDERDELAY_API_TOKEN` or `ORDERDELAY_API_AUTH=none` (protected mode, see `docs/security.md`)",
		set: addr(func(c *Config) *string { return &c.HTTPAddr })},
	{Env: "ORDERDELAY_PPROF_ADDR", Group: GroupHTTP, Default: "", Help: "separate, opt-in pprof listener, e.g. `127.0.0.1:6060` (empty: off); loopback only, since it takes no token and shows the command line (a non-loopback address refuses to start, exit 2)",
		set: addr(func(c *Config) *string { return &c.PprofAddr })},
	{Env: "ORDERDELAY_API_TOKEN", Group: GroupHTTP, Default: "", Secret: true, Help: "bearer token(s) for `/v1`, comma-separated for rotation, each at least 16 bytes (empty: protected mode or no auth, see `ORDERDELAY_API_AUTH`)",
		set: setTokens},
	{Env: "ORDERDELAY_API_AUTH", Group: GroupHTTP, Default: "token", Help: "`token`: `/v1` needs a bearer token from `ORDERDELAY_API_TOKEN`; with none configured (protected mode) `/v1` answers without one but only on a loopback `ORDERDELAY_HTTP_ADDR`, and any other address refuses to start (exit 2). `none`: no auth on `/v1` on any address, logged as a warning at every start (`ORDERDELAY_API_TOKEN` must then be empty)",
		set: func(c *Config, v string) error {
			if v != AuthToken && v != AuthNone {
				return fmt.Errorf("want token or none, got %q", v)
			}
			c.APIAuth = v
			return nil
		}},
	{Env: "ORDERDELAY_LOG_LEVEL", Group: GroupOperator, Default: "info", Help: "`debug`, `info`, `warn` or `error`",
		set: func(c *Config, v string) error {
			l, err := zapcore.ParseLevel(v)
			if err != nil || l > zapcore.ErrorLevel {
				return errors.New("want debug, info, warn or error")
			}
			c.LogLevel = l
			return nil
		}},
	{Env: "ORDERDELAY_LOG_FORMAT", Group: GroupOperator, Default: "json", Help: "`json`, or `console` for people",
		set: oneOf(func(c *Config) *string { return &c.LogFormat }, "json", "console")},
	{Env: "ORDERDELAY_CLOSE_SQL", Group: GroupClosing, Default: "", Help: "close statement: `$1 text[]` → the serials it closed (empty: reference schema)",
		set: func(c *Config, v string) error { c.CloseSQL = v; return nil }},
	{Env: "ORDERDELAY_LOOKUP_SQL", Group: GroupClosing, Default: "", Help: "lookup statement: `$1 text[]` → each serial that has a row and whether it is still pending (`text, boolean`; empty: reference schema)",
		set: func(c *Config, v string) error { c.LookupSQL = v; return nil }},
	{Env: "ORDERDELAY_OVERDUE_SQL", Group: GroupReconciler, Default: "", Help: "reconciler statement, paged by keyset: `$1 bigint` grace ms, `$2 bigint` limit, `$3 timestamptz` and `$4 text` the deadline and serial of the previous page's last row → pending serials and their deadlines (`timestamptz`) past deadline + grace, after (`$3`, `$4`), in (deadline, serial) order (empty: reference schema)",
		set: func(c *Config, v string) error { c.OverdueSQL = v; return nil }},
	{Env: "ORDERDELAY_CLOSE_DELAY", Group: GroupClosing, Kind: KindDuration, Default: "0s", Help: "closing waits this long past the deadline (payments in flight); must be below the reconcile grace",
		set: durationIn(func(c *Config) *time.Duration { return &c.CloseDelay }, 0, 24*time.Hour)},
	{Env: "ORDERDELAY_MAX_CLOSE_RATE", Group: GroupClosing, Kind: KindFloat, Default: "0", Help: "most orders closed per second by this replica (`0`: unlimited)",
		set: func(c *Config, v string) error {
			r, err := strconv.ParseFloat(v, 64)
			if err != nil || r < 0 || r > 1e7 || r != r {
				return fmt.Errorf("want a number of orders per second from 0 (unlimited) to 10000000, got %q", v)
			}
			c.MaxCloseRate = r
			return nil
		}},
	{Env: "ORDERDELAY_ADMIN_TOKEN", Group: GroupHTTP, Default: "", Secret: true, Help: "bearer token(s) for the admin API `/admin/v1` (pause, extend, forensics, task queues' requeue, purge, pause), served on `ORDERDELAY_ADMIN_ADDR` only; comma-separated, each at least 16 bytes, distinct from the API tokens (empty: admin API off)",
		set: func(c *Config, v string) error {
			toks, err := parseTokens(v)
			c.AdminTokens = toks
			return err
		}},
	{Env: "ORDERDELAY_ADMIN_ADDR", Group: GroupHTTP, Default: "127.0.0.1:8081", Help: "the admin API's own listener, bound only when `ORDERDELAY_ADMIN_TOKEN` is set; loopback by default, so operators reach it from the pod (`kubectl port-forward`); never the API's address or port",
		set: addr(func(c *Config) *string { return &c.AdminAddr })},
	{Env: "ORDERDELAY_DRY_RUN", Group: GroupOperator, Kind: KindBool, Default: "false", Help: "run everything except the close: the close statement runs in a transaction that is rolled back, and what it would have closed is logged and counted; the queue and the dead letters are left as they are, and task queues are not served",
		set: boolean(func(c *Config) *bool { return &c.DryRun })},
	{Env: "ORDERDELAY_DEAD_LETTER_RETENTION", Group: GroupOperator, Kind: KindDuration, Default: "168h", Help: "dead letters older than this are purged, task payloads with them, on the order queue and every task queue without its own `dead_retention` (`0`: kept until purged by hand)",
		set: durationIn(func(c *Config) *time.Duration { return &c.DeadRetention }, 0, 10*365*24*time.Hour)},
	{Env: "ORDERDELAY_DEAD_LETTER_MAX", Group: GroupOperator, Kind: KindInt, Default: "100000", Help: "most dead letters kept per queue; the oldest beyond it are purged, on the order queue and every task queue without its own `dead_max` (`0`: no cap)",
		set: intIn(func(c *Config) *int { return &c.DeadMax }, 0, 100_000_000)},
	{Env: "ORDERDELAY_QUEUES_FILE", Group: GroupTaskQueues, Default: "", Help: "YAML file declaring named task queues (see `configs/orderdelay.yaml`); empty: the order queue only",
		set: func(c *Config, v string) error { c.QueuesFile = v; return nil }},
	{Env: "ORDERDELAY_CLOSE_EVENTS", Group: GroupClosing, Kind: KindBool, Default: "false", Help: "publish every close on the stream `{KEY}:events` (serial, reason, closed_at), at least once, through an outbox table written in the close transaction (needs `orderdelay migrate`)",
		set: boolean(func(c *Config) *bool { return &c.CloseEvents })},
	{Env: "ORDERDELAY_CLOSE_EVENTS_MAXLEN", Group: GroupClosing, Kind: KindInt, Default: "1000000", Help: "approximate cap of the close-event stream (XADD MAXLEN ~)",
		set: func(c *Config, v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1000 || n > 1_000_000_000 {
				return fmt.Errorf("want an integer from 1000 to 1000000000, got %q", v)
			}
			c.CloseEventsMaxLen = n
			return nil
		}},
	{Env: "ORDERDELAY_PREPARED_STATEMENTS", Group: GroupClosing, Kind: KindBool, Default: "true", Help: "run a batch's statements as server-side prepared statements, prepared once per connection (one round trip less per statement, a plan kept); set `false` behind PgBouncer in transaction pooling older than 1.21 or without `max_prepared_statements`",
		set: boolean(func(c *Config) *bool { return &c.PreparedStatements })},
	{Env: "ORDERDELAY_REMINDER_QUEUE", Group: GroupTaskQueues, Default: "", Help: "name of a task queue (in `ORDERDELAY_QUEUES_FILE`) that gets a reminder task per order enqueued through the API or CLI, due `ORDERDELAY_REMINDER_BEFORE` before its deadline (empty: no reminders); not a durable queue",
		set: func(c *Config, v string) error { c.ReminderQueue = v; return nil }},
	{Env: "ORDERDELAY_REMINDER_BEFORE", Group: GroupTaskQueues, Kind: KindDuration, Default: "10m", Help: "how long before an order's deadline its reminder is due",
		set: durationIn(func(c *Config) *time.Duration { return &c.ReminderBefore }, time.Second, 30*24*time.Hour)},
}

// Error is a refused setting; the command exits 2 on it.
type Error struct {
	Setting string // e.g. "ORDERDELAY_WORKERS (--workers)"
	Msg     string
}

func (e *Error) Error() string { return e.Setting + ": " + e.Msg }

// Register adds a flag per setting to fs and returns a function that loads
// the configuration after fs.Parse: defaults, then env (via getenv), then
// the flags given. A flag is typed by its setting's Kind: fs.Parse refuses
// a malformed number, duration or boolean naming the flag and the value,
// and a boolean setting's flag needs no value (--dry-run, --dry-run=false).
// Ranges and combinations are checked by the loader.
func Register(fs *flag.FlagSet, getenv func(string) (string, bool)) func() (Config, error) {
	vals := make([]*flagValue, len(Settings))
	for i, s := range Settings {
		vals[i] = &flagValue{kind: s.Kind}
		fs.Var(vals[i], s.Flag(), fmt.Sprintf("%s (env %s, default %q)", stripMD(s.Help), s.Env, s.shownDefault()))
	}
	return func() (Config, error) {
		given := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
		var c Config
		var errs []error
		for i, s := range Settings {
			v, src := s.Default, s.Env
			if e, ok := getenv(s.Env); ok {
				v = e
			}
			if given[s.Flag()] {
				v = vals[i].text
			}
			v = strings.TrimSpace(v)
			if err := s.set(&c, v); err != nil {
				errs = append(errs, &Error{Setting: fmt.Sprintf("%s (--%s)", src, s.Flag()), Msg: err.Error()})
			}
		}
		if len(errs) == 0 {
			errs = append(errs, c.validate()...)
		}
		return c, errors.Join(errs...)
	}
}

// validate checks combinations and the connection strings.
func (c *Config) validate() []error {
	var errs []error
	bad := func(env, msg string) {
		errs = append(errs, &Error{Setting: env, Msg: msg})
	}
	if c.StatementTimeout >= c.Lease {
		bad("ORDERDELAY_STATEMENT_TIMEOUT", fmt.Sprintf("%s must be below ORDERDELAY_LEASE (%s): a batch must end before its lease does", c.StatementTimeout, c.Lease))
	}
	if c.DrainTimeout >= c.Lease {
		bad("ORDERDELAY_DRAIN_TIMEOUT", fmt.Sprintf("%s must be below ORDERDELAY_LEASE (%s)", c.DrainTimeout, c.Lease))
	}
	if c.ReconcileInterval > 0 && c.ReconcileGrace <= c.Lease {
		bad("ORDERDELAY_RECONCILE_GRACE", fmt.Sprintf("%s must exceed ORDERDELAY_LEASE (%s), or the reconciler races the fast path", c.ReconcileGrace, c.Lease))
	}
	switch c.RedisMode {
	case "standalone":
		if _, err := redis.ParseURL(c.RedisURL); err != nil {
			bad("ORDERDELAY_REDIS_URL", "not a valid redis:// or rediss:// URL: "+Redact(err.Error(), c.RedisURL))
		}
	case "sentinel":
		if o, err := redis.ParseFailoverURL(c.RedisURL); err != nil {
			bad("ORDERDELAY_REDIS_URL", "not a valid sentinel URL (redis://host:26379?master_name=NAME): "+Redact(err.Error(), c.RedisURL))
		} else if o.MasterName == "" {
			bad("ORDERDELAY_REDIS_URL", "a sentinel URL needs master_name (redis://host:26379?master_name=NAME)")
		}
	case "cluster":
		if _, err := redis.ParseClusterURL(c.RedisURL); err != nil {
			bad("ORDERDELAY_REDIS_URL", "not a valid cluster URL: "+Redact(err.Error(), c.RedisURL))
		}
	default:
		bad("ORDERDELAY_REDIS_MODE", fmt.Sprintf("want standalone, sentinel or cluster, got %q", c.RedisMode))
	}
	if _, err := pq.NewConnector(c.DatabaseURL); err != nil {
		bad("ORDERDELAY_DATABASE_URL", "not a valid PostgreSQL URL or DSN: "+Redact(err.Error(), c.DatabaseURL))
	}
	if c.ReconcileInterval > 0 && c.CloseDelay >= c.ReconcileGrace {
		bad("ORDERDELAY_CLOSE_DELAY", fmt.Sprintf("%s must be below ORDERDELAY_RECONCILE_GRACE (%s), or the reconciler closes orders the delay holds back", c.CloseDelay, c.ReconcileGrace))
	}
	for _, a := range c.AdminTokens {
		if slices.Contains(c.APITokens, a) {
			bad("ORDERDELAY_ADMIN_TOKEN", "must differ from every ORDERDELAY_API_TOKEN: a producer must not be able to pause closing")
			break
		}
	}
	if c.ReminderQueue != "" && c.QueuesFile == "" {
		bad("ORDERDELAY_REMINDER_QUEUE", "names a task queue, so ORDERDELAY_QUEUES_FILE must be set")
	}
	if sameListener(c.HTTPAddr, c.PprofAddr) {
		bad("ORDERDELAY_PPROF_ADDR", "must differ from ORDERDELAY_HTTP_ADDR: pprof never shares the public port")
	}
	errs = append(errs, c.validateAuth()...)
	return errs
}

// Statements returns the configured SQL statements (empty: defaults).
func (c *Config) Statements() orders.Statements {
	return orders.Statements{Close: c.CloseSQL, Lookup: c.LookupSQL, Overdue: c.OverdueSQL}
}

// duration formats a default as people write it: "5s", "1m", "168h".
func duration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

func boolean(field func(*Config) *bool) func(*Config, string) error {
	return func(c *Config, v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("want true or false, got %q", v)
		}
		*field(c) = b
		return nil
	}
}

func intIn(field func(*Config) *int, lo, hi int) func(*Config, string) error {
	return func(c *Config, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < lo || n > hi {
			return fmt.Errorf("want an integer from %d to %d, got %q", lo, hi, v)
		}
		*field(c) = n
		return nil
	}
}

func durationIn(field func(*Config) *time.Duration, lo, hi time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("want a duration such as 500ms, 5s or 2m, got %q", v)
		}
		if d < lo || d > hi {
			return fmt.Errorf("want a duration from %s to %s, got %s", lo, hi, d)
		}
		*field(c) = d
		return nil
	}
}

func oneOf(field func(*Config) *string, allowed ...string) func(*Config, string) error {
	return func(c *Config, v string) error {
		for _, a := range allowed {
			if v == a {
				*field(c) = v
				return nil
			}
		}
		return fmt.Errorf("want one of %s, got %q", strings.Join(allowed, ", "), v)
	}
}

func addr(field func(*Config) *string) func(*Config, string) error {
	return func(c *Config, v string) error {
		if v != "" {
			_, port, err := net.SplitHostPort(v)
			if err != nil || port == "" {
				return fmt.Errorf("want host:port or :port, got %q", v)
			}
			if n, err := strconv.ParseUint(port, 10, 16); err != nil || n > 65535 {
				return fmt.Errorf("want a port number from 0 to 65535, got %q in %q", port, v)
			}
		}
		*field(c) = v
		return nil
	}
}

func setTokens(c *Config, v string) error {
	toks, err := parseTokens(v)
	c.APITokens = toks
	return err
}

func parseTokens(v string) ([]string, error) {
	if v == "" {
		return nil, nil
	}
	var out []string
	for t := range strings.SplitSeq(v, ",") {
		t = strings.TrimSpace(t)
		if len(t) < 16 {
			return nil, errors.New("each token must be at least 16 bytes (a short token is guessable)")
		}
		out = append(out, t)
	}
	return out, nil
}

var dsnPassword = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// Mask hides the password of a URL (scheme://user:pass@host) or key=value
// DSN (password=...), for logs and messages.
func Mask(s string) string {
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
		if u.User != nil {
			if _, has := u.User.Password(); has {
				u.User = url.UserPassword(u.User.Username(), "xxxxx")
			}
		}
		q := u.Query()
		if q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	// Not a URL (a DSN, or a URL that does not parse): mask
	// every password Redact can find in it.
	return Redact(s, s)
}

// Redact removes from msg every password found in the connection strings.
func Redact(msg string, conns ...string) string {
	for _, c := range conns {
		for _, p := range passwords(c) {
			if p != "" {
				msg = strings.ReplaceAll(msg, p, "xxxxx")
				msg = strings.ReplaceAll(msg, url.QueryEscape(p), "xxxxx")
			}
		}
	}
	return dsnPassword.ReplaceAllString(msg, "${1}xxxxx")
}

// passwords finds the password parts of a connection string, even one that
// does not parse as a URL.
func passwords(c string) []string {
	var out []string
	if u, err := url.Parse(c); err == nil && u.User != nil {
		if p, ok := u.User.Password(); ok {
			out = append(out, p)
		}
	} else if i := strings.Index(c, "://"); i >= 0 {
		rest := c[i+3:]
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			if colon := strings.Index(rest[:at], ":"); colon >= 0 {
				out = append(out, rest[colon+1:at])
			}
		}
	}
	for _, m := range dsnPassword.FindAllStringSubmatch(c, -1) {
		out = append(out, strings.Trim(m[2], "'"))
	}
	return out
}

func stripMD(s string) string { return strings.ReplaceAll(s, "`", "") }

// Markdown renders the settings as the README's configuration tables: one
// per group, in the order of Groups, each listing its settings in the
// order of Settings.
func Markdown() string {
	var b strings.Builder
	for i, g := range Groups {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "**%s**: %s\n\n", g, g.About())
		b.WriteString("| variable | flag | type | default | meaning |\n|---|---|---|---|---|\n")
		for _, s := range Settings {
			if s.Group != g {
				continue
			}
			def := "*(empty)*"
			if s.Default != "" {
				def = "`" + s.Default + "`"
			}
			fmt.Fprintf(&b, "| `%s` | `--%s` | %s | %s | %s |\n", s.Env, s.Flag(), s.Kind, def, strings.ReplaceAll(s.Help, "|", "\\|"))
		}
	}
	return b.String()
}
