package main

import (
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"

	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/config"
	"github.com/orderdelay/orderdelay/internal/httpapi"
)

// listener is one of the daemon's HTTP listeners, bound.
type listener struct {
	what string // http, admin or pprof
	ln   net.Listener
	h    http.Handler
}

// openListeners decides and binds the daemon's HTTP listeners:
//
//   - http (ORDERDELAY_HTTP_ADDR): the producer API /v1, /metrics and the
//     health checks. Protected mode: without an API token (and auth not
//     switched off with ORDERDELAY_API_AUTH=none) it must be loopback, or
//     the daemon refuses to start (exit 2), and it answers only requests
//     addressed to localhost or a loopback IP (httpapi.LoopbackHostsOnly:
//     no DNS-rebinding web page). /metrics and the probes need no
//     token on any address; in a pod they work on the pod IP because the
//     pod has a token.
//   - admin (ORDERDELAY_ADMIN_ADDR, only with ORDERDELAY_ADMIN_TOKEN): the
//     admin API /admin/v1, never on the producers' listener.
//   - pprof (ORDERDELAY_PPROF_ADDR, opt-in): loopback only, whatever the
//     API's auth (no token; the command line it shows holds secrets given
//     as flags), and only to requests addressed to a loopback name.
//
// ORDERDELAY_API_AUTH=none is logged as a warning here, so at every start.
// A port that cannot be bound is fatal (exit 1): another process owns it.
// On error nothing is left bound. listen binds an address (nil:
// net.Listen; tests record or fail binds).
func openListeners(cfg config.Config, api *httpapi.Server, log *zap.Logger,
	listen func(network, addr string) (net.Listener, error)) (ls []listener, err error) {
	if err := cfg.CheckExposure(); err != nil {
		return nil, usageError{err}
	}
	if listen == nil {
		listen = net.Listen
	}
	defer func() {
		if err != nil {
			for _, l := range ls {
				l.ln.Close()
			}
			ls = nil
		}
	}()
	open := func(what, addr string, h http.Handler) error {
		ln, err := listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("%s listener: %w", what, err)
		}
		ls = append(ls, listener{what: what, ln: ln, h: h})
		return nil
	}
	if cfg.HTTPAddr != "" {
		h := api.Handler()
		if cfg.Protected() {
			h = httpapi.LoopbackHostsOnly(h) // no DNS-rebinding page reads or writes /v1
		}
		if err := open("http", cfg.HTTPAddr, h); err != nil {
			return ls, err
		}
		switch {
		case cfg.APIAuth == config.AuthNone:
			log.Warn("ORDERDELAY_API_AUTH=none: the producer API /v1 takes no token, so anyone who reaches "+
				"ORDERDELAY_HTTP_ADDR can enqueue, reschedule and cancel order timeouts and tasks",
				zap.String("http_addr", cfg.HTTPAddr))
		case cfg.Protected():
			// CheckExposure judged the address; "localhost" is resolved
			// by Listen, so check what was bound.
			if !boundLoopback(ls[0].ln.Addr()) {
				return ls, usageError{&config.Error{Setting: "ORDERDELAY_HTTP_ADDR", Msg: fmt.Sprintf(
					"%q bound %s, not a loopback address, and ORDERDELAY_API_TOKEN is empty (protected mode); set ORDERDELAY_API_TOKEN "+
						"or use ORDERDELAY_HTTP_ADDR=127.0.0.1:PORT, or switch auth off with ORDERDELAY_API_AUTH=none",
					cfg.HTTPAddr, ls[0].ln.Addr())}}
			}
			log.Info("protected mode: no ORDERDELAY_API_TOKEN, so the producer API /v1 is served on the loopback address only",
				zap.String("http_addr", ls[0].ln.Addr().String()))
		}
	}
	if len(cfg.AdminTokens) > 0 {
		if err := open("admin", cfg.AdminAddr, api.AdminHandler()); err != nil {
			return ls, err
		}
	}
	if cfg.PprofAddr != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		if err := open("pprof", cfg.PprofAddr, httpapi.LoopbackHostsOnly(mux)); err != nil {
			return ls, err
		}
		if pp := ls[len(ls)-1].ln.Addr(); !boundLoopback(pp) { // "localhost" is resolved by Listen
			return ls, usageError{&config.Error{Setting: "ORDERDELAY_PPROF_ADDR", Msg: fmt.Sprintf(
				"%q bound %s, not a loopback address: pprof takes no token; use ORDERDELAY_PPROF_ADDR=127.0.0.1:PORT", cfg.PprofAddr, pp)}}
		}
	}
	return ls, nil
}

// apiAuthMode says how /v1 is guarded, for the start line: "token",
// "protected" (no token, loopback only), "none" (switched off) or "off"
// (no API listener).
func apiAuthMode(cfg config.Config) string {
	switch {
	case cfg.HTTPAddr == "":
		return "off"
	case cfg.APIAuth == config.AuthNone:
		return config.AuthNone
	case cfg.Protected():
		return "protected"
	}
	return config.AuthToken
}

// boundLoopback reports whether a bound listener's address is loopback.
func boundLoopback(a net.Addr) bool {
	t, ok := a.(*net.TCPAddr)
	return ok && t.IP.IsLoopback()
}
