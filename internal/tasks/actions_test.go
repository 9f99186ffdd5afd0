package tasks

import (
	"context"
	"encoding/json"
	"fmt"
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
