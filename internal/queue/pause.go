package queue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// PauseState says whether closing is paused. The flag ({Q}:paused) holds
// "since|reason", since in Unix ms; every claim script reads it.
type PauseState struct {
	Paused bool      `json:"paused"`
	Reason string    `json:"reason,omitempty"`
	Since  time.Time `json:"since,omitzero"`
}

// Pause sets the pause flag unless it is set: pausing again keeps the
// first pause's time and reason. A newline in reason becomes a space; no
// reason is "paused by an operator".
func (s *Store) Pause(ctx context.Context, since time.Time, reason string) error {
	if reason == "" {
		reason = "paused by an operator"
	}
	val := strconv.FormatInt(since.UnixMilli(), 10) + "|" + strings.ReplaceAll(reason, "\n", " ")
	if err := s.rdb.SetNX(ctx, s.keys.Paused, val, 0).Err(); err != nil {
		return fmt.Errorf("pause: %w", err)
	}
	return nil
}

// Resume clears the pause flag and wakes the scanners waiting on it.
func (s *Store) Resume(ctx context.Context) error {
	if err := s.rdb.Del(ctx, s.keys.Paused).Err(); err != nil {
		return fmt.Errorf("resume: %w", err)
	}
	// Any deadline wakes a paused scanner; 0 is earlier than all of them.
	if err := s.rdb.Publish(ctx, s.keys.Wake, 0).Err(); err != nil {
		return fmt.Errorf("resume: wake replicas: %w", err)
	}
	return nil
}

// PauseState reads the pause flag. A flag of another shape (set by hand)
// still pauses; all of it is the reason.
func (s *Store) PauseState(ctx context.Context) (PauseState, error) {
	v, err := s.rdb.Get(ctx, s.keys.Paused).Result()
	if errors.Is(err, redis.Nil) {
		return PauseState{}, nil
	}
	if err != nil {
		return PauseState{}, fmt.Errorf("pause state: %w", err)
	}
	st := PauseState{Paused: true, Reason: v}
	if at, reason, ok := strings.Cut(v, "|"); ok {
		if ms, err := strconv.ParseInt(at, 10, 64); err == nil {
			st.Since, st.Reason = time.UnixMilli(ms), reason
		}
	}
	return st, nil
}

// Paused reports whether the pause flag is set, whatever it holds (the
// claim script's test: EXISTS).
func (s *Store) Paused(ctx context.Context) (bool, error) {
	n, err := s.rdb.Exists(ctx, s.keys.Paused).Result()
	if err != nil {
		return false, fmt.Errorf("pause flag: %w", err)
	}
	return n == 1, nil
}
