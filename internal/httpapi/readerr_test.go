package httpapi_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/httpapi"
)

// failingBody fails the way a connection does when the client stalls past
// the server's ReadTimeout: an error naming both ends' addresses.
type failingBody struct{}

func (failingBody) Read([]byte) (int, error) {
	return 0, &net.OpError{Op: "read", Net: "tcp", Source: &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 8080},
		Addr: &net.TCPAddr{IP: net.IPv4(10, 9, 9, 9), Port: 40000}, Err: errTimeout{}}
}

type errTimeout struct{}

func (errTimeout) Error() string { return "i/o timeout" }

// TestBodyReadErrorShowsNoAddress: a body cut short is a 400 whose detail
// says so without the listener's address (the pod IP behind a proxy).
func TestBodyReadErrorShowsNoAddress(t *testing.T) {
	h := newAPI(t, httpapi.Config{}).api.Handler()
	req := httptest.NewRequest(http.MethodPut, "/v1/timeouts/ord-1", failingBody{})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusBadRequest || strings.Contains(rec.Body.String(), "10.1.2.3") || strings.Contains(rec.Body.String(), "10.9.9.9") {
		t.Errorf("PUT with a failing body: %d %s, want 400 without addresses", rec.Code, rec.Body)
	}
}
