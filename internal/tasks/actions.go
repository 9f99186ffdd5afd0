package tasks

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/orders"
)

// sqlAction runs a queue's statement on a batch: `$1 text[]` ids -> the ids
// it handled. Ids it does not return failed and are retried.
func sqlAction(db *sqlx.DB, statement string) consumer.ProcessFunc {
	return func(ctx context.Context, tasks []consumer.Task) []error {
		ids := make([]string, len(tasks))
		for i, t := range tasks {
			ids[i] = t.ID
		}
		errs := make([]error, len(tasks))
		done, err := orders.RunIDs(ctx, db, statement, ids)
		if err != nil {
			for i := range errs {
				errs[i] = err
			}
			return errs
		}
		ok := make(map[string]bool, len(done))
		for _, id := range done {
			ok[id] = true
		}
		for i, t := range tasks {
			if !ok[t.ID] {
				errs[i] = fmt.Errorf("the statement did not return %q", t.ID)
			}
		}
		return errs
	}
}

// Webhook request headers.
const (
	HeaderIdempotencyKey = "Idempotency-Key"
	HeaderTimestamp      = "X-Orderdelay-Timestamp"
	HeaderSignature      = "X-Orderdelay-Signature"
)

// WebhookBody is what a webhook receives.
type WebhookBody struct {
	Queue    string          `json:"queue"`
	ID       string          `json:"id"`
	Deadline time.Time       `json:"deadline"`
	Attempt  int             `json:"attempt"` // 1 for the first try
	Payload  json.RawMessage `json:"payload"`
}

// Sign returns the signature header value for a body sent at ts (Unix
// seconds): "v1=" + hex(HMAC-SHA256(secret, ts + "." + body)). Receivers
// recompute it, compare in constant time, and reject timestamps older than
// a few minutes so a captured request cannot be replayed.
func Sign(secret []byte, ts int64, body []byte) string {
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(strconv.FormatInt(ts, 10)))
	mac.Write([]byte("."))
	mac.Write(body)
	return "v1=" + hex.EncodeToString(mac.Sum(nil))
}

// webhookConcurrency bounds the requests one batch has in flight.
const webhookConcurrency = 8

// webhookAction POSTs each task. 2xx is done; anything else, or no answer
// within the timeout, is a failure to retry. The idempotency key is the
// same on every attempt of a task, so the receiver can drop duplicates.
//
// Redirects are never followed, on hc too: a 3xx is a failure like a 5xx.
// Following one would turn the signed POST into a body-less GET that counts
// as delivered (301, 302, 303) or send the signed body to whatever host the
// Location names (307, 308).
func webhookAction(queue, url string, timeout time.Duration, secret []byte, hc *http.Client) consumer.ProcessFunc {
	if hc == nil {
		hc = &http.Client{Timeout: timeout}
	}
	noRedirects := *hc
	noRedirects.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	hc = &noRedirects
	return func(ctx context.Context, tasks []consumer.Task) []error {
		errs := make([]error, len(tasks))
		sem := make(chan struct{}, webhookConcurrency)
		var wg sync.WaitGroup
		for i, t := range tasks {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				errs[i] = post(ctx, hc, queue, url, timeout, secret, t)
			}()
		}
		wg.Wait()
		return errs
	}
}

func post(ctx context.Context, hc *http.Client, queue, url string, timeout time.Duration, secret []byte, t consumer.Task) error {
	body, err := json.Marshal(WebhookBody{Queue: queue, ID: t.ID, Deadline: t.Deadline.UTC(), Attempt: t.Attempts + 1, Payload: t.Payload})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	ts := time.Now().Unix()
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "orderdelay")
	req.Header.Set(HeaderIdempotencyKey, queue+":"+t.ID+":"+strconv.FormatInt(t.Deadline.UnixMilli(), 10))
	req.Header.Set(HeaderTimestamp, strconv.FormatInt(ts, 10))
	req.Header.Set(HeaderSignature, Sign(secret, ts, body))
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) //nolint:errcheck // drained for connection reuse
	resp.Body.Close()
	switch {
	case resp.StatusCode >= 300 && resp.StatusCode <= 399:
		return fmt.Errorf("webhook: status %d (redirects are not followed: point url at the final address)", resp.StatusCode)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return fmt.Errorf("webhook: status %d", resp.StatusCode)
	}
	return nil
}
