package tasks

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/orderdelay/orderdelay/internal/consumer"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef") // 32 bytes

func oneTask(id string) []consumer.Task {
	return []consumer.Task{{ID: id, Deadline: time.UnixMilli(1_700_000_000_000), Payload: json.RawMessage(`{"n":1}`)}}
}

// A redirect is never followed: a 301/302/303 would turn the signed POST
// into a body-less GET that counts as delivered, and a 307/308 would send
// the signed body to any host the Location names. Every 3xx is a failure
// the queue retries, with the status in the error.
func TestWebhookDoesNotFollowRedirects(t *testing.T) {
	t.Parallel()
	var landed atomic.Int32
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		landed.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	defer elsewhere.Close()
	for _, code := range []int{301, 302, 303, 307, 308} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			landed.Store(0)
			hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				http.Redirect(w, r, elsewhere.URL+"/landing", code)
			}))
			defer hook.Close()
			errs := webhookAction("q", hook.URL+"/hook", 5*time.Second, testSecret, nil, nil)(context.Background(), oneTask("t-1"))
			if errs[0] == nil || !strings.Contains(errs[0].Error(), fmt.Sprint(code)) {
				t.Errorf("a %d answer gave error %v, want a failure naming the status", code, errs[0])
			}
			if n := landed.Load(); n != 0 {
				t.Errorf("the redirect was followed: %d requests reached the Location's host", n)
			}
		})
	}
	// A caller's client is not allowed to follow them either.
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL, http.StatusTemporaryRedirect)
	}))
	defer hook.Close()
	landed.Store(0)
	errs := webhookAction("q", hook.URL, 5*time.Second, testSecret, nil, &http.Client{})(context.Background(), oneTask("t-1"))
	if errs[0] == nil || landed.Load() != 0 {
		t.Errorf("with a given client: error %v, %d requests elsewhere; want a failure and none", errs[0], landed.Load())
	}
}

// An error recorded for a webhook names the scheme and host and the status
// or kind of failure, never the path, query or userinfo: those often carry
// tokens, and last_error is shown by the task API and the dead letters.
func TestWebhookErrorsNameOnlySchemeAndHost(t *testing.T) {
	t.Parallel()
	secrets := []string{"USERSECRET", "PATHSECRET", "QUERYSECRET"}
	const secretPart = "user:USERSECRET@%s/hook/PATHSECRET?token=QUERYSECRET"
	unavailable := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer unavailable.Close()
	release := make(chan struct{})
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) //nolint:errcheck // read, so the server notices the sender hanging up
		select {                    // no answer until the sender gives up
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer silent.Close()
	defer close(release) // before Close, which waits for the handler
	closed := httptest.NewServer(http.NotFoundHandler())
	closedHost := closed.Listener.Addr().String()
	closed.Close() // nothing listens there now: connection refused

	cases := []struct{ name, host, want string }{
		{"status", unavailable.Listener.Addr().String(), "status 503"},
		{"timeout", silent.Listener.Addr().String(), "timed out"},
		{"refused", closedHost, "refused"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			u := "http://" + fmt.Sprintf(secretPart, c.host)
			errs := webhookAction("q", u, 300*time.Millisecond, testSecret, nil, nil)(context.Background(), oneTask("t-1"))
			if errs[0] == nil {
				t.Fatal("delivered, want a failure")
			}
			got := errs[0].Error()
			for _, s := range secrets {
				if strings.Contains(got, s) {
					t.Errorf("error %q contains the URL's %s", got, s)
				}
			}
			if !strings.Contains(got, "http://"+c.host) || !strings.Contains(got, c.want) {
				t.Errorf("error %q, want it to name http://%s and %q", got, c.host, c.want)
			}
		})
	}
}

// verify is the receiver's check as docs/tasks.md shows it (keep the two
// the same): the request is accepted if either signature header matches
// the secret the receiver knows.
func verify(secret []byte, h http.Header, body []byte, now time.Time) bool {
	ts, err := strconv.ParseInt(h.Get("X-Orderdelay-Timestamp"), 10, 64)
	if err != nil || now.Sub(time.Unix(ts, 0)).Abs() > 5*time.Minute {
		return false // missing, or too old to trust: a replay
	}
	mac := hmac.New(sha256.New, secret)
	fmt.Fprintf(mac, "%d.", ts)
	mac.Write(body)
	want := []byte("v1=" + hex.EncodeToString(mac.Sum(nil)))
	for _, name := range []string{"X-Orderdelay-Signature", "X-Orderdelay-Signature-Previous"} {
		if got := h.Get(name); got != "" && hmac.Equal([]byte(got), want) {
			return true
		}
	}
	return false
}

// During a rotation each request carries a signature by each secret, so a
// receiver that knows either accepts it, and the signature header itself
// is unchanged: a receiver comparing it with Sign(current secret) as before
// keeps working.
func TestWebhookSignsWithBothSecretsDuringARotation(t *testing.T) {
	t.Parallel()
	type request struct {
		h    http.Header
		body []byte
	}
	got := make(chan request, 1)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		got <- request{r.Header.Clone(), body}
	}))
	defer hook.Close()
	current := []byte("the-new-secret-0123456789abcdef-0123456789")
	previous := []byte("old-short-secret") // shorter than 32 bytes: rotating it out is allowed
	other := []byte("some-other-secret-0123456789abcdef")

	send := func(previous []byte) request {
		t.Helper()
		if errs := webhookAction("q", hook.URL, 5*time.Second, current, previous, nil)(context.Background(), oneTask("t-1")); errs[0] != nil {
			t.Fatal(errs[0])
		}
		return <-got
	}
	r := send(previous)
	ts, _ := strconv.ParseInt(r.h.Get(HeaderTimestamp), 10, 64)
	if sig := r.h.Get(HeaderSignature); sig != Sign(current, ts, r.body) {
		t.Errorf("%s is %q, want Sign(current secret) alone as before a rotation", HeaderSignature, sig)
	}
	now := time.Now()
	if !verify(current, r.h, r.body, now) || !verify(previous, r.h, r.body, now) {
		t.Errorf("during a rotation: verified by the current secret %v, by the previous %v; want both",
			verify(current, r.h, r.body, now), verify(previous, r.h, r.body, now))
	}
	if verify(other, r.h, r.body, now) {
		t.Error("a secret that is neither verified the request")
	}
	if verify(previous, r.h, r.body, now.Add(10*time.Minute)) {
		t.Error("a 10-minute-old request verified: replays are not refused")
	}

	r = send(nil)
	if p, ok := r.h[HeaderSignaturePrevious]; ok {
		t.Errorf("without a previous secret the request carries %s %q", HeaderSignaturePrevious, p)
	}
	if !verify(current, r.h, r.body, now) || verify(previous, r.h, r.body, now) {
		t.Error("without a previous secret: want only the current secret to verify")
	}
}

// The receiver's check in docs/tasks.md is the one tested above.
func TestDocsVerifyIsTheTestedOne(t *testing.T) {
	t.Parallel()
	fn := func(path string) string {
		t.Helper()
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		i := strings.Index(s, "func verify(")
		if i < 0 {
			t.Fatalf("%s has no func verify", path)
		}
		j := strings.Index(s[i:], "\n}\n")
		if j < 0 {
			t.Fatalf("%s: func verify does not end", path)
		}
		return s[i : i+j+3]
	}
	if doc, test := fn(filepath.Join("..", "..", "docs", "tasks.md")), fn("actions_test.go"); doc != test {
		t.Errorf("docs/tasks.md's verify differs from actions_test.go's:\n%s\nwant\n%s", doc, test)
	}
}
