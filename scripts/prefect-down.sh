#!/usr/bin/env bash
# Stop the local Prefect worker and server started by scripts/prefect-up.sh.
cd "$(dirname "$0")/.."
# The worker stops on SIGINT (not SIGTERM).
[ -f .prefect/worker.pid ] && kill -INT "$(cat .prefect/worker.pid)" 2>/dev/null && rm -f .prefect/worker.pid
[ -f .prefect/server.pid ] && kill "$(cat .prefect/server.pid)" 2>/dev/null && rm -f .prefect/server.pid
echo "stopped"
