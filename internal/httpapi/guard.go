package httpapi

import (
	"net"
	"net/http"
	"strconv"
	"strings"

	"go.uber.org/zap"
)

// crossOrigin detects the state-changing requests a browser sends on a
// page's behalf to another origin (Sec-Fetch-Site, or an Origin other than
// the Host). It takes no configuration: no browser application is served
// (the API sends no CORS headers).
var crossOrigin http.CrossOriginProtection

// refuseCrossOrigin answers 403 to a cross-origin browser request other
// than GET, HEAD or OPTIONS, before h sees it. Without a token (protected
// mode, ORDERDELAY_API_AUTH=none) nothing else would stop a web page the
// operator visits from enqueueing or acking: a POST with a text/plain body
// needs no CORS preflight. Clients that are not browsers send neither
// header and pass.
func refuseCrossOrigin(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := crossOrigin.Check(r); err != nil {
			writeError(w, http.StatusForbidden, "a browser's cross-origin request is refused: the API serves no web page's scripts")
			return
		}
		h.ServeHTTP(w, r)
	})
}

// LoopbackHostsOnly serves h only to requests addressed to localhost or a
// loopback IP (the Host header), and answers any other 421: the daemon's
// guard in protected mode, where /v1 takes no token because only this
// machine reaches the loopback listener. A web page can reach it anyway by
// DNS rebinding: its own name made to resolve to 127.0.0.1, after which the
// browser reads and writes the API as that page's origin. Such a request
// carries the page's name in Host. A request without Host (HTTP/1.0) is
// served: no browser sends one.
func LoopbackHostsOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Host != "" && !loopbackHost(r.Host) {
			writeError(w, http.StatusMisdirectedRequest, "protected mode: without ORDERDELAY_API_TOKEN this listener "+
				"answers requests addressed to localhost or a loopback IP only, not "+strconv.Quote(r.Host))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// loopbackHost reports whether a Host header (host, host:port, [v6]:port)
// names localhost or a loopback IP.
func loopbackHost(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
		if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
			host = host[1 : len(host)-1]
		}
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// recoverProblems answers a handler's panic with a 500 problem, like any
// other error, when nothing was written yet, and logs it with its stack;
// net/http alone drops the connection and the client learns nothing. The
// panic's message is for the log, not the client. http.ErrAbortHandler
// passes through (a handler's way to abort the response).
func (s *Server) recoverProblems(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tw := &wroteHeader{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if v == http.ErrAbortHandler { //nolint:errorlint // the sentinel value, as net/http compares it
				panic(v)
			}
			s.log.Error("http: panic serving a request", zap.String("method", r.Method), zap.String("path", r.URL.Path),
				zap.Any("panic", v), zap.StackSkip("stack", 1))
			if tw.wrote {
				panic(http.ErrAbortHandler) // a partial answer: cut the connection
			}
			writeError(w, http.StatusInternalServerError, "internal error; it is logged")
		}()
		h.ServeHTTP(tw, r)
	})
}

// wroteHeader records whether a response was started.
type wroteHeader struct {
	http.ResponseWriter
	wrote bool
}

func (w *wroteHeader) WriteHeader(code int) { w.wrote = true; w.ResponseWriter.WriteHeader(code) }
func (w *wroteHeader) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}
func (w *wroteHeader) Unwrap() http.ResponseWriter { return w.ResponseWriter }
