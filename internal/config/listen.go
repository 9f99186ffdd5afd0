package config

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// The values of ORDERDELAY_API_AUTH.
const (
	// AuthToken: /v1 needs one of ORDERDELAY_API_TOKEN's tokens; with none
	// configured, protected mode (see Protected).
	AuthToken = "token"
	// AuthNone: /v1 needs no token, on any address. Chosen explicitly and
	// warned about at every start.
	AuthNone = "none"
)

// Protected reports protected mode: no API token and auth not switched
// off, so /v1 answers without a token and may only listen on a loopback
// address (CheckExposure refuses any other). Like Redis's protected mode,
// it keeps a forgotten token from opening the producer API to the network.
func (c *Config) Protected() bool {
	// Fails closed: any APIAuth but AuthNone (even "", a Config the loader
	// did not make) is token mode.
	return c.HTTPAddr != "" && c.APIAuth != AuthNone && len(c.APITokens) == 0
}

// CheckExposure refuses to serve /v1 without a token on an address other
// than loopback (protected mode). Only the daemon calls it: the CLI's
// commands listen on nothing and may share the daemon's environment.
//
// Protected mode concerns the listener of /v1, and /metrics and the health
// checks share it: in a pod (a non-loopback address) the daemon needs a
// token, and Prometheus and the kubelet's probes, which need none, keep
// working on the pod IP.
//
// The pprof listener has no auth at all, and /debug/pprof/cmdline shows
// settings given as flags (passwords, tokens): it may only listen on a
// loopback address, whatever the API's auth.
func (c *Config) CheckExposure() error {
	var errs []error
	if c.Protected() && !Loopback(c.HTTPAddr) {
		errs = append(errs, &Error{Setting: "ORDERDELAY_HTTP_ADDR", Msg: fmt.Sprintf(
			"%q is not a loopback address and ORDERDELAY_API_TOKEN is empty, so the producer API /v1 would answer anyone "+
				"who reaches it (protected mode refuses to start). Set ORDERDELAY_API_TOKEN, or listen on a loopback "+
				"address (ORDERDELAY_HTTP_ADDR=127.0.0.1:8080), or switch auth off explicitly with ORDERDELAY_API_AUTH=none",
			c.HTTPAddr)})
	}
	if c.PprofAddr != "" && !Loopback(c.PprofAddr) {
		errs = append(errs, &Error{Setting: "ORDERDELAY_PPROF_ADDR", Msg: fmt.Sprintf(
			"%q is not a loopback address: pprof takes no token and shows the command line, secrets given as flags "+
				"included; listen on loopback (127.0.0.1:6060) and reach it with kubectl port-forward or ssh", c.PprofAddr)})
	}
	return errors.Join(errs...)
}

// Loopback reports whether a listen address (host:port) binds loopback
// only: a loopback IP or "localhost". An empty host or an unspecified IP
// (":8080", "0.0.0.0:8080", "[::]:8080") binds every interface; other host
// names are not resolved and do not count.
func Loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// sameListener reports whether two listen addresses would bind the same
// port: the same address, or the same port where either binds every
// interface.
func sameListener(a, b string) bool {
	if a == "" || b == "" {
		return false
	}
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil || pa != pb || pa == "0" {
		return a == b
	}
	wildcard := func(h string) bool { ip := net.ParseIP(h); return h == "" || (ip != nil && ip.IsUnspecified()) }
	return ha == hb || wildcard(ha) || wildcard(hb)
}

// validateAuth checks the API's auth mode and the admin listener.
func (c *Config) validateAuth() []error {
	var errs []error
	if c.APIAuth == AuthNone && len(c.APITokens) > 0 {
		errs = append(errs, &Error{Setting: "ORDERDELAY_API_AUTH", Msg: "is none, but ORDERDELAY_API_TOKEN is set: " +
			"empty the token to switch auth off, or leave ORDERDELAY_API_AUTH at token"})
	}
	if len(c.AdminTokens) == 0 {
		return errs // admin API off: nothing binds ORDERDELAY_ADMIN_ADDR
	}
	bad := func(msg string) { errs = append(errs, &Error{Setting: "ORDERDELAY_ADMIN_ADDR", Msg: msg}) }
	switch {
	case c.AdminAddr == "":
		bad("is empty, but ORDERDELAY_ADMIN_TOKEN is set: the admin API needs a listener of its own (default 127.0.0.1:8081)")
	case sameListener(c.AdminAddr, c.HTTPAddr):
		bad(fmt.Sprintf("%q would share ORDERDELAY_HTTP_ADDR's port (%q): the admin API never shares the producers' listener", c.AdminAddr, c.HTTPAddr))
	case sameListener(c.AdminAddr, c.PprofAddr):
		bad(fmt.Sprintf("%q would share ORDERDELAY_PPROF_ADDR's port (%q)", c.AdminAddr, c.PprofAddr))
	}
	return errs
}
