package httpapi_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/orderdelay/orderdelay/internal/httpapi"
)

// TestUncleanPathsToNowhereAre404: a path that is not in clean form
// ("//admin/v1/pause", "/admin/v1/../admin/v1/pause") makes the ServeMux
// redirect to its clean form. On the API listener the clean form of an
// admin path matches no route, so the answer is a 404 problem, not a
// redirect without a Location; a clean form that is a route is still
// redirected to, with its Location.
func TestUncleanPathsToNowhereAre404(t *testing.T) {
	api := newAPI(t, httpapi.Config{}).api.Handler()
	for _, path := range []string{"//admin/v1/pause", "/admin/v1/../admin/v1/pause", "/v1/../admin/v1/pause", "//metrics2", "/./nothing"} {
		rec := httptest.NewRecorder()
		api.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://x"+path, nil))
		if rec.Code != http.StatusNotFound || rec.Header().Get("Content-Type") != "application/problem+json" {
			t.Errorf("GET %s on the API listener: %d %q (Location %q) %s, want a 404 problem",
				path, rec.Code, rec.Header().Get("Content-Type"), rec.Header().Get("Location"), rec.Body)
		}
	}
	rec := httptest.NewRecorder()
	api.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://x//v1/openapi.json", nil))
	if rec.Code/100 != 3 || rec.Header().Get("Location") != "/v1/openapi.json" {
		t.Errorf("GET //v1/openapi.json: %d, Location %q, want a redirect to /v1/openapi.json", rec.Code, rec.Header().Get("Location"))
	}
}
