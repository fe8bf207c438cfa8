#!/usr/bin/env bash
# On a CUDA sm_90 machine: the GPU test suite, then the quick benchmark, everything logged under
# $OUT (so a run that is cut short still leaves its logs).
#   bash scripts/gpu_check.sh
# TESTS: test files or node ids (default tests/gpu); PYTEST_ARGS: more pytest arguments, parsed
# with shell quoting (e.g. PYTEST_ARGS="-k 'alibi or mod'");
# JOBS: parallel pytest processes sharing the GPU (default 3). The suite is bound by kernel
# compiles on the host's CPUs, not by the GPU, so the collected tests are dealt out round-robin
# to JOBS processes (on one H100, two processes ran 196 backward tests in 6.5 min, another pair
# 205 tests in 4.8 min; one process took ~8 min for the backward file's 250).
# Compiled kernels are cached with atomic renames, so the processes may share the cache.
# SKIP_BENCH=1 leaves the benchmark out.
set -u
OUT=${OUT:-gpu_out}
JOBS=${JOBS:-3}
mkdir -p "$OUT"
# an optional local environment set-up (CUDA toolkit paths, peers), kept outside git
if [ -f .gpu-kit/setup.sh ]; then source .gpu-kit/setup.sh >/dev/null || exit 1; fi
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
# Run from the checkout whatever the editable install did (torch_fa4 imports kernels/ itself).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/machine.txt"
python -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/machine.txt"

eval "pytest_args=(${PYTEST_ARGS:-})"  # quoted -k expressions stay one argument
# shellcheck disable=SC2086  # TESTS is a word list
python -m pytest ${TESTS:-tests/gpu} "${pytest_args[@]}" -q -p no:cacheprovider --collect-only 2>/dev/null \
    | grep "::" > "$OUT/test_ids.txt"
echo "$(wc -l < "$OUT/test_ids.txt") tests in $JOBS processes"
if [ ! -s "$OUT/test_ids.txt" ]; then  # a selection that matches nothing is no pass
    echo "GPU tests: FAILED (no tests collected)"
    exit 1
fi
pids=()
for ((i = 0; i < JOBS; i++)); do
    awk -v n="$JOBS" -v i="$i" 'NR % n == i' "$OUT/test_ids.txt" > "$OUT/test_ids_$i.txt"
    [ -s "$OUT/test_ids_$i.txt" ] || continue
    # one argument per node id (ids hold brackets and spaces-free parameter strings)
    xargs -a "$OUT/test_ids_$i.txt" -d '\n' python -m pytest -q -p no:cacheprovider -rfE \
        > "$OUT/gpu_tests_$i.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for ((i = 0; i < JOBS; i++)); do
    [ -f "$OUT/gpu_tests_$i.log" ] && grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_$i.log" | tail -15
done
echo "GPU tests: $([ $status = 0 ] && echo passed || echo FAILED)"

[ "${SKIP_BENCH:-0}" = 1 ] || python benchmarks/bench.py --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -40
exit $status
