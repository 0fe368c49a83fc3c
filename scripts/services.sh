#!/usr/bin/env bash
# The team configuration's services, on 127.0.0.1 only:
#   scripts/services.sh up DIR     Postgres (a cluster in DIR/postgres), an S3 server (moto's standalone
#                                  server), the MLflow tracking server (Postgres backend store, artifacts
#                                  proxied to S3 with --serve-artifacts), dagster-daemon and the webserver
#                                  (Postgres instance: deploy/team/dagster.yaml). Writes DIR/env.sh: the
#                                  environment that selects the team configuration for any client.
#   scripts/services.sh down DIR   stops exactly what `up` started (pids in DIR/pids, then the cluster).
# Credentials are generated into DIR/env.sh (mode 600); nothing listens beyond 127.0.0.1.
# Ports: free ones, chosen at `up`; VLM_SERVICES_WEB_PORT fixes the webserver's.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd=${1:?usage: services.sh up|down DIR}
dir=${2:?usage: services.sh up|down DIR}
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
# runuser lives in /usr/sbin, which a non-login root shell (cron, `env -i`, some CI agents) lacks on PATH.
PATH="$PATH:/usr/sbin:/sbin"
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
# Postgres refuses to run as root: as root, its processes run as the `postgres` user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

running() {  # PID: the process exists and is not a zombie
  local state
  state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
  [ -n "$state" ] && [ "$state" != Z ]
}

any_recorded_running() {
  local name pid
  while read -r name pid; do running "$pid" && return 0; done < "$dir/pids"
  return 1
}

stop_recorded() {
  [ -f "$dir/pids" ] || return 0
  # each service leads its own process group (setsid): its workers go with it
  tac "$dir/pids" | while read -r name pid; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 100); do  # 20 s of grace, then SIGKILL
    any_recorded_running || break
    sleep 0.2
  done
  while read -r name pid; do kill -9 -- "-$pid" 2>/dev/null || true; done < "$dir/pids"
  # SIGKILL is not an exit: a large process takes a while to go on a loaded machine. Return once they are
  # gone, as `down` promises (bounded only against a process the kernel cannot end).
  for _ in $(seq 1 3000); do
    any_recorded_running || break
    sleep 0.2
  done
  rm -f "$dir/pids"
}

if [ "$cmd" = down ]; then
  stop_recorded
  if [ -f "$dir/postgres/data/postmaster.pid" ] && [ -n "$(pg_bin)" ]; then
    as_pg "$(pg_bin)/pg_ctl" -D "$dir/postgres/data" -m fast -w stop >/dev/null || true
  fi
  echo "services in $dir stopped"
  exit 0
fi
[ "$cmd" = up ] || { echo "usage: services.sh up|down DIR" >&2; exit 2; }
[ -f "$dir/pids" ] && { echo "services already up in $dir (scripts/services.sh down $dir first)" >&2; exit 1; }

source "$repo/scripts/bootstrap.sh" >/dev/null
if [ -z "$(pg_bin)" ]; then
  echo "== installing Postgres (Debian's postgresql package)"
  # a fresh machine may have empty or stale package lists: refresh them once if the install fails
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null; }
fi
PG="$(pg_bin)"
if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$dir"; then
  echo "$dir must be reachable by the postgres user (Postgres does not run as root): use a directory whose parents are world-executable, e.g. under /var/tmp" >&2
  exit 1
fi
port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
secret() { python -c 'import secrets; print(secrets.token_hex(16))'; }
mkdir -p "$dir/logs" "$dir/dagster"
: > "$dir/pids"

pg_port=$(port); pg_password=$(secret)
if [ ! -f "$dir/postgres/data/PG_VERSION" ]; then
  mkdir -p "$dir/postgres"
  [ "$(id -u)" = 0 ] && chown postgres "$dir/postgres"
  printf '%s\n' "$pg_password" > "$dir/postgres/.pw" && chmod 600 "$dir/postgres/.pw"
  [ "$(id -u)" = 0 ] && chown postgres "$dir/postgres/.pw"
  as_pg "$PG/initdb" -D "$dir/postgres/data" -U vlm --pwfile="$dir/postgres/.pw" --auth=scram-sha-256 >/dev/null
  rm -f "$dir/postgres/.pw"
  printf '%s\n' "$pg_password" > "$dir/pg_password" && chmod 600 "$dir/pg_password"
fi
pg_password=$(cat "$dir/pg_password")
as_pg "$PG/pg_ctl" -D "$dir/postgres/data" -w -l "$dir/postgres/postgres.log" \
  -o "-c listen_addresses=127.0.0.1 -p $pg_port -k $dir/postgres" start >/dev/null
export PGPASSWORD="$pg_password"
for db in dagster mlflow; do
  "$PG/psql" -h 127.0.0.1 -p "$pg_port" -U vlm -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$db'" \
    | grep -q 1 || "$PG/createdb" -h 127.0.0.1 -p "$pg_port" -U vlm "$db"
done
unset PGPASSWORD

s3_port=$(port); mlflow_port=$(port); web_port=${VLM_SERVICES_WEB_PORT:-$(port)}
cat > "$dir/env.sh" <<EOF
# The team configuration (scripts/services.sh up $dir): source this file.
export DAGSTER_HOME=$dir/dagster
export DAGSTER_PG_HOST=127.0.0.1 DAGSTER_PG_PORT=$pg_port DAGSTER_PG_USER=vlm DAGSTER_PG_DB=dagster
export DAGSTER_PG_PASSWORD=$pg_password
export VLM_ASSETS_HOME=$dir/home
export VLM_ASSETS_STORE=s3 VLM_ASSETS_S3_BUCKET=vlm-assets VLM_ASSETS_S3_PREFIX=artifacts
export AWS_ENDPOINT_URL=http://127.0.0.1:$s3_port S3_ENDPOINT_URL=http://127.0.0.1:$s3_port AWS_DEFAULT_REGION=us-east-1
export AWS_ACCESS_KEY_ID=vlm AWS_SECRET_ACCESS_KEY=$(secret)
export MLFLOW_TRACKING_URI=http://127.0.0.1:$mlflow_port
export VLM_SERVICES_WEBSERVER=http://127.0.0.1:$web_port
EOF
chmod 600 "$dir/env.sh"
source "$dir/env.sh"
cp "$repo/deploy/team/dagster.yaml" "$DAGSTER_HOME/dagster.yaml"

# Until URL answers, or the server's process has exited (the bound only turns a hang into a failure);
# one Python process polls, rather than one started per poll.
wait_http() {  # URL NAME LOG PID
  python - "$1" "$4" <<'PY' && return 0
import os, sys, time, urllib.request
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(url, timeout=2)
        sys.exit(0)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"its process {pid} exited")
    time.sleep(0.2)
sys.exit("no answer in 600 s")
PY
  echo "$2 did not come up; its log:" >&2; tail -n 30 "$3" >&2; exit 1
}

setsid moto_server -H 127.0.0.1 -p "$s3_port" > "$dir/logs/s3.log" 2>&1 &
s3_pid=$!
echo "s3 $s3_pid" >> "$dir/pids"
wait_http "$AWS_ENDPOINT_URL/moto-api/" "the S3 server" "$dir/logs/s3.log" "$s3_pid"
python -c "import boto3; boto3.client('s3').create_bucket(Bucket='$VLM_ASSETS_S3_BUCKET')"

# MLflow: runs and the model registry in Postgres; artifacts proxied by the server to S3
# (--serve-artifacts: clients need no S3 credentials for them). Its job runners (huey consumers for the
# GenAI jobs: scorers, prompt optimization) are off: nothing here submits a job, and each of the seven
# would take a core for seconds at every start.
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_S3_ENDPOINT_URL=$AWS_ENDPOINT_URL setsid mlflow server --host 127.0.0.1 --port "$mlflow_port" --workers 2 \
  --backend-store-uri "postgresql://vlm:$pg_password@127.0.0.1:$pg_port/mlflow" \
  --serve-artifacts --artifacts-destination "s3://$VLM_ASSETS_S3_BUCKET/mlflow" \
  > "$dir/logs/mlflow.log" 2>&1 &
mlflow_pid=$!
echo "mlflow $mlflow_pid" >> "$dir/pids"

# An instance written by an older Dagster is brought to this version's schema (idempotent).
dagster instance migrate > "$dir/logs/migrate.log" 2>&1 || { cat "$dir/logs/migrate.log" >&2; exit 1; }
(cd "$repo" && exec setsid dagster-daemon run -w workspace.yaml) > "$dir/logs/daemon.log" 2>&1 &
echo "dagster-daemon $!" >> "$dir/pids"
(cd "$repo" && exec setsid dagster-webserver -h 127.0.0.1 -p "$web_port" -w workspace.yaml) > "$dir/logs/webserver.log" 2>&1 &
web_pid=$!
echo "dagster-webserver $web_pid" >> "$dir/pids"
wait_http "$MLFLOW_TRACKING_URI/health" "the MLflow server" "$dir/logs/mlflow.log" "$mlflow_pid"
wait_http "$VLM_SERVICES_WEBSERVER/server_info" "the Dagster webserver" "$dir/logs/webserver.log" "$web_pid"
echo "services up in $dir: Postgres 127.0.0.1:$pg_port, S3 $AWS_ENDPOINT_URL, MLflow $MLFLOW_TRACKING_URI, Dagster $VLM_SERVICES_WEBSERVER"
echo "use them: source $dir/env.sh"
