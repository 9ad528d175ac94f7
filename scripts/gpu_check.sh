#!/usr/bin/env bash
# One command for a fresh GPU machine (H100/H200), run from the repository root:
#   scripts/gpu_check.sh            # results in ${OUT:-out}/gpu_check.txt (+ kernels.json)
# Sets up .venv (falls back to a python that already has torch+triton when pip cannot reach an
# index), runs the CUDA kernel tests and the kernel benchmark, then bench/throughput.py if present.
# Every step has a timeout and the whole run stays under ~8 minutes; a failed step is recorded and
# the next one still runs; the exit status is non-zero if any step failed.
set -euo pipefail

OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_check.txt"
: >"$RESULTS"
BUDGET_S=450 # leaves slack under 8 minutes
FAILED=()
PY=.venv/bin/python
export PYTHONUNBUFFERED=1 # keep the output of a step that times out

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$RESULTS"; }

# Seconds a step may take: its own limit, cut to what is left of the budget.
limit() {
    local left=$((BUDGET_S - SECONDS))
    if ((left < 10)); then left=10; fi
    echo $(($1 < left ? $1 : left))
}

# step NAME LIMIT_S CMD...: run CMD with a timeout, output appended to the results file.
step() {
    local name=$1 secs
    secs=$(limit "$2")
    shift 2
    log "== $name (timeout ${secs}s): $*"
    local rc=0
    timeout "$secs" "$@" >>"$RESULTS" 2>&1 || rc=$?
    if ((rc == 0)); then
        log "== $name: ok"
    else
        local why=""
        if ((rc == 124)); then why=" (timed out)"; fi
        log "== $name: FAILED rc=$rc$why"
        FAILED+=("$name")
    fi
    return 0
}

setup_python() {
    # GPU images usually ship torch and triton with CUDA (and often no network): use them as is.
    if python3 -c 'import torch, triton, transformers, safetensors, pytest, hypothesis
assert torch.cuda.is_available()' >/dev/null 2>&1; then
        PY=python3
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        log "using the system python3 (torch + triton + CUDA) with PYTHONPATH=$PWD"
        return
    fi
    [[ -x $PY ]] || python3 -m venv .venv
    local pip=("$PY" -m pip install -q --retries 1 --timeout 15)
    if timeout "$(limit 300)" "${pip[@]}" torch >>"$RESULTS" 2>&1 &&
        timeout "$(limit 150)" "${pip[@]}" -e '.[dev]' >>"$RESULTS" 2>&1; then
        log "installed torch and baton[dev] into .venv"
        return
    fi
    log "pip install failed and no python with torch, triton and CUDA was found"
    return 1
}

log "gpu_check in $PWD, results in $RESULTS"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    git rev-parse --short HEAD 2>/dev/null || echo "(no commit)"
    git status --short | head -20 || true
} >>"$RESULTS" 2>&1

if ! setup_python; then
    log "setup failed"
    exit 1
fi
"$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__,
    "triton", triton.__version__, "cuda", torch.cuda.is_available())' >>"$RESULTS" 2>&1 || true

unset TRITON_INTERPRET # compile for the GPU; the tests' cpu params then skip
# Without this, a CPU-only torch would make every CUDA test skip and the run look green.
step "torch sees a CUDA device" 60 "$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA"'
step "ops tests on cuda (-m gpu)" 240 "$PY" -m pytest -m gpu tests/engine/ops -q -ra -p no:cacheprovider
step "ops tests, device-independent" 60 "$PY" -m pytest -m "not gpu" tests/engine/ops -q -ra \
    -p no:cacheprovider
step "engine on cuda vs transformers (greedy oracle, async scheduling)" 150 "$PY" -m pytest -x -q \
    -p no:cacheprovider tests/engine/test_llm.py tests/engine/test_async_scheduling.py
step "models on cuda vs transformers (MoE, sliding windows, Gemma 2, GGUF)" 150 "$PY" -m pytest \
    -q -p no:cacheprovider -m "not slow" tests/engine/models
step "KV checksums on cuda (sum64 equals the host's) and --gpu-memory-utilization" 60 "$PY" -m \
    pytest -q -p no:cacheprovider tests/kv_transfer/test_checksum.py tests/engine/test_kv_budget.py
step "checksum cost per GB against a device copy" 60 "$PY" bench/checksum.py --mib 1024 \
    --json "$OUT_DIR/checksum.json"
step "kernel benchmark" 240 "$PY" bench/kernels.py --json "$OUT_DIR/kernels.json"
if [ -f bench/throughput.py ]; then
    step "throughput benchmark" 240 "$PY" bench/throughput.py --device cuda
fi

if ((${#FAILED[@]})); then
    log "done in ${SECONDS}s; FAILED: ${FAILED[*]}"
    exit 1
fi
log "done in ${SECONDS}s; all steps passed"
