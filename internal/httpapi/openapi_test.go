package httpapi_test

// The OpenAPI document (openapi.yaml) against the server: every route it
// serves is in the document and the reverse. openapi_contract_test.go
// drives every operation and status of the document.

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/admin"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// loadDoc loads and validates the document as served.
func loadDoc(t *testing.T, served []byte) *openapi3.T {
	t.Helper()
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(served)
	if err != nil {
		t.Fatalf("load the OpenAPI document: %v", err)
	}
	if !doc.IsOpenAPI31OrLater() || doc.IsOpenAPI32OrLater() {
		t.Fatalf("openapi %q, want 3.1", doc.OpenAPI)
	}
	if err := doc.Validate(context.Background()); err != nil {
		t.Fatalf("the OpenAPI document is invalid: %v", err)
	}
	return doc
}

// catchAlls are each listener's method-less patterns, which answer 404
// problems (403 on an admin listener without a token): not operations, so
// not in the document.
var catchAlls = map[string][]string{"api": {"/v1/"}, "admin": {"/admin/", "/"}}

// A route a listener serves that the document lacks, or an operation of
// the document no route serves, fails. The document's /admin/ paths are the
// admin listener's (AdminHandler), the others the API listener's
// (Handler). The server is built with every optional part (admin API, task
// queues), so Routes lists all of them.
func TestOpenAPIDocumentMatchesTheRoutes(t *testing.T) {
	served, err := httpapi.OpenAPIJSON()
	if err != nil {
		t.Fatal(err)
	}
	doc := loadDoc(t, served)
	inDoc := map[string][]string{}
	for path, item := range doc.Paths.Map() {
		listener := "api"
		if strings.HasPrefix(path, "/admin/") {
			listener = "admin"
		}
		for method := range item.Operations() {
			inDoc[listener] = append(inDoc[listener], method+" "+path)
		}
	}
	api := contractServer(t, contractConfig{rdb: mustRedis(t), admin: true, yaml: "queues:\n  - {name: jobs, key: 'x:jobs', action: {type: poll}}\n"})
	apiRoutes, adminRoutes := api.Routes()
	n := 0
	for listener, patterns := range map[string][]string{"api": apiRoutes, "admin": adminRoutes} {
		var routes []string
		for _, p := range patterns {
			if !strings.Contains(p, " ") {
				if !slices.Contains(catchAlls[listener], p) {
					t.Errorf("%s listener: route %q has no method: a catch-all this test does not know", listener, p)
				}
				continue
			}
			routes = append(routes, p)
		}
		for _, r := range routes {
			if !slices.Contains(inDoc[listener], r) {
				t.Errorf("%s listener: route %q is served but not in openapi.yaml", listener, r)
			}
		}
		for _, o := range inDoc[listener] {
			if !slices.Contains(routes, o) {
				t.Errorf("operation %q is in openapi.yaml but the %s listener serves no such route", o, listener)
			}
		}
		n += len(routes)
	}
	if !t.Failed() {
		t.Logf("%d routes (%d on the API listener, the others on the admin listener), each an operation of the document", n, len(inDoc["api"]))
	}
}

func mustRedis(t *testing.T) *redis.Client {
	t.Helper()
	rdb, _ := testenv.Redis(t)
	return rdb
}

const (
	contractProducer = "producer-token-contract-0123"
	contractAdmin    = "admin-token-contract-0123456"
)

type contractConfig struct {
	rdb   *redis.Client
	db    *sqlx.DB
	key   string // the order queue's key
	yaml  string // the queues file
	admin bool   // serve the admin API
	cfg   httpapi.Config
}

// contractServer builds a server as the daemon does, with producer tokens,
// the task queues of c.yaml (their meta written, as at start) and, if
// c.admin, the admin API.
func contractServer(t *testing.T, c contractConfig) *httpapi.Server {
	t.Helper()
	if c.key == "" {
		c.key = "x:order"
	}
	f, err := tasks.Parse([]byte(c.yaml))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	mgr, err := tasks.NewManager(f, c.rdb, c.db, metrics.NewTaskFamilies(reg, m), zap.NewNop(), "t")
	if err != nil {
		t.Fatal(err)
	}
	oc, err := client.New(c.rdb, c.key)
	if err != nil {
		t.Fatal(err)
	}
	c.cfg.Tokens = []string{contractProducer}
	api := httpapi.New(c.cfg, producer.New(oc, m, time.Now), m, reg, zap.NewNop())
	if c.admin {
		tools, err := admin.New(c.rdb, c.key, c.db)
		if err != nil {
			t.Fatal(err)
		}
		api.EnableAdmin(httpapi.AdminConfig{Tokens: []string{contractAdmin}, Tools: tools})
	}
	api.EnableTasks(mgr)
	return api
}
