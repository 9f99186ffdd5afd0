package queue

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// onceCmd is a script call the client must not send again on its own: a
// go-redis client retries a command whose connection broke (EOF, a reset)
// on a new connection, and when the break came after the server ran the
// script, the script runs twice with the same arguments. For the claim
// that is a second claim under the same lease token, which wrote its batch
// over the first's (the first batch's members, still leased under the
// token, were then named by no batch and never re-claimed). Without the
// retry the caller sees the error, and what the lost run leased comes back
// when its lease expires.
type onceCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to resend the command once it may have
// reached the server.
func (onceCmd) NoRetry() bool { return true }

// runOnce runs script s as Script.Run does (EVALSHA, and on NOSCRIPT the
// script is loaded and EVALSHA sent again: a NOSCRIPT reply means it did
// not run), but never lets the client resend a call that may have run.
func runOnce(ctx context.Context, rdb redis.UniversalClient, s *redis.Script, keys []string, args ...any) *redis.Cmd {
	call := func() *redis.Cmd {
		a := make([]any, 0, 3+len(keys)+len(args))
		a = append(a, "evalsha", s.Hash(), len(keys))
		for _, k := range keys {
			a = append(a, k)
		}
		a = append(a, args...)
		cmd := redis.NewCmd(ctx, a...)
		_ = rdb.Process(ctx, onceCmd{cmd}) // the error is cmd's
		return cmd
	}
	cmd := call()
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		if err := s.Load(ctx, rdb).Err(); err != nil {
			return cmd
		}
		cmd = call()
	}
	return cmd
}
