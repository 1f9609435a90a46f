"""Static SASS of registered kernels (sm_90): per basic block with many FFMA/HMMA, instructions
per FMA and the opcode mix. NUMBA_ENABLE_CUDASIM=0; NVDISASM names nvdisasm."""
import re, subprocess, sys, tempfile, collections, os
from numba_flash import ptx as P, registry
NVD = os.environ.get("NVDISASM", "nvdisasm")

def sass(ptx):
    ptx = re.sub(r"\.version \d+\.\d+", ".version 9.0", ptx)
    with tempfile.TemporaryDirectory() as td:
        open(f"{td}/k.ptx", "w").write(ptx)
        r = subprocess.run([P.find_ptxas(), "-arch=sm_90", "-v", "-o", f"{td}/k.cubin", f"{td}/k.ptx"],
                           check=True, capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", r.stderr).group(1)
        return regs, subprocess.run([NVD, "-c", f"{td}/k.cubin"], capture_output=True, text=True, check=True).stdout

def report(name, ptx):
    regs, text = sass(ptx)
    blocks, cur = [], []
    for line in text.splitlines():
        if re.match(r"^\s*\.L_x_\d+:", line):
            blocks.append(cur); cur = []
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", line)
        if m:
            cur.append(m.group(1))
    blocks.append(cur)
    print(f"== {name}: {regs} registers")
    for b in blocks:
        c = collections.Counter(b)
        f = c["FFMA"] + c["DFMA"] + c["HMMA"]
        if f >= 16:
            print(f"  {len(b)} instr, FMA {f}: {len(b) / f:.2f} per FMA; " + ", ".join(f"{k} {v}" for k, v in c.most_common(8)))

if __name__ == "__main__":
    for spec in registry.specialisations():
        if any(s in spec.name for s in sys.argv[1:]):
            report(spec.name, P.compile_spec(spec, (9, 0)))
