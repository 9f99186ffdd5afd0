#!/usr/bin/env bash
# scripts/examples-deps.sh — install what the producer examples under
# examples/ need, from the package registries (nothing is vendored):
#
#   Java     a JDK 11+ (java and javac: the example is launched from source).
#            Missing, as root: apt-get install default-jdk-headless.
#   Node.js  node 20+ and npm (missing, as root: apt-get install nodejs npm),
#            then `npm ci` in examples/node: node-redis as package-lock.json
#            pins it.
#   Python   Python 3.9+ with redis-py: `pip install -r requirements.txt`
#            into examples/python/.venv; if pip cannot (no PyPI), as root
#            apt-get install python3-redis (Debian's) for /usr/bin/python3.
#
# What is already installed is kept. examples/examples_test.go finds what
# this installed. Whatever could not be installed is named at the end; with
# CI=true that fails (exit 1), otherwise it is a warning (exit 0) and the
# test skips those examples, saying so.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

missing=()
apt_updated=''

log() { printf 'examples-deps: %s\n' "$*" >&2; }

# apt_install PKG...: as root on Debian/Ubuntu, apt-get install (after one
# apt-get update per run); anywhere else, fail.
apt_install() {
	if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
		return 1
	fi
	log "apt-get install $*"
	if [ -z "$apt_updated" ]; then
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || return 1
		apt_updated=1
	fi
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

# major VERSION: the major number of a version such as 17.0.15, v20.1.0 or
# 1.8.0_392 (Java 8).
major() {
	local v=${1#v}
	case $v in
	1.*) v=${v#1.} ;;
	esac
	printf '%s\n' "${v%%[!0-9]*}"
}

java_deps() {
	if ! command -v javac >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1; then
		apt_install default-jdk-headless || true
	fi
	local v m
	if ! command -v javac >/dev/null 2>&1 || ! command -v java >/dev/null 2>&1; then
		missing+=("Java: a JDK 11+ (java and javac; apt-get install default-jdk-headless)")
		return 0
	fi
	v=$(javac -version 2>&1 | awk '{print $2}')
	m=$(major "$v")
	if [ -z "$m" ] || [ "$m" -lt 11 ]; then
		missing+=("Java: JDK $v is too old, the example needs 11+")
		return 0
	fi
	log "java: JDK $v"
}

node_deps() {
	if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
		apt_install nodejs npm || true
	fi
	local v m
	if ! v=$(node --version 2>/dev/null) || ! command -v npm >/dev/null 2>&1; then
		missing+=("Node.js: node 20+ and npm")
		return 0
	fi
	m=$(major "$v")
	if [ -z "$m" ] || [ "$m" -lt 20 ]; then
		missing+=("Node.js: node $v is too old, node-redis needs 20+")
		return 0
	fi
	if ! (cd examples/node && npm ci --no-audit --no-fund >&2); then
		missing+=("Node.js: npm ci in examples/node failed")
		return 0
	fi
	log "node: $v, $(cd examples/node && node -p 'require("redis/package.json").name + " " + require("redis/package.json").version')"
}

# has_redis_py PYTHON: PYTHON is 3.9+ and imports redis.
has_redis_py() {
	[ -x "$1" ] && "$1" -c 'import sys, redis; assert sys.version_info >= (3, 9)' 2>/dev/null
}

python_deps() {
	local venv=examples/python/.venv py
	if has_redis_py "$venv/bin/python"; then
		log "python: $venv has redis-py $("$venv/bin/python" -c 'import redis; print(redis.__version__)')"
		return 0
	fi
	if has_redis_py /usr/bin/python3; then
		log "python: /usr/bin/python3 has redis-py $(/usr/bin/python3 -c 'import redis; print(redis.__version__)')"
		return 0
	fi
	if py=$(command -v python3); then
		rm -rf "$venv"
		if "$py" -m venv "$venv" &&
			"$venv/bin/python" -m pip install --quiet --retries 2 --timeout 20 -r examples/python/requirements.txt >&2 &&
			has_redis_py "$venv/bin/python"; then
			log "python: redis-py $("$venv/bin/python" -c 'import redis; print(redis.__version__)') installed with pip into $venv"
			return 0
		fi
		rm -rf "$venv"
		log "python: pip could not install redis-py into a venv; trying Debian's python3-redis"
	fi
	if apt_install python3 python3-redis && has_redis_py /usr/bin/python3; then
		log "python: redis-py $(/usr/bin/python3 -c 'import redis; print(redis.__version__)') installed with apt-get for /usr/bin/python3"
		return 0
	fi
	missing+=("Python: 3.9+ with redis-py (pip install -r examples/python/requirements.txt, or apt-get install python3-redis)")
}

java_deps
node_deps
python_deps

if [ ${#missing[@]} -gt 0 ]; then
	for m in "${missing[@]}"; do
		log "NOT INSTALLED: $m"
	done
	case ${CI:-} in
	1 | t | T | true | TRUE | True)
		log "CI=true: every example must run"
		exit 1
		;;
	esac
	log "go test skips the examples that need these (with CI=true it fails)"
fi
