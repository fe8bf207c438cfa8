SKIP_BENCH=1 JOBS=4 TESTS="tests/gpu/test_sm90_fwd.py tests/gpu/test_end_to_end.py tests/gpu/test_mod_lowering.py tests/gpu/test_sdpa_hf.py" bash scripts/gpu_check.sh 2>&1 | tail -6
source .gpu-kit/setup.sh >/dev/null; pip install -q --no-deps .gpu-kit/flash_attn_4-*.whl .gpu-kit/quack_kernels-*.whl >/dev/null 2>&1; export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
cd benchmarks
timeout 200 python clock_probe.py --turns 4 --seconds 1.0 --rows 128:16384:0,96:16384:0 --variant 'off={"env": {"TORCH_FA4_FWD_SPLIT_TAIL": "0"}}' --out $OUT/s3.json 2>&1 | grep "S16k:"
