"""Static SASS of rung 8 candidates (sm_90; needs ptxas and nvdisasm): per basic block holding
HMMA, its instruction count and opcode mix. NUMBA_ENABLE_CUDASIM=0, run from the repo root."""
import re, subprocess, sys, tempfile, collections, os
sys.path.insert(0, "wip")
from numba import cuda
from numba_flash import ptx as P
from numba_flash.ladder import _host, k08_tensor_cores as k8
import k08_pairs as kp
import k08_fast as kf
NVD = os.environ.get("NVDISASM", "nvdisasm")

def sass(kern):
    ptx, _ = cuda.compile_ptx(kern.py_func, _host.SIGNATURE, cc=(9, 0), launch_bounds=(kern.threads, 1))
    ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx)
    with tempfile.TemporaryDirectory() as td:
        open(f"{td}/k.ptx", "w").write(ptx)
        r = subprocess.run([P.find_ptxas(), "-arch=sm_90", "-v", "-o", f"{td}/k.cubin", f"{td}/k.ptx"],
                           check=True, capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", r.stderr).group(1)
        return regs, subprocess.run([NVD, "-c", f"{td}/k.cubin"], capture_output=True, text=True, check=True).stdout

for name, kern in [("rung 8", k8.make_kernel(**k8.GPU_TILES)), ("rung 8 fast split", kf.make_kernel(**kf.GPU_TILES)),
                   ("pairs", kp.make_kernel(4, 64, 256, 32)), ("pairs fast split", kp.make_kernel(4, 64, 256, 32, True))]:
    regs, text = sass(kern)
    blocks, cur = [], []
    for line in text.splitlines():
        if re.match(r"^\s*\.L_x_\d+:", line):
            blocks.append(cur); cur = []
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", line)
        if m:
            cur.append(m.group(1))
    blocks.append(cur)
    print(f"== {name}: {regs} registers, {sum(map(len, blocks))} instructions")
    for b in blocks:
        c = collections.Counter(b)
        if c["HMMA"] >= 12:
            print(f"  {len(b)} instr, HMMA {c['HMMA']}: {len(b) / c['HMMA']:.1f} per HMMA; "
                  + ", ".join(f"{k} {v}" for k, v in c.most_common(7)))
