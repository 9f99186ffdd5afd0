#!/usr/bin/env bash
# scripts/demo.sh — run the daemon's demo (a simulated checkout closing its
# own unpaid orders) against a usable Redis and PostgreSQL.
#
# The demo creates its own database (orderdelay_demo) on the server named by
# ORDERDELAY_DATABASE_URL, using that URL's credentials, and uses its own key
# prefix, so it never touches real orders. Extra arguments go to the demo:
#   ./scripts/demo.sh --help
#
# Servers come from scripts/services.sh (reuse 127.0.0.1:6379/5432, else
# private ones on free ports, left running for next time; stop them with
# `scripts/services.sh stop`). ORDERDELAY_REDIS_URL / ORDERDELAY_DATABASE_URL,
# when both are already set, are used as they are.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/services.sh
. scripts/services.sh

command -v go >/dev/null 2>&1 || { echo "go is not installed (need Go 1.26+)" >&2; exit 1; }

if [ -z "${ORDERDELAY_REDIS_URL:-}" ] || [ -z "${ORDERDELAY_DATABASE_URL:-}" ]; then
	ensure_services
	# The maintenance database URL: the demo creates orderdelay_demo beside it.
	export ORDERDELAY_REDIS_URL=$ORDERDELAY_TEST_REDIS_URL
	export ORDERDELAY_DATABASE_URL=$ORDERDELAY_TEST_DATABASE_URL
fi
# Show where it runs, with any password masked.
mask() { printf '%s\n' "$1" | sed 's#://\([^:@/]*\):[^@/]*@#://\1:***@#'; }
echo "demo: Redis $(mask "$ORDERDELAY_REDIS_URL"), PostgreSQL $(mask "$ORDERDELAY_DATABASE_URL")" >&2

exec go run ./cmd/orderdelay demo "$@"
