package client_test

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/client"
)

// nestedArrays is JSON nested depth levels deep, with a string full of
// brackets at the bottom (brackets inside strings do not nest).
func nestedArrays(depth int) json.RawMessage {
	return json.RawMessage(strings.Repeat("[", depth) + `"[[{{\"]]"` + strings.Repeat("]", depth))
}

// A payload nested deeper than MaxPayloadDepth is refused at the door,
// naming the limit, by PutTask and PutTasks alike, and nothing is written:
// Redis's scripts cannot decode JSON nested beyond 1,000 levels (Go's
// decoder accepts 10,000), and such a payload used to make a reliable-list
// item impossible to acknowledge.
func TestPutTaskRefusesPayloadsNestedTooDeep(t *testing.T) {
	c, rdb, keys := newClient(t)
	ctx := ctxT(t)
	for _, depth := range []int{client.MaxPayloadDepth + 1, 1001} {
		_, _, err := c.PutTask(ctx, "deep", nestedArrays(depth), base(), client.Create)
		if !errors.Is(err, client.ErrInvalidPayload) || !strings.Contains(err.Error(), strconv.Itoa(client.MaxPayloadDepth)) {
			t.Errorf("PutTask of a payload nested %d deep: %v, want ErrInvalidPayload naming the limit %d", depth, err, client.MaxPayloadDepth)
		}
		items := []client.TaskItem{{ID: "ok", Payload: json.RawMessage(`{}`), Deadline: base()}, {ID: "deep", Payload: nestedArrays(depth), Deadline: base()}}
		if _, err := c.PutTasks(ctx, items, client.Create); !errors.Is(err, client.ErrInvalidPayload) {
			t.Errorf("PutTasks with a payload nested %d deep: %v, want ErrInvalidPayload", depth, err)
		}
	}
	if n := zcard(t, rdb, keys.Queue); n != 0 {
		t.Fatalf("%d tasks written by refused puts", n)
	}
	if res, _, err := c.PutTask(ctx, "at-limit", nestedArrays(client.MaxPayloadDepth), base(), client.Create); err != nil || res != client.Created {
		t.Fatalf("PutTask at exactly the depth limit: %v, %v", res, err)
	}
}

func TestValidatePayload(t *testing.T) {
	cases := []struct {
		name    string
		payload string
		ok      bool
	}{
		{"scalar", `42`, true},
		{"object at the limit", strings.Repeat(`{"a":`, client.MaxPayloadDepth) + `1` + strings.Repeat(`}`, client.MaxPayloadDepth), true},
		{"object over the limit", strings.Repeat(`{"a":`, client.MaxPayloadDepth+1) + `1` + strings.Repeat(`}`, client.MaxPayloadDepth+1), false},
		{"brackets in strings", `{"s":"` + strings.Repeat(`[`, 200) + `\"\\"}`, true},
		{"wide, not deep", `[` + strings.Repeat(`[],`, 1000) + `[]]`, true},
		{"not JSON", `{bad}`, false},
		{"too large", `"` + strings.Repeat("x", client.MaxPayloadBytes) + `"`, false},
	}
	for _, tc := range cases {
		err := client.ValidatePayload([]byte(tc.payload))
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, client.ErrInvalidPayload)) {
			t.Errorf("%s: ValidatePayload = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}
