package tasks

import (
	"strings"
	"testing"
)

// A webhook secret is the HMAC key byte for byte. A trailing newline (a
// secret made with kubectl create secret --from-file from a file an
// editor ended with one) would silently become part of the key, and every
// receiver that trims it would reject every signature. The daemon refuses
// a secret with leading or trailing whitespace, naming the variable, and
// never quotes the secret.
func TestParseRefusesWebhookSecretWithSurroundingWhitespace(t *testing.T) {
	const good = "whsec-0123456789abcdef0123456789abcdef"
	const file = "queues:\n  - {name: hook, action: {type: webhook, url: 'https://h/x', secret_env: OD_SECRET, previous_secret_env: OD_OLD}}\n"
	for _, c := range []struct{ name, env, secret, old string }{
		{"trailing newline", "OD_SECRET", good + "\n", "old-secret"},
		{"trailing CRLF", "OD_SECRET", good + "\r\n", "old-secret"},
		{"leading space", "OD_SECRET", " " + good, "old-secret"},
		{"trailing tab", "OD_SECRET", good + "\t", "old-secret"},
		{"previous with newline", "OD_OLD", good, "old-secret\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("OD_SECRET", c.secret)
			t.Setenv("OD_OLD", c.old)
			_, err := Parse([]byte(file))
			if err == nil {
				t.Fatal("accepted")
			}
			for _, want := range []string{`"hook"`, c.env, "whitespace"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %s", err, want)
				}
			}
			if strings.Contains(err.Error(), strings.TrimSpace(c.secret)) || strings.Contains(err.Error(), strings.TrimSpace(c.old)) {
				t.Errorf("error %q quotes a secret", err)
			}
		})
	}
	t.Setenv("OD_SECRET", good)
	t.Setenv("OD_OLD", "old secret with inner spaces")
	if _, err := Parse([]byte(file)); err != nil {
		t.Fatalf("secrets without surrounding whitespace: %v", err)
	}
}
