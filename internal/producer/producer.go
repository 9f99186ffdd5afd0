// Package producer is the daemon's side of putting order timeouts on the
// queue: the HTTP API and the CLI both go through it. It turns a request
// ("30 minutes from now", "at this instant", create or reschedule) into a
// validated deadline, writes it with the public client package (one Lua
// script, O(log n) on the serial) and counts what it added.
package producer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/metrics"
)

// ErrBadRequest is wrapped by every error that is the caller's fault.
var ErrBadRequest = errors.New("bad request")

// Request asks for an order's timeout. Exactly one of After and At is set.
type Request struct {
	Serial     string
	After      time.Duration // deadline = now + After; must be positive
	At         time.Time     // an absolute deadline
	Reschedule bool          // move the deadline if the entry exists
	OnlyLater  bool          // move it only if the new deadline is later
}

// Deadline resolves the request's deadline against now and validates it.
func (r Request) Deadline(now time.Time) (time.Time, error) {
	switch {
	case r.After != 0 && !r.At.IsZero():
		return time.Time{}, fmt.Errorf("%w: give either after or at, not both", ErrBadRequest)
	case r.After < 0:
		return time.Time{}, fmt.Errorf("%w: after must be positive, got %s", ErrBadRequest, r.After)
	case r.After > 0:
		return now.Add(r.After), nil
	case !r.At.IsZero():
		return r.At, nil
	default:
		return time.Time{}, fmt.Errorf("%w: give after (a duration such as 30m) or at (an RFC 3339 time)", ErrBadRequest)
	}
}

// Mode is the client write mode the request asks for.
func (r Request) Mode() (client.Mode, error) {
	switch {
	case r.Reschedule && r.OnlyLater:
		return 0, fmt.Errorf("%w: reschedule and only_later exclude each other", ErrBadRequest)
	case r.Reschedule:
		return client.Reschedule, nil
	case r.OnlyLater:
		return client.OnlyLater, nil
	default:
		return client.Create, nil
	}
}

// Producer writes requests to one queue.
type Producer struct {
	c   *client.Client
	m   *metrics.Metrics
	now func() time.Time
	// Reminders, when set, gets a task per order due Before its deadline.
	reminders *client.Client
	before    time.Duration
}

// WithReminders makes every order put through p also put a reminder task
// on the task queue of rc, due before ahead of the order's deadline (when
// that is still in the future), and every cancel remove it.
func (p *Producer) WithReminders(rc *client.Client, before time.Duration) {
	p.reminders, p.before = rc, before
}

// New returns a Producer writing through c.
func New(c *client.Client, m *metrics.Metrics, now func() time.Time) *Producer {
	if now == nil {
		now = time.Now
	}
	return &Producer{c: c, m: m, now: now}
}

// Client returns the underlying client.
func (p *Producer) Client() *client.Client { return p.c }

// Put applies a request and reports what it did and the deadline in force.
func (p *Producer) Put(ctx context.Context, r Request) (client.Result, time.Time, error) {
	deadline, err := r.Deadline(p.now())
	if err != nil {
		return 0, time.Time{}, err
	}
	mode, err := r.Mode()
	if err != nil {
		return 0, time.Time{}, err
	}
	res, at, err := p.c.Enqueue(ctx, r.Serial, deadline, mode)
	if err != nil {
		if errors.Is(err, client.ErrInvalidSerial) || errors.Is(err, client.ErrInvalidDeadline) {
			return 0, time.Time{}, fmt.Errorf("%w: %w", ErrBadRequest, err)
		}
		return 0, time.Time{}, err
	}
	if res == client.Created && p.m != nil {
		p.m.Enqueued.Inc()
	}
	// Unchanged too: a caller retrying after a failed reminder write finds
	// the order entry already there, and the retry must still write the
	// reminder. Writing it again is idempotent (same due time, same
	// payload).
	if p.reminders != nil {
		if err := p.remind(ctx, r.Serial, at); err != nil {
			return res, at, err
		}
	}
	return res, at, nil
}

// remind puts (or moves) the reminder of an order due at deadline.
func (p *Producer) remind(ctx context.Context, serial string, deadline time.Time) error {
	due := deadline.Add(-p.before)
	if !due.After(p.now()) {
		_, err := p.reminders.DeleteTasks(ctx, serial) // too late to remind
		return err
	}
	payload, err := json.Marshal(map[string]any{"serial": serial, "deadline": deadline.UTC(), "deadline_ms": deadline.UnixMilli()})
	if err != nil {
		return err
	}
	if _, _, err := p.reminders.PutTask(ctx, serial, payload, due, client.Reschedule); err != nil {
		return fmt.Errorf("reminder: %w", err)
	}
	return nil
}

// Get returns the entry for serial.
func (p *Producer) Get(ctx context.Context, serial string) (client.Entry, error) {
	e, err := p.c.Get(ctx, serial)
	if errors.Is(err, client.ErrInvalidSerial) {
		return e, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	return e, err
}

// Cancel removes the entry for serial.
func (p *Producer) Cancel(ctx context.Context, serial string) error {
	err := p.c.Cancel(ctx, serial)
	if errors.Is(err, client.ErrInvalidSerial) {
		return fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	if p.reminders != nil && (err == nil || errors.Is(err, client.ErrNotFound)) {
		if _, rerr := p.reminders.DeleteTasks(ctx, serial); rerr != nil {
			return fmt.Errorf("reminder: %w", rerr)
		}
	}
	return err
}
