# One GPU call (~8 min), from the repo root, after the .whl install line (carry [".whl"]):
#   bash wip/gpu-next.sh
set -o pipefail
timeout 150 python -m pytest -n 8 -q -p no:cacheprovider tests/test_ops.py tests/test_ladder.py tests/test_plans.py tests/test_backward.py -k "not large and not determinism_large" -rf 2>&1 | grep -v -i "benchmark\|warner" | tail -8
timeout 150 python wip/sweep_k08.py 2>&1 | grep -v Warn | tee $OUT/sweep_k08.txt
timeout 90 python bench.py ladder --json $OUT/bench-ladder.json 2>&1 | grep "^ *[0-9] "
timeout 90 python wip/bench_k5dk64.py $OUT/bench-ladder-k5dk64.json 2>&1 | grep "^ *[0-9] "
