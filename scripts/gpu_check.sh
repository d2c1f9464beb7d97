#!/usr/bin/env bash
# The check to run whenever a GPU is available: the machine and its packages, tests/gpu, then a
# short decode benchmark of every target, in well under 8 minutes (timeouts below).
#
#     bash scripts/gpu_check.sh            # from anywhere; OUT=dir also keeps the log there
#
# It uses the machine's own torch (never installs one: a CUDA/ROCm build must stay) and this
# checkout's sources through PYTHONPATH=src, so it needs no network; a missing package other
# than torch is installed with pip when an index is reachable, else named. With
# HYBRIDMOE_GPU_TESTS_DRY_RUN=1 on a machine without an accelerator it runs everything on the
# cpu device (tests that need CUDA skip; the benchmark takes its --small model): a check of
# this script, not of the accelerator.
# Exit status: tests/gpu's when it fails or cannot run, else the benchmark's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

PYTHON=${PYTHON:-python}
command -v "$PYTHON" >/dev/null || PYTHON=python3
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-240}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-180}
REQUIRED="torch numpy numba safetensors tokenizers transformers jinja2 tqdm pytest"
OPTIONAL="pydantic fastapi uvicorn gguf openai hypothesis"  # not used by tests/gpu nor the bench
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

section() { printf '\n=== %s ===\n' "$*"; }

describe_machine() {
    section "machine"
    nvidia-smi || rocm-smi || echo "(neither nvidia-smi nor rocm-smi found)"
    echo "CPU cores: $(nproc); locked-memory limit (ulimit -l): $(ulimit -l)"
    free -g || true
    section "python and torch"
    "$PYTHON" - <<'EOF'
import sys

import torch

print("python", sys.version.split()[0], "at", sys.executable)
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| hip", torch.version.hip)
print("accelerator available:", torch.cuda.is_available())
for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
EOF
}

# Each package's version on stderr; the names of the missing required ones on stdout.
list_packages() {
    "$PYTHON" - "$REQUIRED" "$OPTIONAL" <<'EOF'
import importlib
import sys

required, optional = sys.argv[1].split(), sys.argv[2].split()
missing = []
for name in required + optional:
    try:
        version = getattr(importlib.import_module(name), "__version__", "?")
        print(f"  {name:13s} {version}", file=sys.stderr)
    except Exception as exc:  # a broken install counts as missing
        kind = "required" if name in required else "optional"
        print(f"  {name:13s} MISSING ({kind}; {type(exc).__name__}: {exc})", file=sys.stderr)
        missing += [name] if name in required else []
print(" ".join(missing))
EOF
}

check_packages() {
    section "packages"
    local missing
    missing=$(list_packages) || return 1
    if [[ " $missing " == *" torch "* ]]; then
        echo "torch is missing: install the CUDA/ROCm build that matches this machine's driver"
        return 1
    fi
    if [[ -n "$missing" ]]; then
        echo "installing the missing required packages: $missing (torch held at its version)"
        local keep_torch status
        keep_torch=$(mktemp)
        "$PYTHON" -c 'import torch; print(f"torch=={torch.__version__}")' >"$keep_torch"
        # shellcheck disable=SC2086  # one word per package
        "$PYTHON" -m pip install --retries 0 --timeout 10 -c "$keep_torch" $missing
        status=$?
        rm -f "$keep_torch"
        if [[ $status != 0 ]]; then
            echo "could not install: $missing (no package index reachable?)"
            return 1
        fi
    fi
    "$PYTHON" -c 'import hybridmoe; print("hybridmoe from", hybridmoe.__file__)'
}

# Sets BENCH_ARGS for the device found; fails when there is none and no dry run was asked for.
choose_device() {
    BENCH_ARGS=(--tokens 64 --repeats 2)
    if "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
        return 0
    fi
    if [[ "${HYBRIDMOE_GPU_TESTS_DRY_RUN:-}" == 1 ]]; then
        echo "no accelerator: DRY RUN on the cpu device (checks this script, not a GPU)"
        BENCH_ARGS=(--device cpu --small --tokens 8)
        return 0
    fi
    echo "no accelerator visible to torch: nothing to check" \
        "(HYBRIDMOE_GPU_TESTS_DRY_RUN=1 runs a dry run on the cpu device)"
    return 1
}

run_timed() {  # run_timed SECONDS COMMAND...: the command's status; 124 when it timed out
    local limit_s=$1 status
    shift
    timeout --kill-after=10 "$limit_s" "$@"
    status=$?
    [[ $status == 124 || $status == 137 ]] && echo "TIMED OUT after ${limit_s} s: $*"
    return "$status"
}

main() {
    describe_machine
    check_packages || return 2
    choose_device || return 3
    section "tests/gpu (timeout ${PYTEST_TIMEOUT_S} s)"
    local report=()
    [[ -n "${OUT:-}" ]] && report=(--junitxml "$OUT/gpu_tests.xml")
    run_timed "$PYTEST_TIMEOUT_S" "$PYTHON" -m pytest -q -s -p no:cacheprovider \
        --durations=10 ${report[@]+"${report[@]}"} tests/gpu
    local tests_status=$?
    section "benchmarks/bench_gpu_decode.py ${BENCH_ARGS[*]} (timeout ${BENCH_TIMEOUT_S} s)"
    run_timed "$BENCH_TIMEOUT_S" "$PYTHON" benchmarks/bench_gpu_decode.py "${BENCH_ARGS[@]}"
    local bench_status=$?
    section "summary after ${SECONDS} s"
    echo "tests/gpu: $([[ $tests_status == 0 ]] && echo passed || echo "FAILED ($tests_status)")"
    echo "benchmark: $([[ $bench_status == 0 ]] && echo ran || echo "FAILED ($bench_status)")"
    [[ $tests_status != 0 ]] && return "$tests_status"
    return "$bench_status"
}

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
main 2>&1
