package tasks

import (
	"bytes"
	"fmt"
)

// checkSecretSpace refuses a webhook secret with leading or trailing
// whitespace. The secret is the HMAC key byte for byte: a trailing newline
// (common with kubectl create secret --from-file) would silently become
// part of the key, and receivers that trim it would reject every
// signature. Trimming silently would instead sign with a key other than
// the one configured; the daemon refuses and says why. The error names
// the setting and the variable, never the secret.
func checkSecretSpace(where, setting, env string, secret []byte) error {
	if len(bytes.TrimSpace(secret)) == len(secret) {
		return nil
	}
	return fmt.Errorf("%s: action.%s: %s has leading or trailing whitespace (a newline from a file?); "+
		"the secret is the HMAC key byte for byte, so remove it (e.g. printf %%s \"$secret\", or kubectl create secret --from-literal)",
		where, setting, env)
}
