package httpapi_test

import (
	"encoding/json"
	"net/http"
	"testing"
)

// TestPollRefusesABody: a poll's max and wait are query parameters; a body
// such as {"max":5} was ignored without a word, and the client got up to 10
// tasks leased for it. Like every other body, a poll's is decoded strictly:
// none, or {}, and anything else is a 400 that names the body.
func TestPollRefusesABody(t *testing.T) {
	e := newProduceAPI(t, false)
	for _, body := range []string{`{"max":5}`, `{"wait":"1s"}`, `[]`, `x`} {
		rec := e.post(t, "/v1/queues/plain/poll", body)
		var p problem
		_ = json.Unmarshal(rec.Body.Bytes(), &p)
		if rec.Code != http.StatusBadRequest || p.Field != "body" {
			t.Errorf("poll with body %s: %d %s, want 400 naming the body", body, rec.Code, rec.Body)
		}
	}
	for _, body := range []string{``, `{}`, " \n"} {
		if rec := e.post(t, "/v1/queues/plain/poll?max=1", body); rec.Code != http.StatusOK {
			t.Errorf("poll with body %q: %d %s, want 200", body, rec.Code, rec.Body)
		}
	}
}
