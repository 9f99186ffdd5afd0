package tasks

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParseRefusesBadFiles(t *testing.T) {
	t.Setenv("OD_SECRET", "0123456789abcdef0123456789abcdef")
	cases := []struct{ name, yaml, want string }{
		{"unknown field", "queues:\n  - name: a\n    actoin: {type: poll}\n", "actoin"},
		{"bad name", "queues:\n  - name: A B\n    action: {type: poll}\n", "name must be"},
		{"duplicate name", "queues:\n  - {name: a, action: {type: poll}}\n  - {name: a, action: {type: poll}}\n", "used twice"},
		{"order key", "queues:\n  - {name: a, key: 'delaytask:order', action: {type: poll}}\n", "already used"},
		{"brace key", "queues:\n  - {name: a, key: '{x}', action: {type: poll}}\n", "key"},
		{"unknown action", "queues:\n  - {name: a, action: {type: fax}}\n", "action.type"},
		{"sql without statement", "queues:\n  - {name: a, action: {type: sql}}\n", "statement"},
		{"webhook without url", "queues:\n  - {name: a, action: {type: webhook, secret_env: OD_SECRET}}\n", "url"},
		{"webhook without secret", "queues:\n  - {name: a, action: {type: webhook, url: 'http://x'}}\n", "secret_env"},
		{"webhook secret unset", "queues:\n  - {name: a, action: {type: webhook, url: 'http://x', secret_env: OD_UNSET_VAR}}\n", "secret_env"},
		{"timeout over lease", "queues:\n  - {name: a, lease: 5s, action: {type: webhook, url: 'http://x', timeout: 5s, secret_env: OD_SECRET}}\n", "below the lease"},
		{"bad duration", "queues:\n  - {name: a, lease: soon, action: {type: poll}}\n", "duration"},
		// An explicit 0 is refused, never silently the default.
		{"zero lease", "queues:\n  - {name: a, lease: 0s, action: {type: poll}}\n", "line 2"},
		{"zero window", "queues:\n  - {name: a, window: 0s, durable: true, action: {type: sql, statement: x}}\n", "line 2"},
		{"zero ack timeout", "queues:\n  - {name: a, action: {type: list, reliable: true, ack_timeout: 0s}}\n", "line 2"},
		{"zero webhook timeout", "queues:\n  - {name: a, action: {type: webhook, url: 'http://x', timeout: 0s, secret_env: OD_SECRET}}\n", "line 2"},
		{"zero retry initial", "queues:\n  - {name: a, action: {type: poll}, retry: {initial: 0s}}\n", "line 2"},
		{"zero retry max", "queues:\n  - {name: a, action: {type: poll}, retry: {max: 0s}}\n", "line 2"},
		{"short lease", "queues:\n  - {name: a, lease: 10ms, action: {type: poll}}\n", "lease"},
		{"batch too big", "queues:\n  - {name: a, batch_size: 9999, action: {type: poll}}\n", "batch_size"},
		{"bad retry", "queues:\n  - {name: a, action: {type: poll}, retry: {initial: 1m, max: 1s}}\n", "retry"},
		{"not yaml", "queues: [\n", "queues file"},
		// Stream and list deliveries are redelivered after ack_timeout, not
		// after a backoff; a plain list is never redelivered.
		{"backoff on a stream", "queues:\n  - {name: a, action: {type: stream}, retry: {backoff: [1s]}}\n", "only max_attempts applies"},
		{"initial on a reliable list", "queues:\n  - {name: a, action: {type: list, reliable: true}, retry: {initial: 1s}}\n", "only max_attempts applies"},
		{"retry on a plain list", "queues:\n  - {name: a, action: {type: list}, retry: {max_attempts: 3}}\n", "reliable: true"},
		{"ack timeout on a plain list", "queues:\n  - {name: a, action: {type: list, ack_timeout: 1m}}\n", "reliable: true"},
		{"ack timeout on poll", "queues:\n  - {name: a, action: {type: poll, ack_timeout: 1m}}\n", "ack_timeout applies"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.yaml))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Parse: %v, want an error mentioning %q", err, c.want)
			}
		})
	}
}

func TestParseDefaults(t *testing.T) {
	t.Parallel()
	f, err := Parse([]byte("queues:\n  - name: confirm\n    action: {type: stream}\n"))
	if err != nil {
		t.Fatal(err)
	}
	q := f.Queues[0]
	if q.Key != "delaytask:confirm" || q.Lease != Duration(time.Minute) || q.BatchSize != 100 || q.Workers != 4 ||
		q.Action.MaxLen != 100000 || q.Retry.MaxAttempts != 10 {
		t.Fatalf("defaults: %+v", q)
	}
	if q.Action.AckTimeout != Duration(5*time.Minute) {
		t.Errorf("stream ack_timeout %s, want the default 5m", time.Duration(q.Action.AckTimeout))
	}
	f, err = Parse([]byte("queues:\n  - {name: r, action: {type: list, reliable: true, ack_timeout: 1h}, retry: {max_attempts: 3}}\n"))
	if err != nil || f.Queues[0].Action.AckTimeout != Duration(time.Hour) || f.Queues[0].Retry.MaxAttempts != 3 {
		t.Fatalf("reliable list: %v, %+v", err, f.Queues)
	}
	if f, err := Parse(nil); err != nil || len(f.Queues) != 0 {
		t.Fatalf("empty file: %v, %d queues", err, len(f.Queues))
	}
	if f, err := Load(""); err != nil || len(f.Queues) != 0 {
		t.Fatalf("no file: %v, %d queues", err, len(f.Queues))
	}
}

func TestShippedExampleFileParses(t *testing.T) {
	t.Setenv("CALLRECORD_WEBHOOK_SECRET", "0123456789abcdef0123456789abcdef")
	if _, err := Load(filepath.Join("..", "..", "configs", "orderdelay.yaml")); err != nil {
		t.Fatal(err)
	}
}

func TestRetryDelay(t *testing.T) {
	t.Parallel()
	no := false
	r := Retry{Initial: Duration(time.Second), Max: Duration(10 * time.Second), Multiplier: 2, Jitter: &no}
	for a, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 50: 10 * time.Second} {
		if got := r.Delay(a, nil); got != want {
			t.Errorf("exponential Delay(%d) = %s, want %s", a, got, want)
		}
	}
	list := Retry{Backoff: []Duration{Duration(time.Minute), Duration(2 * time.Minute), Duration(4 * time.Minute)}}
	for a, want := range map[int]time.Duration{1: time.Minute, 2: 2 * time.Minute, 3: 4 * time.Minute, 9: 4 * time.Minute} {
		if got := list.Delay(a, nil); got != want {
			t.Errorf("list Delay(%d) = %s, want %s", a, got, want)
		}
	}
	jit := Retry{Initial: Duration(time.Second), Max: Duration(time.Minute), Multiplier: 2}
	if lo, hi := jit.Delay(3, func() float64 { return 0 }), jit.Delay(3, func() float64 { return 0.999 }); lo != 2*time.Second || hi < 3900*time.Millisecond || hi > 4*time.Second {
		t.Errorf("jittered Delay(3) spans %s..%s, want 2s..4s", lo, hi)
	}
}

// A webhook URL is refused without quoting it: its query may hold a token.
func TestParseRefusesBadWebhookURLWithoutQuotingIt(t *testing.T) {
	t.Setenv("OD_SECRET", "0123456789abcdef0123456789abcdef")
	for _, u := range []string{"/hook?token=QUERYSECRET", "http:///hook?token=QUERYSECRET", "ftp://h/hook?token=QUERYSECRET", "http://h:port/?token=QUERYSECRET"} {
		_, err := Parse([]byte("queues:\n  - {name: a, action: {type: webhook, url: '" + u + "', secret_env: OD_SECRET}}\n"))
		if err == nil || !strings.Contains(err.Error(), "url") || strings.Contains(err.Error(), "QUERYSECRET") {
			t.Errorf("url %s: %v, want an error about the url that does not quote it", u, err)
		}
	}
}

// A webhook secret shorter than 32 bytes is refused at load, with an error
// naming the queue, the setting and the variable but not the secret.
func TestParseRefusesShortWebhookSecret(t *testing.T) {
	const file = "queues:\n  - {name: hook, action: {type: webhook, url: 'https://h/x', secret_env: OD_SECRET}}\n"
	short := "whsec-0123456789abcdef012345678" // 31 bytes
	t.Setenv("OD_SECRET", short)
	_, err := Parse([]byte(file))
	if err == nil {
		t.Fatal("a 31-byte secret was accepted")
	}
	for _, want := range []string{`"hook"`, "secret_env", "OD_SECRET", "31 bytes", "at least 32"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
	if strings.Contains(err.Error(), short) {
		t.Errorf("error %q quotes the secret", err)
	}
	t.Setenv("OD_SECRET", short+"7")
	if _, err := Parse([]byte(file)); err != nil {
		t.Fatalf("a 32-byte secret: %v", err)
	}
}

// previous_secret_env, for a rotation, must name a set variable holding a
// secret other than the current one; it may be short, so a short secret
// can be rotated out.
func TestParseWebhookSecretRotation(t *testing.T) {
	t.Setenv("OD_SECRET", "0123456789abcdef0123456789abcdef")
	t.Setenv("OD_OLD_SECRET", "old-short-secret")
	t.Setenv("OD_SAME_SECRET", "0123456789abcdef0123456789abcdef")
	file := func(previous string) []byte {
		return []byte("queues:\n  - {name: hook, action: {type: webhook, url: 'https://h/x', secret_env: OD_SECRET, previous_secret_env: " + previous + "}}\n")
	}
	if _, err := Parse(file("OD_OLD_SECRET")); err != nil {
		t.Fatalf("a rotation: %v", err)
	}
	for previous, want := range map[string]string{"OD_UNSET_VAR": "unset", "OD_SAME_SECRET": "same secret"} {
		_, err := Parse(file(previous))
		if err == nil || !strings.Contains(err.Error(), `"hook"`) || !strings.Contains(err.Error(), "previous_secret_env") || !strings.Contains(err.Error(), want) {
			t.Errorf("previous_secret_env: %s: %v, want an error naming the queue, the setting and %q", previous, err, want)
		}
	}
}
