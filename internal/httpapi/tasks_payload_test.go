package httpapi_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/httpapi"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/producer"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A task payload nested deeper than client.MaxPayloadDepth is refused with
// 400 naming the limit, and nothing is stored.
func TestPutTaskRefusesDeeplyNestedPayloadWith400(t *testing.T) {
	rdb, keys := testenv.Redis(t)
	f, err := tasks.Parse([]byte("queues:\n  - name: jobs\n    key: '" + keys.Queue + "'\n    action: {type: list, reliable: true}\n"))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "t", "t")
	mgr, err := tasks.NewManager(f, rdb, nil, metrics.NewTaskFamilies(reg, m), zap.NewNop(), "t")
	if err != nil {
		t.Fatal(err)
	}
	oc, err := client.New(rdb, keys.Queue+":orders")
	if err != nil {
		t.Fatal(err)
	}
	api := httpapi.New(httpapi.Config{}, producer.New(oc, m, nil), m, reg, zap.NewNop())
	api.EnableTasks(mgr)
	srv := httptest.NewServer(api.Handler())
	t.Cleanup(srv.Close)

	deep := strings.Repeat("[", 1001) + strings.Repeat("]", 1001)
	r := do(t, http.MethodPut, srv.URL+"/v1/queues/jobs/tasks/deep-1", `{"after":"1m","payload":`+deep+`}`)
	wantAnyProblem(t, r, http.StatusBadRequest)
	if !strings.Contains(r.body.Detail, strconv.Itoa(client.MaxPayloadDepth)) {
		t.Errorf("error %q does not name the nesting limit %d", r.body.Detail, client.MaxPayloadDepth)
	}
	if n, err := rdb.ZCard(context.Background(), keys.Queue).Result(); err != nil || n != 0 {
		t.Errorf("%d tasks stored after a refused put (%v)", n, err)
	}
	ok := strings.Repeat("[", client.MaxPayloadDepth) + strings.Repeat("]", client.MaxPayloadDepth)
	if r := do(t, http.MethodPut, srv.URL+"/v1/queues/jobs/tasks/ok-1", `{"after":"1m","payload":`+ok+`}`); r.code != http.StatusCreated {
		t.Errorf("payload at the limit: %d %s, want 201", r.code, r.raw)
	}
}
