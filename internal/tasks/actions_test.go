package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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
			errs := webhookAction("q", hook.URL+"/hook", 5*time.Second, testSecret, nil)(context.Background(), oneTask("t-1"))
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
	errs := webhookAction("q", hook.URL, 5*time.Second, testSecret, &http.Client{})(context.Background(), oneTask("t-1"))
	if errs[0] == nil || landed.Load() != 0 {
		t.Errorf("with a given client: error %v, %d requests elsewhere; want a failure and none", errs[0], landed.Load())
	}
}

// An error recorded for a webhook names the scheme and host and the status
// or kind of failure, never the path, query or userinfo: those often carry
// tokens, and last_error is shown by the task API and the dead letters.
func TestWebhookErrorsNameOnlySchemeAndHost(t *testing.T) {
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
			errs := webhookAction("q", u, 300*time.Millisecond, testSecret, nil)(context.Background(), oneTask("t-1"))
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
