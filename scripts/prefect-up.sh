#!/usr/bin/env bash
# Start (if not running) a local Prefect server on 127.0.0.1:4200 and a process worker for the
# `capo` pool, then register the deployments in prefect.yaml. Logs: .prefect/server.log, worker.log.
# Stop them with: bash scripts/prefect-down.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CAPO_REPO="$PWD" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
mkdir -p .prefect
P=.venv/bin/prefect
if ! curl -sf http://127.0.0.1:4200/api/health >/dev/null 2>&1; then
  nohup "$P" server start --host 127.0.0.1 --port 4200 > .prefect/server.log 2>&1 &
  echo $! > .prefect/server.pid
  for _ in $(seq 1 90); do curl -sf http://127.0.0.1:4200/api/health >/dev/null 2>&1 && break; sleep 1; done
  curl -sf http://127.0.0.1:4200/api/health >/dev/null || { echo "Prefect server did not start; see .prefect/server.log" >&2; exit 1; }
fi
echo "Prefect server: http://127.0.0.1:4200 (UI)"
"$P" work-pool inspect capo >/dev/null 2>&1 || "$P" work-pool create capo --type process >/dev/null
if ! { [ -f .prefect/worker.pid ] && kill -0 "$(cat .prefect/worker.pid)" 2>/dev/null; }; then
  nohup "$P" worker start --pool capo --type process > .prefect/worker.log 2>&1 &
  echo $! > .prefect/worker.pid
fi
echo "Prefect worker: pool capo (log .prefect/worker.log)"
"$P" --no-prompt deploy --all > .prefect/deploy.log 2>&1 || { cat .prefect/deploy.log >&2; exit 1; }
"$P" deployment ls
