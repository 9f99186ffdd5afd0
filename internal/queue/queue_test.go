package queue_test

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/orderdelay/orderdelay/internal/queue"
)

func TestValidateSerial(t *testing.T) {
	tests := []struct {
		name   string
		serial string
		valid  bool
	}{
		{"empty", "", false},
		{"one byte", "a", true},
		{"typical", "ORD-2026-000123", true},
		{"128 bytes", strings.Repeat("a", 128), true},
		{"129 bytes", strings.Repeat("a", 129), false},
		{"128 bytes of multi-byte runes", strings.Repeat("é", 64), true},
		{"130 bytes of multi-byte runes", strings.Repeat("é", 65), false},
		{"invalid UTF-8", "ord\xff", false},
		{"truncated UTF-8 sequence", "ord\xc3", false},
		{"NUL", "ord\x00", false},
		{"tab", "ord\t1", false},
		{"newline", "ord\n1", false},
		{"unit separator", "ord\x1f", false},
		{"DEL", "ord\x7f", false},
		{"C1 U+0080", "ord\u0080", false},
		{"C1 U+009F", "ord\u009f", false},
		{"space is printable", "ord 1", true},
		{"emoji", "订单-🛒-1", true},
		{"emoji only", "🛒", true},
		{"SQL injection is printable", "1'; DROP TABLE orders; --", true},
		{"quotes and braces", `{"a":"b"}`, true},
		{"pipe", "a|b|c", true},
		{"lua pattern characters", "%d+.*[]^$", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := queue.ValidateSerial(tt.serial)
			if got := err == nil; got != tt.valid {
				t.Fatalf("ValidateSerial(%q) = %v, want valid=%v", tt.serial, err, tt.valid)
			}
			if err != nil && !errors.Is(err, queue.ErrInvalidSerial) {
				t.Errorf("ValidateSerial(%q) = %v, which does not wrap ErrInvalidSerial", tt.serial, err)
			}
		})
	}
}

// serialOracle is the rule of DESIGN.md written independently of
// ValidateSerial: UTF-8, 1–128 bytes, no control characters.
func serialOracle(s string) bool {
	if len(s) < 1 || len(s) > queue.MaxSerialLen || !utf8.ValidString(s) {
		return false
	}
	return !strings.ContainsFunc(s, unicode.IsControl)
}

func FuzzValidateSerial(f *testing.F) {
	for _, s := range []string{"", "a", "ORD-1", "ord\x00", "\xff", "🛒", strings.Repeat("x", 129), "1' OR '1'='1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		err := queue.ValidateSerial(s)
		if err != nil {
			if !errors.Is(err, queue.ErrInvalidSerial) {
				t.Fatalf("ValidateSerial(%q) = %v, which does not wrap ErrInvalidSerial", s, err)
			}
		} else {
			if len(s) < 1 || len(s) > queue.MaxSerialLen {
				t.Fatalf("ValidateSerial accepted %q of %d bytes, want 1..%d", s, len(s), queue.MaxSerialLen)
			}
			if !utf8.ValidString(s) {
				t.Fatalf("ValidateSerial accepted invalid UTF-8 %q", s)
			}
		}
		if got, want := err == nil, serialOracle(s); got != want {
			t.Fatalf("ValidateSerial(%q) valid = %v (err %v), want %v", s, got, err, want)
		}
	})
}

func TestDeadlineMillis(t *testing.T) {
	base := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		t    time.Time
		want int64
	}{
		{"whole millisecond stays", base.Add(5 * time.Millisecond), base.UnixMilli() + 5},
		{"one nanosecond past rounds up", base.Add(time.Nanosecond), base.UnixMilli() + 1},
		{"half a millisecond rounds up", base.Add(500 * time.Microsecond), base.UnixMilli() + 1},
		{"just below next ms rounds up", base.Add(time.Millisecond - time.Nanosecond), base.UnixMilli() + 1},
		{"zone does not matter", base.In(time.FixedZone("UTC+8", 8*3600)).Add(time.Nanosecond), base.UnixMilli() + 1},
		{"epoch", time.Unix(0, 0), 0},
		{"just before epoch rounds up to epoch", time.Unix(0, -1), 0},
		{"before epoch rounds towards later", time.Unix(0, -1_500_000), -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := queue.DeadlineMillis(tt.t); got != tt.want {
				t.Errorf("DeadlineMillis(%s) = %d, want %d", tt.t.Format(time.RFC3339Nano), got, tt.want)
			}
		})
	}
}

// TestDeadlineMillisNeverEarlier checks the rounding property over a spread
// of sub-millisecond offsets: the result is never before t and less than a
// millisecond after it.
func TestDeadlineMillisNeverEarlier(t *testing.T) {
	base := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for ns := int64(-3_000_000); ns <= 3_000_000; ns += 7919 { // a prime stride hits many offsets
		tm := base.Add(time.Duration(ns))
		ms := queue.DeadlineMillis(tm)
		got := time.UnixMilli(ms)
		if got.Before(tm) {
			t.Fatalf("DeadlineMillis(%s) = %s, which is earlier", tm.Format(time.RFC3339Nano), got.Format(time.RFC3339Nano))
		}
		if got.Sub(tm) >= time.Millisecond {
			t.Fatalf("DeadlineMillis(%s) = %s, %s later; want less than 1ms", tm.Format(time.RFC3339Nano), got.Format(time.RFC3339Nano), got.Sub(tm))
		}
	}
}

func TestValidateDeadline(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	maxMs := now.Add(queue.MaxAhead).UnixMilli()
	tests := []struct {
		name  string
		ms    int64
		valid bool
	}{
		{"now", now.UnixMilli(), true},
		{"in 30 minutes", now.Add(30 * time.Minute).UnixMilli(), true},
		{"in the past is fine (closes at once)", now.Add(-time.Hour).UnixMilli(), true},
		{"2000-01-01 exactly", queue.MinDeadline, true},
		{"one ms before 2000", queue.MinDeadline - 1, false},
		{"seconds instead of milliseconds", now.Add(30 * time.Minute).Unix(), false},
		{"zero", 0, false},
		{"negative", -1, false},
		{"exactly 10 years ahead", maxMs, true},
		{"10 years and 1 ms ahead", maxMs + 1, false},
		{"11 years ahead", now.Add(11 * 365 * 24 * time.Hour).UnixMilli(), false},
		{"microseconds instead of milliseconds", now.UnixMicro(), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := queue.ValidateDeadline(tt.ms, now)
			if got := err == nil; got != tt.valid {
				t.Fatalf("ValidateDeadline(%d) = %v, want valid=%v", tt.ms, err, tt.valid)
			}
			if err != nil && !errors.Is(err, queue.ErrInvalidDeadline) {
				t.Errorf("ValidateDeadline(%d) = %v, which does not wrap ErrInvalidDeadline", tt.ms, err)
			}
		})
	}
	if got := time.UnixMilli(queue.MinDeadline).UTC(); !got.Equal(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("MinDeadline is %s, want 2000-01-01T00:00:00Z", got.Format(time.RFC3339))
	}
}

func TestValidateKey(t *testing.T) {
	tests := []struct {
		name  string
		key   string
		valid bool
	}{
		{"default", queue.DefaultKey, true},
		{"punctuation", "shop-1:delay.task/order_v2", true},
		{"unicode letters", "订单:超时", true},
		{"200 bytes", strings.Repeat("k", 200), true},
		{"201 bytes", strings.Repeat("k", 201), false},
		{"empty", "", false},
		{"open brace", "{delaytask:order", false},
		{"close brace", "delaytask}:order", false},
		{"hash tag", "{delaytask}:order", false},
		{"space", "delaytask order", false},
		{"tab", "delaytask\torder", false},
		{"newline", "delaytask\norder", false},
		{"NUL", "delaytask\x00", false},
		{"DEL", "delaytask\x7f", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := queue.ValidateKey(tt.key)
			if got := err == nil; got != tt.valid {
				t.Errorf("ValidateKey(%q) = %v, want valid=%v", tt.key, err, tt.valid)
			}
		})
	}
}

// hashTag returns the part of key Redis Cluster hashes: the content of the
// first {...} if non-empty, else the whole key (cluster spec, "Hash tags").
func hashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key
	}
	close := strings.IndexByte(key[open+1:], '}')
	if close <= 0 {
		return key
	}
	return key[open+1 : open+1+close]
}

// keySlot is Redis Cluster's HASH_SLOT: CRC16-XMODEM of the hash tag mod 16384.
func keySlot(key string) uint16 {
	var crc uint16
	for _, b := range []byte(hashTag(key)) {
		crc ^= uint16(b) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc % 16384
}

func TestKeySlotMatchesRedisExamples(t *testing.T) {
	// Values from the Redis Cluster specification and CLUSTER KEYSLOT.
	tests := []struct {
		key  string
		want uint16
	}{
		{"123456789", 0x31C3 % 16384}, // the CRC16-XMODEM check value
		{"foo", 12182},
		{"{user1000}.following", keySlot("user1000")},
	}
	for _, tt := range tests {
		if got := keySlot(tt.key); got != tt.want {
			t.Errorf("keySlot(%q) = %d, want %d", tt.key, got, tt.want)
		}
	}
}

func TestNewKeys(t *testing.T) {
	for _, key := range []string{queue.DefaultKey, "shop-7:orders", "订单", "a"} {
		t.Run(key, func(t *testing.T) {
			k := queue.NewKeys(key)
			if k.Queue != key {
				t.Errorf("Queue = %q, want %q", k.Queue, key)
			}
			companions := map[string]string{
				"Inflight": k.Inflight, "Deadlines": k.Deadlines, "Lease": k.Lease,
				"Dead": k.Dead, "DeadInfo": k.DeadInfo, "Wake": k.Wake,
			}
			seen := map[string]string{k.Queue: "Queue"}
			for field, name := range companions {
				if !strings.HasPrefix(name, "{"+key+"}:") {
					t.Errorf("%s = %q, want prefix %q", field, name, "{"+key+"}:")
				}
				if got := hashTag(name); got != key {
					t.Errorf("%s = %q hashes %q, want %q", field, name, got, key)
				}
				if got, want := keySlot(name), keySlot(k.Queue); got != want {
					t.Errorf("%s = %q is in slot %d, want the queue's slot %d", field, name, got, want)
				}
				if other, dup := seen[name]; dup {
					t.Errorf("%s and %s are both %q", field, other, name)
				}
				seen[name] = field
			}
		})
	}
	if got, want := queue.NewKeys(queue.DefaultKey).Dead, "{delaytask:order}:dead"; got != want {
		t.Errorf("NewKeys(DefaultKey).Dead = %q, want %q (DESIGN.md's example)", got, want)
	}
}

func TestValidQueueName(t *testing.T) {
	for _, ok := range []string{"a", "callrecord", "confirm-receipt", "jobs_2", strings.Repeat("q", 64)} {
		if !queue.ValidQueueName(ok) {
			t.Errorf("ValidQueueName(%q) = false, want true", ok)
		}
	}
	for _, bad := range []string{"", "Jobs", "jobs.v2", "jobs/x", "jobs x", "jobs\n", "é", "{jobs}", strings.Repeat("q", 65)} {
		if queue.ValidQueueName(bad) {
			t.Errorf("ValidQueueName(%q) = true, want false", bad)
		}
	}
}
