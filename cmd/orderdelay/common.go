package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // the PostgreSQL driver (sqlx.Open elsewhere)
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
)

// parse parses a subcommand's flags plus every setting and returns the
// configuration and the remaining arguments. -h is a helpRequested error
// carrying the command's help; any mistake is a usageError that names the
// flag or setting. Nothing is written to the (unused) writer: run prints
// the help on stdout and the error on stderr.
func parse(name string, args []string, _ io.Writer, getenv func(string) (string, bool), extra func(*flag.FlagSet)) (config.Config, []string, error) {
	fs := flag.NewFlagSet("orderdelay "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // run prints the help (stdout) and the error (stderr)
	fs.Usage = func() {}
	if extra != nil {
		extra(fs)
	}
	var own []*flag.Flag // the command's flags, before the settings'
	fs.VisitAll(func(f *flag.Flag) { own = append(own, f) })
	load := config.Register(fs, getenv)
	// Allow flags after positional arguments (orderdelay enqueue A --after 1m).
	var pos []string
	all := args
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return config.Config{}, nil, helpRequested{commandHelp(name, own)}
			}
			return config.Config{}, nil, usageError{err}
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		if err := boolValueApart(fs, all[:len(all)-len(args)], args[0]); err != nil {
			return config.Config{}, nil, err
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	cfg, err := load()
	if err != nil {
		return cfg, nil, usageError{fmt.Errorf("invalid configuration:\n%w", err)}
	}
	return cfg, pos, nil
}

// newLogger builds the zap logger the configuration asks for.
func newLogger(cfg config.Config, w io.Writer) *zap.Logger {
	ec := zap.NewProductionEncoderConfig()
	ec.EncodeTime = zapcore.ISO8601TimeEncoder
	ec.EncodeDuration = zapcore.StringDurationEncoder
	var enc zapcore.Encoder
	if cfg.LogFormat == "console" {
		ec.EncodeLevel = zapcore.CapitalLevelEncoder
		enc = zapcore.NewConsoleEncoder(ec)
	} else {
		enc = zapcore.NewJSONEncoder(ec)
	}
	core := zapcore.NewCore(enc, zapcore.AddSync(w), cfg.LogLevel)
	return zap.New(core)
}

// newRedis returns the Redis client the configuration asks for.
func newRedis(cfg config.Config) (redis.UniversalClient, error) {
	switch cfg.RedisMode {
	case "sentinel":
		o, err := redis.ParseFailoverURL(cfg.RedisURL)
		if err != nil {
			return nil, err
		}
		return redis.NewFailoverClient(o), nil
	case "cluster":
		o, err := redis.ParseClusterURL(cfg.RedisURL)
		if err != nil {
			return nil, err
		}
		return redis.NewClusterClient(o), nil
	default:
		o, err := redis.ParseURL(cfg.RedisURL)
		if err != nil {
			return nil, err
		}
		return redis.NewClient(o), nil
	}
}

// readTimeoutOf is the read timeout of a client newRedis made, as go-redis
// settled it (its default, 5 s, unless the URL's read_timeout says
// otherwise), or 0 when its reads have none.
func readTimeoutOf(rdb redis.UniversalClient) time.Duration {
	var t time.Duration
	switch c := rdb.(type) {
	case *redis.Client: // standalone and sentinel
		t = c.Options().ReadTimeout
	case *redis.ClusterClient:
		t = c.Options().ReadTimeout
	}
	return max(t, 0) // 0: none; -1: no deadline set on the socket at all
}

// withApplicationName sets PostgreSQL's application_name (unless the user
// set one), so pg_stat_activity and the reference schema's closed_by say
// which replica did what.
func withApplicationName(dsn, name string) string {
	if strings.Contains(dsn, "application_name") {
		return dsn
	}
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("application_name", name)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " application_name='" + strings.ReplaceAll(name, "'", "") + "'"
}

func replicaName() string {
	host, _ := os.Hostname()
	if host == "" {
		host = "unknown"
	}
	return fmt.Sprintf("orderdelay/%s/%d", host, os.Getpid())
}

// openDB opens (lazily; nothing is dialled yet) a pool of its own on the
// database (see orders.Open for the server-side timeouts o may set).
func openDB(cfg config.Config, o orders.PoolOptions) (*sqlx.DB, error) {
	db, err := orders.Open(withApplicationName(cfg.DatabaseURL, replicaName()), o)
	if err != nil {
		return nil, fmt.Errorf("database: %s", config.Redact(err.Error(), cfg.DatabaseURL))
	}
	return db, nil
}

// orderPoolOptions is the order path's pool: one connection per worker (a
// batch's close and lookup run one after the other), one for the
// reconciler's page transaction, and the server-side timeouts
// (statement_timeout = ORDERDELAY_STATEMENT_TIMEOUT, lock_timeout a quarter
// of it, at least 10 ms).
func orderPoolOptions(cfg config.Config) orders.PoolOptions {
	n := cfg.Workers
	if reconciles(cfg) {
		n++
	}
	return orders.PoolOptions{MaxConns: n, StatementTimeout: cfg.StatementTimeout}
}

// reconciles reports whether the daemon runs the reconciler.
func reconciles(cfg config.Config) bool { return cfg.ReconcileInterval > 0 && !cfg.DryRun }

// sharedPoolOptions is the pool of everything else: start-up checks, admin
// calls, the close-event relay and durable queues' API calls (two
// connections), plus one per worker of
// each task queue that runs SQL (sql actions, durable queues' executors)
// and one per durable queue's loader. No server-side timeouts: admin calls
// may run long; the task queues bound their batches with deadlines.
func sharedPoolOptions(f tasks.File) orders.PoolOptions {
	n := 2
	for _, q := range f.Queues {
		if q.Action.Type == tasks.ActionSQL || q.Durable { // durable: sql or webhook actions only
			n += q.Workers
		}
		if q.Durable {
			n++ // the loader
		}
	}
	return orders.PoolOptions{MaxConns: n}
}

// redactErr hides the configured passwords in an error's text. A
// usageError stays one: the exit status is still 2.
func redactErr(err error, cfg config.Config) error {
	if err == nil {
		return nil
	}
	redacted := errors.New(config.Redact(err.Error(), cfg.DatabaseURL, cfg.RedisURL))
	if errors.As(err, new(usageError)) {
		return usageError{redacted}
	}
	return redacted
}

// redisZ is a sorted-set member scored by deadline in integer Unix ms,
// rounded up: exactly what a raw ZADD producer must write.
func redisZ(serial string, deadline time.Time) redis.Z {
	return redis.Z{Score: float64(queue.DeadlineMillis(deadline)), Member: serial}
}

// boolValueApart refuses "true" or "false" given apart from the boolean
// flag before it ("--json false"): the flag takes no separate value, so
// the word would be taken for an argument, a serial or a queue name.
func boolValueApart(fs *flag.FlagSet, before []string, arg string) error {
	if len(before) == 0 {
		return nil
	}
	if !strings.EqualFold(arg, "true") && !strings.EqualFold(arg, "false") {
		return nil
	}
	prev := before[len(before)-1]
	name := strings.TrimLeft(prev, "-")
	if !strings.HasPrefix(prev, "-") || strings.Contains(name, "=") {
		return nil
	}
	if f := fs.Lookup(name); f != nil {
		if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			return usagef("--%s is a boolean flag and takes no separate value: write --%s=%s", name, name, arg)
		}
	}
	return nil
}
