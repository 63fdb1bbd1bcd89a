#!/usr/bin/env bash
# From a fresh clone: install, convert the embedded models, ingest GSM8K, start a local Prefect
# server + process worker (127.0.0.1, analytics off), register the deployments, and run one real
# CAPO round (`capo-round/default`, round 1) while watching it. Re-running it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/capo setup --config configs/default.yaml
bash scripts/prefect-up.sh
ROUND=${ROUND:-1}
.venv/bin/prefect deployment run 'capo-round/default' -p round="$ROUND" --watch
.venv/bin/capo sql "SELECT \"table\", stage, rows, elapsed_s FROM manifests WHERE path LIKE '%/default/round_$(printf %03d "$ROUND")/%' ORDER BY created_at"
