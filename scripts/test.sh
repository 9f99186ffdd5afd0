#!/usr/bin/env bash
# scripts/test.sh — the whole test suite (what CI runs through .ci/run).
#
#   1. make Redis and PostgreSQL available (scripts/services.sh);
#   2. go vet ./... and go test -race ./... in the root module, but for the
#      producer examples;
#   3. the producer examples (examples/: Java, Python, Node.js) after
#      scripts/examples-deps.sh installed what they need, verbose so the log
#      shows each program's output;
#   4. go vet + go test in each nested module (deploy/validate, bench);
#   5. the integration tests again against private servers on free ports, so
#      the "start our own servers" path is exercised even where shared ones
#      exist (skip with ORDERDELAY_SKIP_PRIVATE=1);
#   6. a short fuzzing run of every Fuzz target (ORDERDELAY_FUZZTIME, default 10000x: a count, never a clock;
#      the two config targets that check every setting per input take a fifth of a count).
#
# Stops at the first failing step, naming it; the last line printed is
# "suite: N passed, 0 failed" on success.
#
# Environment: ORDERDELAY_SERVICES (auto|reuse|private, see services.sh),
# ORDERDELAY_TEST_REDIS_URL / ORDERDELAY_TEST_DATABASE_URL (reuse these),
# ORDERDELAY_SKIP_PRIVATE=1, ORDERDELAY_FUZZTIME (default 10000x; FuzzConfig
# and FuzzFlagTakesWhatTheVariableTakes take a fifth of a count).

# The functions run through step(), which shellcheck cannot follow.
# shellcheck disable=SC2317
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/services.sh
. scripts/services.sh

passed=0
current=''

# step NAME CMD...: run one step; on failure report it and exit non-zero.
step() {
	current=$1
	shift
	printf '\n=== %s\n' "$current"
	local start=$SECONDS
	if ! "$@"; then
		finish 1
	fi
	printf '=== %s: done in %ds\n' "$current" $((SECONDS - start))
	passed=$((passed + 1))
	current=''
}

# finish RC: stop the private servers this run started (the forced-private
# ones and those of the private-servers check; servers found already running
# are left alone), then print the summary as the very last line and exit.
finish() {
	local rc=$1
	trap - EXIT
	stop_started_services
	if [ "$rc" -eq 0 ]; then
		printf '\nsuite: %d passed, 0 failed\n' "$passed"
	else
		printf '\nsuite: step "%s" failed (exit %d); %d passed, 1 failed\n' "${current:-?}" "$rc" "$passed"
	fi
	exit "$rc"
}
trap 'finish $?' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -race needs cgo and a C compiler; a fresh machine with only Go may lack one.
preflight() {
	command -v go >/dev/null 2>&1 || { echo "go is not installed (need Go 1.26+)" >&2; return 1; }
	if ! command -v "$(go env CC)" >/dev/null 2>&1; then
		if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
			echo "installing gcc (go test -race needs cgo)" >&2
			DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
				DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev
		else
			echo "go test -race needs a C compiler: sudo apt-get install -y gcc" >&2
			return 1
		fi
	fi
	export CGO_ENABLED=1
}

# services: only servers started here because ORDERDELAY_SERVICES=private was
# forced are stopped at exit; private servers started because nothing else
# was reachable keep running for the next run (scripts/services.sh stop).
services() {
	ensure_services || return 1
	if [ "${ORDERDELAY_SERVICES:-auto}" != private ]; then
		_OD_STARTED=''
	fi
	echo "ORDERDELAY_TEST_REDIS_URL=$ORDERDELAY_TEST_REDIS_URL"
	echo "ORDERDELAY_TEST_DATABASE_URL=$ORDERDELAY_TEST_DATABASE_URL"
}

# The root module's packages but examples/, which has a step of its own.
root_tests() {
	local pkgs
	pkgs=$(go list ./... | grep -v '/examples$') || return 1
	# shellcheck disable=SC2086 # one import path per word
	go test -race -count=1 -timeout 15m $pkgs
}

nested_module() {
	(cd "$1" && go vet ./... && go test -count=1 ./...)
}

# The private-servers branch: fresh Redis and PostgreSQL on free ports, used
# only by this step, stopped afterwards (and by the EXIT trap on failure).
private_check() {
	local name log rc=0 redis_url=$ORDERDELAY_TEST_REDIS_URL db_url=$ORDERDELAY_TEST_DATABASE_URL
	name=check-$$
	start_private_services "$name" || return 1
	log=$(mktemp)
	# Subshell: the private URLs must not leak into later steps.
	(
		echo "private: $ORDERDELAY_TEST_REDIS_URL $ORDERDELAY_TEST_DATABASE_URL"
		go test -race -count=1 -run 'TestIntegration' -v ./e2e/ >"$log" 2>&1
	) || rc=$?
	stop_services "$name"
	# Back to the suite's own servers (start_private_services exported others).
	export ORDERDELAY_TEST_REDIS_URL=$redis_url ORDERDELAY_TEST_DATABASE_URL=$db_url
	if [ "$rc" -ne 0 ]; then
		cat "$log"
		rm -f "$log"
		return "$rc"
	fi
	grep -E '^(--- |ok|PASS|FAIL)' "$log" || true
	# A run where every integration test skipped would prove nothing.
	if ! grep -q '^--- PASS: TestIntegration' "$log"; then
		echo "no TestIntegration test passed against the private servers" >&2
		rm -f "$log"
		return 1
	fi
	rm -f "$log"
}

# fuzztime NAME: the -fuzztime of target NAME. FuzzConfig and
# FuzzFlagTakesWhatTheVariableTakes check every setting (37 of them) for
# each input, so one of their inputs costs what dozens of another target's
# do (at 10000x they were 120 s of the step's 200 s): they take a fifth of
# a count (2000x by default, still ~74,000 setting checks each). A
# duration is every target's as given.
fuzztime() {
	local t=${ORDERDELAY_FUZZTIME:-10000x}
	case $1 in
	FuzzConfig | FuzzFlagTakesWhatTheVariableTakes)
		if [[ $t =~ ^[0-9]+x$ ]]; then
			t=$(( (${t%x} + 4) / 5 ))x
		fi
		;;
	esac
	printf '%s\n' "$t"
}

# Fuzz every Fuzz target briefly. The targets are found in the sources of
# the module's packages (go list names their directories) rather than by
# `go test -list`, which builds every test binary first (a minute here).
fuzz_all() {
	local dir pkg name count=0 pkgs t
	pkgs=$(go list -f '{{.Dir}} {{.ImportPath}}' ./...) || { printf '%s\n' "$pkgs"; return 1; }
	while read -r dir pkg; do
		for name in $(cat "$dir"/*_test.go 2>/dev/null | sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p'); do
			t=$(fuzztime "$name")
			echo "--- fuzz $pkg $name ($t)"
			go test -run '^$' -fuzz "^${name}\$" -fuzztime "$t" "$pkg" || return 1
			count=$((count + 1))
		done
	done <<<"$pkgs"
	if [ "$count" -eq 0 ]; then
		echo "no Fuzz target found" >&2
		return 1
	fi
	echo "fuzzed $count target(s)"
}

step "preflight" preflight
step "services" services
step "go vet (root)" go vet ./...
step "go test -race (root)" root_tests
step "examples: dependencies" scripts/examples-deps.sh
step "examples: Java, Python and Node.js producers against the daemon" go test -race -count=1 -timeout 10m -v ./examples/
for dir in deploy/validate bench; do
	if [ -f "$dir/go.mod" ]; then
		step "go vet + go test ($dir)" nested_module "$dir"
	fi
done
if [ "${ORDERDELAY_SKIP_PRIVATE:-}" = 1 ]; then
	echo
	echo "=== private servers check: skipped (ORDERDELAY_SKIP_PRIVATE=1)"
else
	step "integration tests on private servers" private_check
fi
step "fuzz" fuzz_all

finish 0
