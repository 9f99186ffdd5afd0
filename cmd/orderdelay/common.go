package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // the PostgreSQL driver
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// parse parses a subcommand's flags plus every setting and returns the
// configuration and the remaining arguments. Any mistake is a usageError
// that names the setting.
func parse(name string, args []string, stderr io.Writer, getenv func(string) (string, bool), extra func(*flag.FlagSet)) (config.Config, []string, error) {
	fs := flag.NewFlagSet("orderdelay "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	if extra != nil {
		extra(fs)
	}
	load := config.Register(fs, getenv)
	// Allow flags after positional arguments (orderdelay enqueue A --after 1m).
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return config.Config{}, nil, err
			}
			return config.Config{}, nil, usageError{err}
		}
		args = fs.Args()
		if len(args) == 0 {
			break
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

// openDB opens (lazily; nothing is dialled yet) the database.
func openDB(cfg config.Config, maxConns int) (*sqlx.DB, error) {
	db, err := sqlx.Open("postgres", withApplicationName(cfg.DatabaseURL, replicaName()))
	if err != nil {
		return nil, fmt.Errorf("database: %s", config.Redact(err.Error(), cfg.DatabaseURL))
	}
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	return db, nil
}

// redactErr hides the configured passwords in an error's text.
func redactErr(err error, cfg config.Config) error {
	if err == nil {
		return nil
	}
	return errors.New(config.Redact(err.Error(), cfg.DatabaseURL, cfg.RedisURL))
}

func pingRedis(ctx context.Context, rdb redis.UniversalClient) error {
	return rdb.Ping(ctx).Err()
}

// redisZ is a sorted-set member scored by deadline in integer Unix ms,
// rounded up: exactly what a raw ZADD producer must write.
func redisZ(serial string, deadline time.Time) redis.Z {
	return redis.Z{Score: float64(queue.DeadlineMillis(deadline)), Member: serial}
}
