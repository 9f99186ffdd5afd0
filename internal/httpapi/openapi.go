package httpapi

import (
	_ "embed" // the OpenAPI document
	"encoding/json"
	"fmt"
	"net/http"
	"sync"

	"go.yaml.in/yaml/v3"
)

// The OpenAPI 3.1 document of the HTTP API, written by hand in
// openapi.yaml and served as JSON at GET /v1/openapi.json without a token:
// it is the same for every deployment and holds no secret (no token, no
// address, no queue name). Tests check it against the routes Handler
// serves (both ways) and every real request and response of a test that
// drives each operation.
//
//go:embed openapi.yaml
var openapiYAML []byte

// OpenAPIYAML returns the OpenAPI document as written (YAML).
func OpenAPIYAML() []byte { return append([]byte(nil), openapiYAML...) }

// OpenAPIJSON returns the OpenAPI document as served (JSON).
var OpenAPIJSON = sync.OnceValues(func() ([]byte, error) {
	var doc any
	if err := yaml.Unmarshal(openapiYAML, &doc); err != nil {
		return nil, fmt.Errorf("openapi.yaml: %w", err)
	}
	b, err := json.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("openapi.yaml as JSON: %w", err)
	}
	return b, nil
})

func serveOpenAPI(w http.ResponseWriter, _ *http.Request) {
	b, err := OpenAPIJSON()
	if err != nil { // a test catches this before a release
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	_, _ = w.Write(b) // the client went away; nothing to do
}
