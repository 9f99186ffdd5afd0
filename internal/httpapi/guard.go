package httpapi

import (
	"net"
	"net/http"
	"strconv"
	"strings"
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
