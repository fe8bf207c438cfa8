#!/usr/bin/env bash
# One call on the lent GPU machine (see README: Development): the GPU test suite, then the quick
# benchmark, everything logged under $OUT so it comes back even if the call runs out of time.
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu-kit"])
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
source .gpu-kit/setup.sh >/dev/null || exit 1
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
# Run from the checkout whatever the editable install did (torch_fa4 imports kernels/ itself).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/machine.txt"
python -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/machine.txt"
python -m pytest ${TESTS:-tests/gpu} -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "Warning|warn|^  " | tail -40
[ "${SKIP_BENCH:-0}" = 1 ] || python benchmarks/bench.py --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -40
