#!/usr/bin/env bash
# scripts/services.sh — make Redis (>= 6.2) and PostgreSQL available for the
# demo and the test suite.
#
# Sourced:   . scripts/services.sh; ensure_services
#            -> exports ORDERDELAY_TEST_REDIS_URL and ORDERDELAY_TEST_DATABASE_URL
#               (the database URL is an admin URL: CREATE DATABASE works on it).
# Executed:  scripts/services.sh [ensure|start|stop [NAME|all]|status|help]
#
# Order of preference (ensure_services):
#   a. reuse: URLs already set in the environment, else servers answering on
#      127.0.0.1:6379 / 127.0.0.1:5432 (PostgreSQL with trust auth, user
#      "postgres" or the current user, allowed to CREATE DATABASE);
#   b. private: redis-server and initdb/pg_ctl from installed binaries, on free
#      ports, with their data under $ORDERDELAY_SERVICES_DIR
#      (default ${TMPDIR:-/tmp}/orderdelay-services-<user>); they keep running
#      for the next run — stop them with `scripts/services.sh stop`;
#   c. install: as root with apt-get, install what is missing, then b;
#   d. otherwise stop with a message saying what to install.
#
# ORDERDELAY_SERVICES=auto (default) | reuse (a only) | private (b/c only,
# ignoring pre-set URLs and shared servers).
#
# Safety: this script only ever stops servers it started itself (recorded in
# an instance directory it created). It never stops, flushes or reconfigures
# the shared servers on 6379/5432.
#
# When sourced, the caller's shell options are left alone; functions return
# non-zero on failure instead of relying on `set -e`.

_od_log() { printf 'services: %s\n' "$*" >&2; }

# Base directory for private instances: one subdirectory per instance.
_od_base_dir() {
	printf '%s\n' "${ORDERDELAY_SERVICES_DIR:-${TMPDIR:-/tmp}/orderdelay-services-$(id -un)}"
}

# Directories of private instances started by this shell (space-separated);
# stop_started_services stops exactly these.
_OD_STARTED=${_OD_STARTED:-}

# ---------------------------------------------------------------------------
# Probing
# ---------------------------------------------------------------------------

# _od_port_open PORT: true if something accepts TCP on 127.0.0.1:PORT.
_od_port_open() {
	# shellcheck disable=SC2016 # $1 is expanded by the inner bash
	timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$1" 2>/dev/null
}

# _od_redis_version PORT: print the server's redis_version, or fail.
# Uses redis-cli when installed, else speaks RESP over bash's /dev/tcp.
_od_redis_version() {
	local port=$1 out
	# shellcheck disable=SC2016 # $1 is expanded by the inner bash
	if command -v redis-cli >/dev/null 2>&1; then
		out=$(timeout 5 redis-cli -h 127.0.0.1 -p "$port" info server 2>/dev/null) || return 1
	else
		out=$(timeout 5 bash -c '
			exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
			printf "INFO server\r\n" >&3
			while IFS= read -r -t 2 line <&3; do
				printf "%s\n" "$line"
				case $line in redis_version:*) exit 0 ;; esac
			done
			exit 1' _ "$port" 2>/dev/null) || return 1
	fi
	out=$(printf '%s\n' "$out" | tr -d '\r' | sed -n 's/^redis_version://p')
	[ -n "$out" ] || return 1
	printf '%s\n' "$out"
}

# _od_version_ge A B: true if dotted version A >= B.
_od_version_ge() {
	[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

# _od_pg_url USER PORT: the admin URL we hand out.
_od_pg_url() {
	printf 'postgres://%s@127.0.0.1:%s/postgres?sslmode=disable\n' "$1" "$2"
}

# _od_pg_usable URL: true if URL connects without a password and its role may
# create databases. Without psql we can only check the port (warned).
_od_pg_usable() {
	local url=$1 ok
	if ! command -v psql >/dev/null 2>&1; then
		return 1
	fi
	ok=$(PGCONNECT_TIMEOUT=3 timeout 10 psql "$url" -w -XAtq \
		-c 'SELECT rolsuper OR rolcreatedb FROM pg_roles WHERE rolname = current_user' 2>/dev/null) || return 1
	[ "$ok" = t ]
}

# _od_reuse_redis: set ORDERDELAY_TEST_REDIS_URL to a reachable shared Redis.
_od_reuse_redis() {
	local v
	if [ -n "${ORDERDELAY_TEST_REDIS_URL:-}" ]; then
		_od_log "Redis: using ORDERDELAY_TEST_REDIS_URL from the environment"
		return 0
	fi
	v=$(_od_redis_version 6379) || return 1
	if ! _od_version_ge "$v" 6.2; then
		_od_log "Redis on 127.0.0.1:6379 is $v; orderdelay needs >= 6.2, not using it"
		return 1
	fi
	ORDERDELAY_TEST_REDIS_URL=redis://127.0.0.1:6379/0
	_od_log "Redis: reusing $v on 127.0.0.1:6379"
}

# _od_reuse_postgres: set ORDERDELAY_TEST_DATABASE_URL to a reachable shared
# PostgreSQL with trust auth for "postgres" or the current user.
_od_reuse_postgres() {
	local user url
	if [ -n "${ORDERDELAY_TEST_DATABASE_URL:-}" ]; then
		_od_log "PostgreSQL: using ORDERDELAY_TEST_DATABASE_URL from the environment"
		return 0
	fi
	if command -v pg_isready >/dev/null 2>&1; then
		timeout 5 pg_isready -q -h 127.0.0.1 -p 5432 || return 1
	else
		_od_port_open 5432 || return 1
	fi
	if ! command -v psql >/dev/null 2>&1; then
		_od_log "PostgreSQL: something listens on 5432 but psql is not installed to check it"
		return 1
	fi
	for user in postgres "$(id -un)"; do
		url=$(_od_pg_url "$user" 5432)
		if _od_pg_usable "$url"; then
			ORDERDELAY_TEST_DATABASE_URL=$url
			_od_log "PostgreSQL: reusing 127.0.0.1:5432 as user $user"
			return 0
		fi
	done
	_od_log "PostgreSQL on 127.0.0.1:5432 does not let postgres or $(id -un) in without a password (or CREATE DATABASE); not using it"
	return 1
}

# ---------------------------------------------------------------------------
# Private servers
# ---------------------------------------------------------------------------

# _od_free_port: print a TCP port nothing listens on (never 6379/5432).
_od_free_port() {
	local port
	for _ in $(seq 1 200); do
		port=$((20000 + (RANDOM * 32768 + RANDOM) % 30000))
		case $port in 6379 | 5432) continue ;; esac
		if command -v ss >/dev/null 2>&1; then
			[ -z "$(ss -Hltn "sport = :$port" 2>/dev/null)" ] || continue
		fi
		_od_port_open "$port" && continue
		printf '%s\n' "$port"
		return 0
	done
	_od_log "could not find a free TCP port"
	return 1
}

# _od_pg_bindir: directory holding initdb and pg_ctl (PATH first, then the
# newest /usr/lib/postgresql/*/bin).
_od_pg_bindir() {
	local d
	if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
		d=$(dirname "$(command -v initdb)")
		[ -x "$d/pg_ctl" ] && { printf '%s\n' "$d"; return 0; }
	fi
	for d in $(printf '%s\n' /usr/lib/postgresql/*/bin /usr/pgsql-*/bin | sort -V -r); do
		if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
			printf '%s\n' "$d"
			return 0
		fi
	done
	return 1
}

# _od_have_binaries: true if redis-server (>= 6.2) and initdb/pg_ctl exist.
_od_have_redis() {
	local v
	command -v redis-server >/dev/null 2>&1 || return 1
	v=$(redis-server --version 2>/dev/null | sed -n 's/.* v=\([0-9.]*\).*/\1/p')
	if [ -z "$v" ] || ! _od_version_ge "$v" 6.2; then
		_od_log "redis-server ${v:-(unknown version)} is too old; orderdelay needs >= 6.2"
		return 1
	fi
}
_od_have_binaries() { _od_have_redis && _od_pg_bindir >/dev/null; }

# _od_install: as root on Debian/Ubuntu, apt-get install what is missing.
_od_install() {
	local pkgs=()
	_od_have_redis || pkgs+=(redis-server)
	_od_pg_bindir >/dev/null || pkgs+=(postgresql)
	command -v psql >/dev/null 2>&1 || pkgs+=(postgresql-client)
	[ ${#pkgs[@]} -gt 0 ] || return 0
	if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
		return 1
	fi
	_od_log "installing ${pkgs[*]} with apt-get"
	# Debian's packages may try to start system services; without systemd or
	# with a restrictive policy-rc.d that fails harmlessly — we start our own.
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2
}

# _od_pg_user: the account PostgreSQL runs as. PostgreSQL refuses root, so as
# root we drop to "postgres" (created by Debian's package) or, failing that,
# to a system user "orderdelay-pg" that we create.
_od_pg_user() {
	if [ "$(id -u)" -ne 0 ]; then
		id -un
		return 0
	fi
	if id postgres >/dev/null 2>&1; then
		echo postgres
		return 0
	fi
	if ! id orderdelay-pg >/dev/null 2>&1; then
		useradd --system --no-create-home --shell /usr/sbin/nologin orderdelay-pg >&2 || return 1
	fi
	echo orderdelay-pg
}

# _od_as USER CMD...: run CMD as USER (directly when that is us).
_od_as() {
	local user=$1
	shift
	if [ "$user" = "$(id -un)" ]; then
		"$@"
	else
		runuser -u "$user" -- "$@"
	fi
}

# _od_read_instance DIR: load REDIS_PORT, PG_PORT, PG_USER, PG_BIN from
# DIR/instance.env (parsed, not sourced).
_od_read_instance() {
	local key val
	REDIS_PORT='' PG_PORT='' PG_USER='' PG_BIN=''
	[ -f "$1/instance.env" ] || return 1
	while IFS='=' read -r key val; do
		case $key in
		REDIS_PORT) REDIS_PORT=$val ;;
		PG_PORT) PG_PORT=$val ;;
		PG_USER) PG_USER=$val ;;
		PG_BIN) PG_BIN=$val ;;
		esac
	done <"$1/instance.env"
	case $REDIS_PORT$PG_PORT in *[!0-9]* | '') return 1 ;; esac
}

# _od_instance_alive DIR: true if both private servers of DIR answer.
_od_instance_alive() {
	local REDIS_PORT PG_PORT PG_USER PG_BIN
	_od_read_instance "$1" || return 1
	_od_redis_version "$REDIS_PORT" >/dev/null || return 1
	_od_pg_usable "$(_od_pg_url postgres "$PG_PORT")"
}

# _od_export_instance DIR: export the URLs of instance DIR.
_od_export_instance() {
	local REDIS_PORT PG_PORT PG_USER PG_BIN
	_od_read_instance "$1" || return 1
	export ORDERDELAY_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
	export ORDERDELAY_TEST_DATABASE_URL
	ORDERDELAY_TEST_DATABASE_URL=$(_od_pg_url postgres "$PG_PORT")
}

# _od_prepare_base: create the base directory, refusing one we do not own.
_od_prepare_base() {
	local base
	base=$(_od_base_dir)
	mkdir -p "$base" || return 1
	if [ -L "$base" ] || [ ! -O "$base" ]; then
		_od_log "$base is not a directory owned by $(id -un); set ORDERDELAY_SERVICES_DIR"
		return 1
	fi
	# World-traversable so the PostgreSQL user can reach its data directory.
	chmod 755 "$base"
	printf '%s\n' "$base"
}

# _od_close_lock: in a subshell about to start a daemon, close the lock file
# descriptor of _od_ensure_private so the daemon does not inherit (and hold)
# the lock for its whole life.
_od_close_lock() {
	if [ -n "${_od_lock_fd:-}" ]; then
		exec {_od_lock_fd}>&-
	fi
}

# start_private_services NAME: start Redis and PostgreSQL on free ports in
# instance directory BASE/NAME and export their URLs. The instance must not
# already exist (use stop_services NAME first).
start_private_services() {
	local name=${1:-default} base dir pg_user pg_bin redis_port pg_port
	_od_have_binaries || { _od_install && _od_have_binaries; } || {
		_od_missing_message
		return 1
	}
	base=$(_od_prepare_base) || return 1
	dir=$base/$name
	if [ -e "$dir" ]; then
		_od_log "instance $dir already exists; stop it first: scripts/services.sh stop $name"
		return 1
	fi
	pg_user=$(_od_pg_user) || return 1
	pg_bin=$(_od_pg_bindir) || return 1
	mkdir -m 755 "$dir" || return 1
	mkdir -m 700 "$dir/redis" "$dir/pg" || return 1
	[ "$pg_user" = "$(id -un)" ] || chown "$pg_user" "$dir/pg" || return 1
	if ! _od_as "$pg_user" test -w "$dir/pg"; then
		_od_log "user $pg_user cannot write $dir/pg; set ORDERDELAY_SERVICES_DIR to a directory it can reach"
		rm -rf "$dir"
		return 1
	fi
	_OD_STARTED="$_OD_STARTED $dir"

	# Redis: no persistence, loopback only. Retry if the port was taken
	# between choosing and binding.
	for _ in 1 2 3 4 5; do
		redis_port=$(_od_free_port) || return 1
		if (
			_od_close_lock
			redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
				--daemonize yes --dir "$dir/redis" --logfile "$dir/redis/redis.log" \
				--pidfile "$dir/redis/redis.pid" >&2
		); then
			# daemonize returns before the listener is up; wait for it.
			for _ in $(seq 1 50); do
				_od_redis_version "$redis_port" >/dev/null && break
				sleep 0.1
			done
			_od_redis_version "$redis_port" >/dev/null && break
		fi
		redis_port=''
	done
	if [ -z "$redis_port" ]; then
		_od_log "private redis-server did not start; see $dir/redis/redis.log"
		return 1
	fi
	printf 'REDIS_PORT=%s\n' "$redis_port" >"$dir/instance.env"

	# PostgreSQL: our own cluster with trust auth (apt's default cluster
	# requires passwords over TCP), unix socket inside the instance dir.
	if ! (_od_close_lock && cd "$dir/pg" && _od_as "$pg_user" "$pg_bin/initdb" -D "$dir/pg/data" \
		-A trust -U postgres -E UTF8 --no-locale --no-sync >"$dir/initdb.log" 2>&1); then
		_od_log "initdb failed; see $dir/initdb.log"
		return 1
	fi
	for _ in 1 2 3 4 5; do
		pg_port=$(_od_free_port) || return 1
		if (_od_close_lock && cd "$dir/pg" && _od_as "$pg_user" "$pg_bin/pg_ctl" -D "$dir/pg/data" \
			-l "$dir/pg/postgres.log" -w -t 60 \
			-o "-p $pg_port -k $dir/pg -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" \
			start >/dev/null 2>&1); then
			break
		fi
		pg_port=''
	done
	if [ -z "$pg_port" ]; then
		_od_log "private PostgreSQL did not start; see $dir/pg/postgres.log"
		return 1
	fi
	printf 'PG_PORT=%s\nPG_USER=%s\nPG_BIN=%s\n' "$pg_port" "$pg_user" "$pg_bin" >>"$dir/instance.env"

	_od_export_instance "$dir" || return 1
	_od_log "started private Redis on 127.0.0.1:$redis_port and PostgreSQL on 127.0.0.1:$pg_port (data in $dir)"
	_od_log "stop them with: scripts/services.sh stop${name:+ $name}"
}

# stop_services [NAME|all]: stop private instance NAME (default "default"),
# or every instance under the base directory. Only touches servers recorded
# in an instance directory we created.
stop_services() {
	local name=${1:-default} base dir
	base=$(_od_base_dir)
	if [ "$name" = all ]; then
		for dir in "$base"/*/; do
			[ -d "$dir" ] && _od_stop_dir "${dir%/}"
		done
		return 0
	fi
	_od_stop_dir "$base/$name"
}

# _od_stop_dir DIR: stop the servers of instance DIR and remove it.
_od_stop_dir() {
	local dir=$1 REDIS_PORT PG_PORT PG_USER PG_BIN pid
	[ -d "$dir" ] || return 0
	_od_read_instance "$dir" 2>/dev/null || true
	case $REDIS_PORT in 6379) REDIS_PORT='' ;; esac # never the shared server
	# Redis: by the pid file we wrote (not by port, so never the shared one).
	if [ -f "$dir/redis/redis.pid" ]; then
		pid=$(cat "$dir/redis/redis.pid")
		if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
			for _ in $(seq 1 50); do
				kill -0 "$pid" 2>/dev/null || break
				sleep 0.1
			done
		fi
	fi
	# PostgreSQL: pg_ctl on our own data directory.
	if [ -f "$dir/pg/data/postmaster.pid" ]; then
		[ -n "$PG_BIN" ] || PG_BIN=$(_od_pg_bindir)
		[ -n "$PG_USER" ] || PG_USER=$(stat -c %U "$dir/pg/data")
		(cd "$dir/pg" && _od_as "$PG_USER" "$PG_BIN/pg_ctl" -D "$dir/pg/data" -m fast -w -t 60 stop >/dev/null 2>&1) ||
			_od_log "pg_ctl stop failed for $dir (see $dir/pg/postgres.log)"
	fi
	rm -rf "$dir"
	_od_log "stopped private servers in $dir${REDIS_PORT:+ (Redis $REDIS_PORT, PostgreSQL ${PG_PORT:-?})}"
	_od_forget "$dir"
}

_od_forget() {
	local d kept=''
	for d in $_OD_STARTED; do
		[ "$d" = "$1" ] || kept="$kept $d"
	done
	_OD_STARTED=$kept
}

# stop_started_services: stop only the private instances this shell started.
stop_started_services() {
	local d
	for d in $_OD_STARTED; do
		_od_stop_dir "$d"
	done
	_OD_STARTED=''
}

# status_services: list private instances and whether they answer.
status_services() {
	local base dir state
	base=$(_od_base_dir)
	for dir in "$base"/*/; do
		[ -d "$dir" ] || continue
		dir=${dir%/}
		if _od_instance_alive "$dir"; then state=running; else state='not answering'; fi
		(
			_od_read_instance "$dir" || true
			printf '%s: %s (Redis 127.0.0.1:%s, PostgreSQL 127.0.0.1:%s)\n' \
				"${dir##*/}" "$state" "${REDIS_PORT:-?}" "${PG_PORT:-?}"
		)
	done
}

_od_missing_message() {
	local missing=''
	_od_have_redis 2>/dev/null || missing="$missing redis-server(>=6.2)"
	_od_pg_bindir >/dev/null || missing="$missing initdb/pg_ctl(postgresql)"
	command -v psql >/dev/null 2>&1 || missing="$missing psql(postgresql-client)"
	_od_log "missing:${missing:- nothing?}"
	cat >&2 <<'EOF'
services: no usable Redis (>= 6.2) and PostgreSQL.
  Either start them on 127.0.0.1:6379 and 127.0.0.1:5432 (PostgreSQL with
  trust auth for user postgres or your user), or set
  ORDERDELAY_TEST_REDIS_URL / ORDERDELAY_TEST_DATABASE_URL, or install the
  binaries so private servers can be started:
      sudo apt-get install -y redis-server postgresql
  (re-run as root and this script installs them itself). Redis must be
  >= 6.2: on Ubuntu 22.04, whose redis-server is 6.0, use packages.redis.io.
EOF
}

# _od_ensure_private: reuse the "default" private instance if it still
# answers, else (re)start it. Serialised with flock when available so two
# concurrent runs do not both start one.
_od_ensure_private() {
	local base dir
	base=$(_od_prepare_base) || return 1
	dir=$base/default
	if command -v flock >/dev/null 2>&1; then
		exec {_od_lock_fd}>"$base/lock" || return 1
		flock -w 180 "$_od_lock_fd" || { _od_log "timed out waiting for $base/lock"; return 1; }
	fi
	if _od_instance_alive "$dir"; then
		_od_export_instance "$dir"
		_od_log "reusing private servers in $dir (stop with: scripts/services.sh stop)"
	else
		# A stale instance (e.g. after a reboot): clean it up and start afresh.
		[ ! -e "$dir" ] || _od_stop_dir "$dir"
		start_private_services default
	fi
	local rc=$?
	if [ -n "${_od_lock_fd:-}" ]; then
		exec {_od_lock_fd}>&-
		unset _od_lock_fd
	fi
	return $rc
}

# ensure_services: see the header. Exports ORDERDELAY_TEST_REDIS_URL and
# ORDERDELAY_TEST_DATABASE_URL.
ensure_services() {
	local mode=${ORDERDELAY_SERVICES:-auto}
	case $mode in
	auto | reuse) ;;
	private)
		unset ORDERDELAY_TEST_REDIS_URL ORDERDELAY_TEST_DATABASE_URL
		_od_ensure_private || return 1
		return 0
		;;
	*)
		_od_log "ORDERDELAY_SERVICES must be auto, reuse or private (got '$mode')"
		return 1
		;;
	esac
	# a. reuse what is configured or reachable.
	if _od_reuse_redis && _od_reuse_postgres; then
		export ORDERDELAY_TEST_REDIS_URL ORDERDELAY_TEST_DATABASE_URL
		return 0
	fi
	if [ "$mode" = reuse ]; then
		_od_log "ORDERDELAY_SERVICES=reuse but no usable shared servers"
		_od_missing_message
		return 1
	fi
	# b/c. Private servers for both (simpler than mixing a shared Redis with
	# a private PostgreSQL; URLs set in the environment are still honoured).
	local keep_redis=${ORDERDELAY_TEST_REDIS_URL:-} keep_db=${ORDERDELAY_TEST_DATABASE_URL:-}
	_od_ensure_private || return 1
	if [ -n "$keep_redis" ] && [ "$keep_redis" != redis://127.0.0.1:6379/0 ]; then
		ORDERDELAY_TEST_REDIS_URL=$keep_redis
	fi
	[ -z "$keep_db" ] || ORDERDELAY_TEST_DATABASE_URL=$keep_db
	export ORDERDELAY_TEST_REDIS_URL ORDERDELAY_TEST_DATABASE_URL
}

# ---------------------------------------------------------------------------
# Executed directly
# ---------------------------------------------------------------------------
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
	set -euo pipefail
	case ${1:-ensure} in
	ensure | env)
		ensure_services
		printf 'export ORDERDELAY_TEST_REDIS_URL=%q\n' "$ORDERDELAY_TEST_REDIS_URL"
		printf 'export ORDERDELAY_TEST_DATABASE_URL=%q\n' "$ORDERDELAY_TEST_DATABASE_URL"
		;;
	start)
		ORDERDELAY_SERVICES=private ensure_services
		printf 'export ORDERDELAY_TEST_REDIS_URL=%q\n' "$ORDERDELAY_TEST_REDIS_URL"
		printf 'export ORDERDELAY_TEST_DATABASE_URL=%q\n' "$ORDERDELAY_TEST_DATABASE_URL"
		;;
	stop) stop_services "${2:-default}" ;;
	status) status_services ;;
	help | -h | --help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0" ;;
	*)
		echo "usage: $0 [ensure|start|stop [NAME|all]|status|help]" >&2
		exit 2
		;;
	esac
fi
