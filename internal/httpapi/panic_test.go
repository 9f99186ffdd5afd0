package httpapi_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
)

// TestPanicAnswersA500Problem: a handler's bug (here a server without its
// producer, so /v1/timeouts dereferences nil) answers a 500 problem like
// every other error, logs the panic, and tells the client nothing of it;
// net/http alone would drop the connection, and the client would see EOF
// and retry into the same bug without a word.
func TestPanicAnswersA500Problem(t *testing.T) {
	reg := prometheus.NewRegistry()
	core, logs := observer.New(zapcore.ErrorLevel)
	api := httpapi.New(httpapi.Config{}, nil, metrics.New(reg, "t", "t"), reg, zap.New(core))
	srv := httptest.NewServer(api.Handler())
	t.Cleanup(srv.Close)

	r := do(t, http.MethodGet, srv.URL+"/v1/timeouts/ORD-1", "")
	p := wantProblem(t, r, http.StatusInternalServerError, "about:blank")
	if strings.Contains(p.Detail, "nil pointer") || strings.Contains(p.Detail, ".go:") {
		t.Errorf("detail %q shows the panic", p.Detail)
	}
	if logs.FilterMessageSnippet("panic").Len() != 1 {
		t.Errorf("want one error logged about the panic, got %v", logs.All())
	}
}
