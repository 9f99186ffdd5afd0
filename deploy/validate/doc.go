// Package validate holds the tests that check what users deploy: the
// container image recipe, the kustomize manifests, the alerts, the Grafana
// dashboard and the docker-compose stack, against the daemon's real
// contract (../../testdata/settings.txt, ../../testdata/metrics.txt).
//
// It is a separate Go module so that its heavy dependencies (Kubernetes API
// types, kustomize, the Prometheus query engine) stay out of the daemon's
// go.mod. Run it with:
//
//	cd deploy/validate && go vet ./... && go test ./...
package validate
