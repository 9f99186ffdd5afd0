// Package tasks brings orderdelay's core to every "do this later" in a
// shop: named delay queues declared in a file, tasks with JSON payloads kept
// beside their sorted-set entry, and per-queue actions (a SQL statement, a
// Redis Stream, a list, a webhook, or polling by consumers) with retry
// policies. Task queues reuse the order queue's claim, lease,
// compare-and-set removal and dead-letter machinery; the order queue's path
// and settings are untouched.
package tasks

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Actions a queue can take on due tasks.
const (
	ActionSQL     = "sql"     // a set-based statement: $1 text[] ids -> ids done
	ActionStream  = "stream"  // XADD into {key}:stream, acknowledged delivery via consumer groups
	ActionList    = "list"    // LPUSH into {key}:ready (at-most-once; reliable variant with reliable: true)
	ActionWebhook = "webhook" // HTTP POST with idempotency key and HMAC signature
	ActionPoll    = "poll"    // consumers poll due tasks under a lease and ack them
)

// Duration is a time.Duration written as "30s" in the file. A written
// duration is positive: the zero value means "not written" (the default
// applies), so an explicit 0 is refused rather than silently replaced.
type Duration time.Duration

// UnmarshalYAML implements yaml.Unmarshaler.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if err != nil || v <= 0 {
		return fmt.Errorf("line %d: want a positive duration such as 30s or 5m (leave the field out for its default), got %q", n.Line, n.Value)
	}
	*d = Duration(v)
	return nil
}

// File is the configuration file (configs/orderdelay.yaml).
type File struct {
	Queues []Queue `yaml:"queues"`
}

// Queue declares one named queue.
type Queue struct {
	Name      string   `yaml:"name"`       // [a-z0-9_-], used in the API path and metric labels
	Key       string   `yaml:"key"`        // Redis key; default "delaytask:<name>"
	Lease     Duration `yaml:"lease"`      // default 60s
	BatchSize int      `yaml:"batch_size"` // default 100
	Workers   int      `yaml:"workers"`    // default 4 (sql, webhook)
	Action    Action   `yaml:"action"`
	Retry     Retry    `yaml:"retry"`
	// Durable keeps every task in PostgreSQL (orderdelay_tasks, with a log)
	// and only those due within Window in Redis (sql and webhook actions).
	Durable bool     `yaml:"durable"`
	Window  Duration `yaml:"window"` // default 5m
	// MaxPending caps the queue's pending tasks (queued plus leased or
	// backing off, in Redis): a new task beyond it is refused. Default
	// DefaultMaxPending; a written value must be 1 to MaxPendingLimit.
	MaxPending PendingCap `yaml:"max_pending"`
	// DeadRetention and DeadMax override, for this queue,
	// ORDERDELAY_DEAD_LETTER_RETENTION and ORDERDELAY_DEAD_LETTER_MAX:
	// dead letters older than DeadRetention, and the oldest beyond the
	// newest DeadMax, are purged with their payloads. Zero (left out):
	// the global setting applies. See Queue.Retention.
	DeadRetention Duration `yaml:"dead_retention"`
	DeadMax       int      `yaml:"dead_max"`
}

// Defaults of a queue's fields left out of the file. Those a task queue
// shares with the order queue are the consumer's (internal/consumer), so
// each number is written once.
const (
	DefaultLease           = consumer.DefaultLease
	DefaultWorkers         = consumer.DefaultWorkers
	DefaultBatchSize       = 100
	DefaultWindow          = 5 * time.Minute // durable queues: how far ahead Redis holds tasks
	DefaultWebhookTimeout  = 10 * time.Second
	DefaultAckTimeout      = consumer.DefaultAckTimeout
	DefaultStreamMaxLen    = DefaultListMaxLen
	DefaultMaxAttempts     = consumer.DefaultMaxAttempts
	DefaultRetryInitial    = consumer.DefaultRetryBase
	DefaultRetryMax        = consumer.DefaultBackoffMax
	DefaultRetryMultiplier = 2.0
)

// DefaultMaxPending is a queue's cap on pending tasks when the file sets
// none: generous (about 1 GB of Redis at 1 KiB payloads), there to stop a
// runaway producer, not to shape traffic.
const DefaultMaxPending = 1_000_000

// MaxPendingLimit is the largest max_pending accepted.
const MaxPendingLimit = 1_000_000_000

// PendingCap is max_pending as written in the file: a whole number from 1
// to MaxPendingLimit. The zero value means "not written" (the default
// applies), so an explicit 0 is refused rather than silently replaced.
type PendingCap int64

// UnmarshalYAML implements yaml.Unmarshaler.
func (c *PendingCap) UnmarshalYAML(n *yaml.Node) error {
	v, err := strconv.ParseInt(n.Value, 10, 64)
	if n.Kind != yaml.ScalarNode || err != nil || v < 1 || v > MaxPendingLimit {
		return fmt.Errorf("line %d: max_pending: want a whole number from 1 to %d (leave the field out for the default %d), got %q",
			n.Line, MaxPendingLimit, DefaultMaxPending, n.Value)
	}
	*c = PendingCap(v)
	return nil
}

// MaxDeadMax bounds dead_max, as ORDERDELAY_DEAD_LETTER_MAX is bounded.
const MaxDeadMax = 100_000_000

// Retention is the queue's dead-letter retention: its own dead_retention
// and dead_max where the file sets them, else the global age and cap (0:
// none, as for the order queue).
func (q Queue) Retention(globalAge time.Duration, globalMax int) (time.Duration, int) {
	age, keep := globalAge, globalMax
	if q.DeadRetention > 0 {
		age = time.Duration(q.DeadRetention)
	}
	if q.DeadMax > 0 {
		keep = q.DeadMax
	}
	return age, keep
}

// Action says what happens to a due task.
type Action struct {
	Type string `yaml:"type"`
	// sql
	Statement string `yaml:"statement"`
	// stream: approximate cap of the stream (XADD MAXLEN ~; entries past it
	// are trimmed). list: most items the ready list holds; while it holds
	// that many, due tasks wait in the queue (nothing trimmed). Default
	// 100000 for both.
	MaxLen int64 `yaml:"max_len"`
	// list
	Reliable bool `yaml:"reliable"` // consumers take with LMOVE and ack; unacked items return
	// AckTimeout (stream and reliable list, default 5m) is how long a
	// delivery may stay unacknowledged before it counts as failed: a
	// reliable-list item taken this long ago goes back to the ready list,
	// and a stream entry pending this long after its max_attempts-th
	// delivery is dead-lettered.
	AckTimeout Duration `yaml:"ack_timeout"`
	// webhook
	URL       string   `yaml:"url"`
	Timeout   Duration `yaml:"timeout"`    // default 10s
	SecretEnv string   `yaml:"secret_env"` // environment variable holding the HMAC secret (at least MinSecretBytes)
	// PreviousSecretEnv, set during a rotation, names the variable holding
	// the secret being replaced: each request then carries a signature by
	// each secret, so receivers that know either accept it. Empty: none.
	// It may be shorter than MinSecretBytes, so a short secret can be
	// rotated out without refusing requests.
	PreviousSecretEnv string `yaml:"previous_secret_env"`
	secret            []byte // SecretEnv's value, read once by check
	previousSecret    []byte // PreviousSecretEnv's value; nil when unset
}

// DefaultListMaxLen is a list action's max_len when the file leaves it
// out: the ready list holds at most this many items.
const DefaultListMaxLen = 100_000

// MinSecretBytes is the shortest webhook secret accepted: 256 bits, the
// size of the HMAC-SHA256 key that signs each request.
const MinSecretBytes = 32

// Retry is a queue's retry policy: an explicit list of delays, or
// exponential growth from Initial by Multiplier capped at Max, with jitter.
// After MaxAttempts failed attempts a task is "failed" and dead-lettered.
type Retry struct {
	Backoff     []Duration `yaml:"backoff"`
	Initial     Duration   `yaml:"initial"`    // default 1s
	Max         Duration   `yaml:"max"`        // default 5m
	Multiplier  float64    `yaml:"multiplier"` // default 2
	Jitter      *bool      `yaml:"jitter"`     // default true
	MaxAttempts int        `yaml:"max_attempts"`
}

// Delay is the wait before retry number attempts+1 (attempts already
// failed, counting from 1). rnd returns a float in [0,1) for jitter.
func (r Retry) Delay(attempts int, rnd func() float64) time.Duration {
	if len(r.Backoff) > 0 {
		return time.Duration(r.Backoff[min(max(attempts-1, 0), len(r.Backoff)-1)])
	}
	d := float64(r.Initial)
	for i := 1; i < attempts && d < float64(r.Max); i++ {
		d *= r.Multiplier
	}
	d = min(d, float64(r.Max))
	if r.Jitter == nil || *r.Jitter {
		d = d/2 + d/2*rnd()
	}
	return time.Duration(d)
}

// Load reads and validates the configuration file at path. An empty path
// means no file: no task queues.
func Load(path string) (File, error) {
	if path == "" {
		return File{}, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return File{}, err
	}
	return Parse(b)
}

// Parse decodes and validates a configuration file's contents. Unknown
// fields are errors, so a typo never silently falls back to a default.
func Parse(b []byte) (File, error) {
	var f File
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		return File{}, fmt.Errorf("queues file: %w", err)
	}
	if err := f.setDefaults(); err != nil {
		return File{}, fmt.Errorf("queues file: %w", err)
	}
	return f, nil
}

func (f *File) setDefaults() error {
	names, keys := map[string]bool{}, map[string]bool{}
	for i := range f.Queues {
		q := &f.Queues[i]
		where := fmt.Sprintf("queue %d (%q)", i+1, q.Name)
		if !queue.ValidQueueName(q.Name) {
			return fmt.Errorf("%s: name must be 1-64 of a-z, 0-9, _ and -", where)
		}
		if names[q.Name] {
			return fmt.Errorf("%s: name used twice", where)
		}
		names[q.Name] = true
		if q.Key == "" {
			q.Key = client.TaskQueueKey(q.Name)
		}
		if err := queue.ValidateKey(q.Key); err != nil {
			return fmt.Errorf("%s: key: %w", where, err)
		}
		if keys[q.Key] || q.Key == queue.DefaultKey {
			return fmt.Errorf("%s: key %q is already used (by another queue or the order queue)", where, q.Key)
		}
		keys[q.Key] = true
		if q.Lease == 0 {
			q.Lease = Duration(DefaultLease)
		}
		if q.Lease < Duration(time.Second) {
			return fmt.Errorf("%s: lease must be at least 1s", where)
		}
		if q.BatchSize == 0 {
			q.BatchSize = DefaultBatchSize
		}
		if q.Workers == 0 {
			q.Workers = DefaultWorkers
		}
		if q.BatchSize < 1 || q.BatchSize > 5000 || q.Workers < 1 || q.Workers > 256 {
			return fmt.Errorf("%s: batch_size must be 1-5000 and workers 1-256", where)
		}
		if err := q.Action.check(where, q.Lease); err != nil {
			return err
		}
		if err := q.Retry.checkRedelivery(where, q.Action); err != nil {
			return err
		}
		if err := q.Retry.check(where); err != nil {
			return err
		}
		if q.Window == 0 {
			q.Window = Duration(DefaultWindow)
		}
		if q.MaxPending == 0 {
			q.MaxPending = DefaultMaxPending
		}
		if q.Durable && q.Action.Type != ActionSQL && q.Action.Type != ActionWebhook {
			return fmt.Errorf("%s: durable queues take the sql or webhook action (their executor records the outcome)", where)
		}
		if q.Window < Duration(time.Second) {
			return fmt.Errorf("%s: window must be at least 1s", where)
		}
		if q.DeadMax < 0 || q.DeadMax > MaxDeadMax {
			return fmt.Errorf("%s: dead_max must be 1-%d (leave it out for ORDERDELAY_DEAD_LETTER_MAX)", where, MaxDeadMax)
		}
		if q.DeadRetention > Duration(queue.MaxAhead) {
			return fmt.Errorf("%s: dead_retention must be at most 10 years (87600h)", where)
		}
	}
	return nil
}

func (a *Action) check(where string, lease Duration) error {
	types := []string{ActionSQL, ActionStream, ActionList, ActionWebhook, ActionPoll}
	if !slices.Contains(types, a.Type) {
		return fmt.Errorf("%s: action.type must be one of %s, got %q", where, strings.Join(types, ", "), a.Type)
	}
	switch a.Type {
	case ActionSQL:
		if strings.TrimSpace(a.Statement) == "" {
			return fmt.Errorf("%s: a sql action needs statement ($1 text[] ids -> the ids it handled)", where)
		}
	case ActionStream:
		if a.MaxLen == 0 {
			a.MaxLen = DefaultStreamMaxLen
		}
		if a.MaxLen < 0 {
			return fmt.Errorf("%s: action.max_len must be positive", where)
		}
	case ActionList:
		if a.MaxLen == 0 {
			a.MaxLen = DefaultListMaxLen
		}
		if a.MaxLen < 0 {
			return fmt.Errorf("%s: action.max_len must be positive", where)
		}
		if !a.Reliable && a.AckTimeout != 0 {
			return fmt.Errorf("%s: ack_timeout needs reliable: true (a plain list is delivered once, never acknowledged)", where)
		}
	case ActionWebhook:
		// The error never quotes the URL: its path or query may hold a token.
		if _, err := newEndpoint(a.URL); err != nil {
			return fmt.Errorf("%s: a webhook action's %w", where, err)
		}
		if a.Timeout == 0 {
			a.Timeout = Duration(DefaultWebhookTimeout)
		}
		if a.Timeout >= lease {
			return fmt.Errorf("%s: action.timeout must be below the lease", where)
		}
		if a.SecretEnv == "" || os.Getenv(a.SecretEnv) == "" {
			return fmt.Errorf("%s: a webhook action needs secret_env naming a set environment variable with the HMAC secret", where)
		}
		a.secret = []byte(os.Getenv(a.SecretEnv))
		if err := checkSecretSpace(where, "secret_env", a.SecretEnv, a.secret); err != nil {
			return err
		}
		if len(a.secret) < MinSecretBytes {
			return fmt.Errorf("%s: action.secret_env: %s holds %d bytes; a webhook secret needs at least %d (e.g. openssl rand -hex 32)",
				where, a.SecretEnv, len(a.secret), MinSecretBytes)
		}
		if a.PreviousSecretEnv != "" {
			a.previousSecret = []byte(os.Getenv(a.PreviousSecretEnv))
			if len(a.previousSecret) == 0 {
				return fmt.Errorf("%s: action.previous_secret_env: %s is unset or empty; name the variable holding the secret being replaced, or leave the setting out", where, a.PreviousSecretEnv)
			}
			if err := checkSecretSpace(where, "previous_secret_env", a.PreviousSecretEnv, a.previousSecret); err != nil {
				return err
			}
			if string(a.previousSecret) == string(a.secret) {
				return fmt.Errorf("%s: action.previous_secret_env: %s holds the same secret as %s; a rotation needs the new secret in secret_env", where, a.PreviousSecretEnv, a.SecretEnv)
			}
		}
	}
	if a.MaxLen != 0 && a.Type != ActionStream && a.Type != ActionList {
		return fmt.Errorf("%s: max_len applies to stream and list actions only", where)
	}
	switch {
	case a.Type == ActionStream || a.Type == ActionList && a.Reliable:
		if a.AckTimeout == 0 {
			a.AckTimeout = Duration(DefaultAckTimeout)
		}
	case a.AckTimeout != 0 && a.Type != ActionList:
		return fmt.Errorf("%s: ack_timeout applies to stream and reliable list actions only", where)
	}
	return nil
}

// checkRedelivery refuses retry settings a stream or list action cannot
// keep. Consumers acknowledge those deliveries themselves, so a failed
// delivery is redelivered after the action's ack_timeout, not after a
// backoff: of the retry policy only max_attempts applies, and only where
// there are acknowledgements (a stream or a reliable list). It runs before
// the defaults are filled in, so it sees what the file says.
func (r Retry) checkRedelivery(where string, a Action) error {
	if a.Type != ActionStream && a.Type != ActionList {
		return nil
	}
	if a.Type == ActionList && !a.Reliable {
		if r.MaxAttempts != 0 || len(r.Backoff) > 0 || r.Initial != 0 || r.Max != 0 || r.Multiplier != 0 || r.Jitter != nil {
			return fmt.Errorf("%s: retry needs reliable: true (a plain list is delivered once and never retried)", where)
		}
		return nil
	}
	if len(r.Backoff) > 0 || r.Initial != 0 || r.Max != 0 || r.Multiplier != 0 || r.Jitter != nil {
		return fmt.Errorf("%s: a %s action redelivers after action.ack_timeout; of retry only max_attempts applies", where, a.Type)
	}
	return nil
}

func (r *Retry) check(where string) error {
	if r.Initial == 0 {
		r.Initial = Duration(DefaultRetryInitial)
	}
	if r.Max == 0 {
		r.Max = Duration(DefaultRetryMax)
	}
	if r.Multiplier == 0 {
		r.Multiplier = DefaultRetryMultiplier
	}
	if r.MaxAttempts == 0 {
		r.MaxAttempts = max(DefaultMaxAttempts, len(r.Backoff)+1)
	}
	if r.Multiplier < 1 || r.MaxAttempts < 1 || r.Max < r.Initial {
		return fmt.Errorf("%s: retry needs multiplier >= 1, max_attempts >= 1 and max >= initial", where)
	}
	return nil
}
