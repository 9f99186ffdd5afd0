package queue

import (
	"context"
	"encoding/json"
	"errors"
	"time"
)

// The claim of a poll queue (POST /v1/queues/{q}/poll, the Go worker
// library): due tasks leased under a token of the poll's own, read with
// their payloads, and those over their attempts dead-lettered instead of
// handed out.

// Task is a claimed task of a named queue: what a poll answers and what a
// task action runs on.
type Task struct {
	ID       string          `json:"id"`
	Deadline time.Time       `json:"deadline"`
	Attempts int             `json:"attempts"` // failed attempts so far
	Payload  json.RawMessage `json:"payload"`
}

// TaskOverheadBytes bounds the JSON encoding of a Task (with HTML
// escaping off) beyond its payload and twice its id: the field names, a
// deadline of at most 37 bytes quoted, an attempt count of at most 20, and
// the comma and newline between tasks of a poll's answer; 103 bytes in all,
// rounded up.
const TaskOverheadBytes = 128

// maxPollClaims bounds the claims of one poll that take only tasks over
// their attempts (each such claim dead-letters what it took).
const maxPollClaims = 8

// pollBookkeepingTimeout bounds a poll's reads and writes after its claim
// ran (the payloads, the dead-lettering): they run even when the poll's
// context has ended meanwhile, as what the claim leased must be answered
// or buried.
const pollBookkeepingTimeout = 5 * time.Second

// PollArgs are a poll's parameters (PollTasks).
type PollArgs struct {
	Limit int // most tasks to hand out
	// MaxBytes > 0 bounds the tasks' encoded size: each costs its
	// payload, twice its id and TaskOverheadBytes. Tasks past it are left
	// due and untouched, but the first is taken whatever its size.
	MaxBytes    int
	Lease       time.Duration // how long the poll holds its tasks; must be positive
	MaxAttempts int           // a task with this many attempts is dead-lettered, not handed out
}

// Polled is what a poll did.
type Polled struct {
	Tasks []Task
	// Token acknowledges, extends, retries or buries Tasks (AckTasks and
	// the other task lease operations); "" with no tasks.
	Token  string
	Claims []PollClaim // every claim the poll ran, in order
}

// PollClaim is one claim of a poll: what it leased and what became of the
// tasks over their attempts among them.
type PollClaim struct {
	ClaimResult
	// Over is how many of Items were over their attempts and were
	// dead-lettered as ReasonFailed; Buried how many of those the bury
	// moved, or BuryErr why it failed (they return when their lease
	// expires).
	Over, Buried int
	BuryErr      error
}

// ErrPollLease is returned by PollTasks for a lease that is not positive.
var ErrPollLease = errors.New("poll: lease must be positive")

// PollTasks leases up to a.Limit due tasks under a token of this call's
// own (NewPollToken), counting a redelivery after an expired lease as an
// attempt, and reads their payloads. Tasks at or over a.MaxAttempts are
// dead-lettered as ReasonFailed instead of returned; when a claim took
// only such tasks it claims again, at most maxPollClaims times, so a poll
// does not come back empty while tasks are due.
//
// Polled.Claims reports every claim that ran, also when an error ends the
// poll: the claims before it happened. On a failure to read the payloads
// the tasks stay leased under Polled.Token until their lease expires.
func (s *Store) PollTasks(ctx context.Context, a PollArgs) (Polled, error) {
	var p Polled
	if a.Lease <= 0 {
		return p, ErrPollLease
	}
	tok := NewPollToken()
	for range maxPollClaims {
		res, err := s.Claim(ctx, ClaimArgs{Limit: a.Limit, Lease: a.Lease, Token: tok, CountRedeliveries: true,
			MaxBytes: a.MaxBytes, Overhead: TaskOverheadBytes})
		if err != nil {
			return p, err
		}
		p.Claims = append(p.Claims, PollClaim{ClaimResult: res})
		cl := &p.Claims[len(p.Claims)-1]
		if len(res.Items) == 0 {
			return p, nil
		}
		var give []Leased
		var over []string
		for _, it := range res.Items {
			if it.Attempts >= a.MaxAttempts {
				over = append(over, it.Serial)
			} else {
				give = append(give, it)
			}
		}
		if len(over) > 0 {
			cl.Over = len(over)
			cl.Buried, cl.BuryErr = s.buryPolled(ctx, tok, over)
		}
		if len(give) > 0 {
			p.Token = tok
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pollBookkeepingTimeout)
			p.Tasks, err = s.ReadTasks(rctx, give)
			cancel()
			return p, err
		}
		// All it took was over its attempts: claim again.
	}
	return p, nil
}

// buryPolled dead-letters tasks a poll's claim took over their attempts.
// The claim counted the expired lease as an attempt already.
func (s *Store) buryPolled(ctx context.Context, tok string, ids []string) (int, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pollBookkeepingTimeout)
	defer cancel()
	return s.Bury(ctx, BuryArgs{Token: tok, Serials: ids, Reason: ReasonFailed,
		LastError: "not acknowledged within its lease, max attempts reached"})
}

// ReadTasks reads the payloads of leased tasks in one command and returns
// them as Tasks; a task without a payload has the payload null.
func (s *Store) ReadTasks(ctx context.Context, items []Leased) ([]Task, error) {
	ids := make([]string, len(items))
	for i, it := range items {
		ids[i] = it.Serial
	}
	payloads, has, err := s.Payloads(ctx, ids)
	if err != nil {
		return nil, err
	}
	tasks := make([]Task, len(items))
	for i, it := range items {
		tasks[i] = Task{ID: it.Serial, Deadline: time.UnixMilli(it.Deadline), Attempts: it.Attempts, Payload: json.RawMessage("null")}
		if has[i] {
			tasks[i].Payload = json.RawMessage(payloads[i])
		}
	}
	return tasks, nil
}
