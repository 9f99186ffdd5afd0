package tasks

import "regexp"

// userinfoInURL matches the userinfo of any URL in a text ("scheme://" up
// to the "@" before the host), slashes included: an unparsable URL's
// password may hold one. It stops at whitespace and quotes, so it never
// reaches into the next quoted value.
var userinfoInURL = regexp.MustCompile(`([a-zA-Z][a-zA-Z0-9+.\-]*://)[^\s"'@]*@`)

// redactUserinfo replaces the credentials of every URL in s with "…", so a
// transport error that quotes a proxy's URL (HTTPS_PROXY=http://user:pass@…)
// or another credentialed URL never carries them into a task's last_error
// or the log.
func redactUserinfo(s string) string { return userinfoInURL.ReplaceAllString(s, "${1}…@") }
