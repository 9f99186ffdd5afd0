package tasks

import (
	"context"
	"errors"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// proxyChildEnv marks the re-executed test binary that runs the webhook
// with the proxy variables set: net/http reads them once per process, so
// each case needs a process of its own.
const proxyChildEnv = "OD_TEST_PROXY_CHILD"

// A webhook's errors reach a task's last_error (shown by the API and the
// dead letters) and the daemon's log. Proxy credentials from
// HTTPS_PROXY/HTTP_PROXY must never appear there, whether the proxy
// refuses connections or its address cannot be parsed (net/http then
// quotes the variable's value whole).
func TestWebhookErrorsNeverQuoteProxyCredentials(t *testing.T) {
	t.Parallel()
	if os.Getenv(proxyChildEnv) != "" {
		for _, target := range []string{"http://receiver.example/hook", "https://receiver.example/hook"} {
			errs := webhookAction("q", target, 5*time.Second, testSecret, nil, nil)(context.Background(), oneTask("t-1"))
			if errs[0] == nil {
				t.Fatalf("%s through %s: delivered", target, os.Getenv("HTTPS_PROXY"))
			}
			msg := errs[0].Error()
			t.Logf("%s: %s", target, msg)
			for _, secret := range []string{"proxyuser", "pr0xy-s3cret"} {
				if strings.Contains(msg, secret) {
					t.Errorf("%s: error %q quotes the proxy's credentials (%s)", target, msg, secret)
				}
			}
			if !strings.Contains(msg, "receiver.example") {
				t.Errorf("%s: error %q does not name the webhook's origin", target, msg)
			}
		}
		return
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refusing := l.Addr().String() // closed below: connections are refused
	l.Close()
	for _, c := range []struct{ name, proxy string }{
		{"refusing proxy", "http://proxyuser:pr0xy-s3cret@" + refusing},
		// A trailing newline (a proxy URL from a file) makes it unparsable.
		{"unparsable proxy", "http://proxyuser:pr0xy-s3cret@" + refusing + "\n"},
		{"unparsable proxy without scheme", "proxyuser:pr0xy-s3cret@" + refusing + "\x7f"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestWebhookErrorsNeverQuoteProxyCredentials$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), proxyChildEnv+"=1", "HTTP_PROXY="+c.proxy, "HTTPS_PROXY="+c.proxy,
				"http_proxy=", "https_proxy=", "NO_PROXY=", "no_proxy=")
			out, err := cmd.CombinedOutput()
			t.Logf("%s", out)
			if err != nil {
				t.Errorf("with HTTPS_PROXY=%s: %v\n%s", c.proxy, err, out)
			}
		})
	}
}

// Whatever a transport's error quotes (a custom transport, a proxy
// function, another Go release), credentials in a URL in it are redacted
// before it becomes last_error or a log line.
func TestTransportErrorRedactsCredentialsInAnyURL(t *testing.T) {
	t.Parallel()
	ep, err := newEndpoint("https://receiver.example/hook?token=t0ken")
	if err != nil {
		t.Fatal(err)
	}
	cause := errors.New(`invalid proxy address "http://proxyuser:pr0xy-s3cret@proxy:3128\n": parse "socks5://other:0ther-s3cret@p/": bad`)
	msg := ep.transportError(&url.Error{Op: "Post", URL: "https://receiver.example/hook?token=t0ken", Err: cause}).Error()
	for _, secret := range []string{"proxyuser", "pr0xy-s3cret", "other:", "0ther-s3cret", "t0ken"} {
		if strings.Contains(msg, secret) {
			t.Errorf("error %q quotes %s", msg, secret)
		}
	}
	if !strings.Contains(msg, "proxy:3128") || !strings.Contains(msg, "https://receiver.example") {
		t.Errorf("error %q lost the proxy's host or the webhook's origin", msg)
	}
}
