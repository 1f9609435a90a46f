import sys, runpy
import numba_flash.ladder.k05_float4 as m
m.GPU_TILES.update(DK=64)
assert m.TILES["DK"] == 64
sys.argv = ["bench.py", "ladder", "--json", sys.argv[1]]
runpy.run_path("bench.py", run_name="__main__")
