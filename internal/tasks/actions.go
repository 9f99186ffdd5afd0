package tasks

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/orderdelay/orderdelay/internal/consumer"
)

// Webhook request headers.
const (
	HeaderIdempotencyKey = "Idempotency-Key"
	HeaderTimestamp      = "X-Orderdelay-Timestamp"
	// HeaderSignature is Sign by the current secret (secret_env), alone and
	// in the same format whether or not a rotation is under way.
	HeaderSignature = "X-Orderdelay-Signature"
	// HeaderSignaturePrevious is Sign by the secret being replaced
	// (previous_secret_env), sent only during a rotation.
	HeaderSignaturePrevious = "X-Orderdelay-Signature-Previous"
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
// recompute it with the secret they know, accept the request if it equals
// HeaderSignature or HeaderSignaturePrevious (compared in constant time),
// and reject timestamps older than a few minutes so a captured request
// cannot be replayed.
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
//
// previous, when not nil, is the secret being rotated out: each request then
// carries a second signature by it (HeaderSignaturePrevious).
func webhookAction(queue, rawURL string, timeout time.Duration, secret, previous []byte, hc *http.Client) consumer.ProcessFunc {
	if hc == nil {
		hc = &http.Client{Timeout: timeout}
	}
	noRedirects := *hc
	noRedirects.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	hc = &noRedirects
	ep, err := newEndpoint(rawURL)
	return func(ctx context.Context, tasks []consumer.Task) []error {
		errs := make([]error, len(tasks))
		if err != nil { // refused by the config check; kept for callers that skip it
			for i := range errs {
				errs[i] = fmt.Errorf("webhook: %w", err)
			}
			return errs
		}
		sem := make(chan struct{}, webhookConcurrency)
		var wg sync.WaitGroup
		for i, t := range tasks {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				errs[i] = post(ctx, hc, queue, ep, timeout, secret, previous, t)
			}()
		}
		wg.Wait()
		return errs
	}
}

// endpoint is a webhook URL, parsed once, with what its errors may say
// about it.
type endpoint struct {
	url    string
	origin string // scheme://host[:port]: all an error names
	// scrub removes the whole URL from an error's text, in case a transport
	// error quotes it (the *url.Error around them, which does, is dropped).
	scrub *strings.Replacer
}

var errBadWebhookURL = errors.New("url must be an absolute http:// or https:// URL with a host")

func newEndpoint(raw string) (endpoint, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
		return endpoint{}, errBadWebhookURL // not err: a *url.Error quotes the URL
	}
	origin := u.Scheme + "://" + u.Host
	pairs := []string{raw, origin, u.String(), origin, u.Redacted(), origin}
	if ru := u.RequestURI(); ru != "/" {
		pairs = append(pairs, ru, "/…")
	}
	return endpoint{url: raw, origin: origin, scrub: strings.NewReplacer(pairs...)}, nil
}

// webhookError is a failed delivery as it is recorded: in a task's
// last_error (shown by GET /v1/queues/{q}/tasks/{id} and the dead letters),
// the durable task log and the daemon's log. It names the URL by scheme and
// host only, never its path, query or userinfo, which often carry tokens.
type webhookError struct {
	msg string
	err error // the transport's error, or nil for a status
}

func (e *webhookError) Error() string { return e.msg }
func (e *webhookError) Unwrap() error { return e.err }

func (ep endpoint) statusError(code int) error {
	msg := fmt.Sprintf("webhook %s: status %d", ep.origin, code)
	if code >= 300 && code <= 399 {
		msg += " (redirects are not followed: point url at the final address)"
	}
	return &webhookError{msg: msg}
}

// transportError says why no answer came. Go's *url.Error quotes the whole
// URL, so it is unwrapped and only its cause is kept; credentials of any
// URL the cause quotes (a proxy's) are redacted.
func (ep endpoint) transportError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		if ue.Timeout() {
			return &webhookError{msg: fmt.Sprintf("webhook %s: timed out waiting for an answer", ep.origin), err: ue.Err}
		}
		err = ue.Err
	}
	return &webhookError{msg: fmt.Sprintf("webhook %s: %s", ep.origin, redactUserinfo(ep.scrub.Replace(err.Error()))), err: err}
}

func post(ctx context.Context, hc *http.Client, queue string, ep endpoint, timeout time.Duration, secret, previous []byte, t consumer.Task) error {
	body, err := json.Marshal(WebhookBody{Queue: queue, ID: t.ID, Deadline: t.Deadline.UTC(), Attempt: t.Attempts + 1, Payload: t.Payload})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.url, bytes.NewReader(body))
	if err != nil {
		return ep.transportError(err)
	}
	ts := time.Now().Unix()
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "orderdelay")
	req.Header.Set(HeaderIdempotencyKey, queue+":"+t.ID+":"+strconv.FormatInt(t.Deadline.UnixMilli(), 10))
	req.Header.Set(HeaderTimestamp, strconv.FormatInt(ts, 10))
	req.Header.Set(HeaderSignature, Sign(secret, ts, body))
	if previous != nil {
		req.Header.Set(HeaderSignaturePrevious, Sign(previous, ts, body))
	}
	resp, err := hc.Do(req)
	if err != nil {
		return ep.transportError(err)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) //nolint:errcheck // drained for connection reuse
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return ep.statusError(resp.StatusCode)
	}
	return nil
}
