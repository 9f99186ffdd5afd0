package httpapi

import "net/http"

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
