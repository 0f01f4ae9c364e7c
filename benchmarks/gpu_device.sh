#!/usr/bin/env bash
# The GPU checks in one command on a machine with one CUDA GPU, within a 10-minute limit:
#
#   bash benchmarks/gpu_device.sh            # from the repository root (the package need not be installed)
#
# 1. Python packages: wheels in .whl/ (if any) are installed into /tmp/site with no index (a
#    machine that reaches no registry); then `benchmarks.gpu` must import and CUDA must be there.
# 2. `python -m benchmarks.gpu` with CHECK_BUDGET_S seconds (its phases past it are skipped, said in
#    the table; `python -m benchmarks.gpu --plan` lists them): JSON and log into $OUT.
# 3. The GPU-only tests (`pytest -m gpu`) with the time left of TOTAL_S.
#
# Everything lands in $OUT (default ./gpu-out): bench-gpu.json, bench-gpu.log, pytest-gpu.log,
# nvidia-smi.txt. Exit status: the GPU check's if it failed (1: a check failed), else pytest's.
# docs/benchmarks.md ("The GPU check in one device call") says how to read them.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
TOTAL_S="${TOTAL_S:-570}"  # the whole script
CHECK_BUDGET_S="${CHECK_BUDGET_S:-400}"  # the GPU check's --budget-s; the tests get what is left
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'EOF' || { echo "cannot start (above): a missing package's wheel goes in .whl/ (docs/benchmarks.md)"; exit 2; }
import torch

assert torch.cuda.is_available(), "no CUDA device"
import benchmarks.gpu  # noqa: F401 - everything the check imports at start
import transformers  # noqa: F401 - the engines' random models and the HF baseline
import triton  # noqa: F401
EOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

python3 -m benchmarks.gpu --budget-s "$CHECK_BUDGET_S" --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.log"
check=${PIPESTATUS[0]}

left=$((TOTAL_S - ($(date +%s) - start)))
if ((left > 60)); then
    # every test file is collected (a file whose imports are missing here is reported, not fatal)
    timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests 2>&1 \
        | tee "$OUT/pytest-gpu.log"
    tests=${PIPESTATUS[0]}
else
    echo "pytest -m gpu not run: ${left}s left of ${TOTAL_S}s" | tee "$OUT/pytest-gpu.log"
    tests=124
fi
echo "benchmarks.gpu exit ${check}, pytest -m gpu exit ${tests}, $(($(date +%s) - start))s"
if ((check != 0)); then exit "$check"; fi
exit "$tests"
