#!/usr/bin/env bash
# The check to run whenever a GPU is available: the machine and its packages, tests/gpu, then a
# short decode benchmark of every target. It fits a 10-minute window that includes the
# machine's start: at most TOTAL_BUDGET_S (420) seconds of work, every step under a timeout,
# and a hang prints every thread's traceback (faulthandler: a test running past
# FAULTHANDLER_TIMEOUT_S, or a step killed at its timeout with SIGABRT).
#
#     bash scripts/gpu_check.sh            # from anywhere; OUT=dir also keeps the log there
#
# It uses the machine's own torch (never installs one: a CUDA/ROCm build must stay) and this
# checkout's sources through PYTHONPATH=src, so it needs no network; a missing package other
# than torch is installed with pip when an index is reachable, else named. With
# HYBRIDMOE_GPU_TESTS_DRY_RUN=1 on a machine without an accelerator it runs everything on the
# cpu device (tests that need CUDA skip; the benchmark takes its --small model): a check of
# this script, not of the accelerator.
# The benchmark runs the small model first (seconds), then the ~1B-parameter one with what is
# left of the budget, if enough is.
# Exit status: tests/gpu's when it fails or cannot run, else the benchmark's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

PYTHON=${PYTHON:-python}
command -v "$PYTHON" >/dev/null || PYTHON=python3
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-420}  # all the work; the machine's start comes on top
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-240}
FAULTHANDLER_TIMEOUT_S=${FAULTHANDLER_TIMEOUT_S:-120}  # one test this long: tracebacks printed
PIP_TIMEOUT_S=${PIP_TIMEOUT_S:-60}
SMALL_BENCH_TIMEOUT_S=${SMALL_BENCH_TIMEOUT_S:-60}
FULL_BENCH_MIN_S=${FULL_BENCH_MIN_S:-120}  # the 1B benchmark runs only with this much left
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
        run_timed "$PIP_TIMEOUT_S" "$PYTHON" -m pip install --retries 0 --timeout 10 \
            -c "$keep_torch" $missing
        status=$?
        rm -f "$keep_torch"
        if [[ $status != 0 ]]; then
            echo "could not install: $missing (no package index reachable?)"
            return 1
        fi
    fi
    "$PYTHON" -c 'import hybridmoe; print("hybridmoe from", hybridmoe.__file__)'
}

# Sets SMALL_BENCH_ARGS and FULL_BENCH_ARGS (empty: not run) for the device found; fails when
# there is none and no dry run was asked for.
choose_device() {
    SMALL_BENCH_ARGS=(--small --tokens 32 --repeats 2)
    FULL_BENCH_ARGS=(--tokens 32 --repeats 1)
    if "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
        return 0
    fi
    if [[ "${HYBRIDMOE_GPU_TESTS_DRY_RUN:-}" == 1 ]]; then
        echo "no accelerator: DRY RUN on the cpu device (checks this script, not a GPU)"
        SMALL_BENCH_ARGS=(--device cpu --small --tokens 8)
        FULL_BENCH_ARGS=()
        return 0
    fi
    echo "no accelerator visible to torch: nothing to check" \
        "(HYBRIDMOE_GPU_TESTS_DRY_RUN=1 runs a dry run on the cpu device)"
    return 1
}

# run_timed SECONDS COMMAND...: the command's status; 124 when it timed out. At the timeout it
# gets SIGABRT, on which a Python started with -X faulthandler prints every thread's traceback;
# SIGKILL 10 s later.
run_timed() {
    local limit_s=$1 status
    shift
    if ((limit_s <= 0)); then
        echo "NO TIME LEFT in the budget for: $*"
        return 124
    fi
    timeout --signal=ABRT --kill-after=10 "$limit_s" "$@"
    status=$?
    [[ $status == 124 || $status == 137 ]] && echo "TIMED OUT after ${limit_s} s: $*"
    return "$status"
}

left_s() {  # seconds of TOTAL_BUDGET_S not used yet, minus a margin for the summary
    echo $((TOTAL_BUDGET_S - SECONDS - 10))
}

min() { echo $(($1 < $2 ? $1 : $2)); }

run_benchmarks() {  # the small model, then the ~1B one if enough time is left
    local limit_s status
    limit_s=$(min "$SMALL_BENCH_TIMEOUT_S" "$(left_s)")
    section "benchmarks/bench_gpu_decode.py ${SMALL_BENCH_ARGS[*]} (timeout ${limit_s} s)"
    run_timed "$limit_s" "$PYTHON" -X faulthandler benchmarks/bench_gpu_decode.py \
        "${SMALL_BENCH_ARGS[@]}"
    status=$?
    ((${#FULL_BENCH_ARGS[@]})) || return "$status"
    limit_s=$(left_s)
    section "benchmarks/bench_gpu_decode.py ${FULL_BENCH_ARGS[*]} (timeout ${limit_s} s)"
    if ((limit_s < FULL_BENCH_MIN_S)); then
        echo "skipped: ${limit_s} s left, it needs ${FULL_BENCH_MIN_S} s"
        return "$status"
    fi
    run_timed "$limit_s" "$PYTHON" -X faulthandler benchmarks/bench_gpu_decode.py \
        "${FULL_BENCH_ARGS[@]}"
    local full_status=$?
    ((status != 0)) && return "$status"
    return "$full_status"
}

main() {
    describe_machine
    check_packages || return 2
    choose_device || return 3
    local limit_s
    limit_s=$(min "$PYTEST_TIMEOUT_S" "$(left_s)")
    section "tests/gpu (timeout ${limit_s} s; tracebacks after ${FAULTHANDLER_TIMEOUT_S} s in a test)"
    local report=()
    [[ -n "${OUT:-}" ]] && report=(--junitxml "$OUT/gpu_tests.xml")
    run_timed "$limit_s" "$PYTHON" -X faulthandler -m pytest -q -s -p no:cacheprovider \
        -o faulthandler_timeout="$FAULTHANDLER_TIMEOUT_S" --durations=10 \
        ${report[@]+"${report[@]}"} tests/gpu
    local tests_status=$?
    run_benchmarks
    local bench_status=$?
    section "summary after ${SECONDS} s (budget ${TOTAL_BUDGET_S} s)"
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
