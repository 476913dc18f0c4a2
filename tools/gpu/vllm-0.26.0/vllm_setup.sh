#!/bin/bash
# GPU-host side: run once per arriving part, from the checkout's root, with the part's folder as argument:
#   bash tools/gpu/vllm-0.26.0/vllm_setup.sh .gpu/vllm/p1a     (copies it to /tmp/vparts)
#   bash tools/gpu/vllm-0.26.0/vllm_setup.sh .gpu/vllm/p1b
#   bash tools/gpu/vllm-0.26.0/vllm_setup.sh .gpu/vllm/p2      (all parts there: installs into /tmp/site)
# The parts may arrive together or one at a time (a transfer limit); tools/gpu/vllm_live.sh then finds
# vLLM through /tmp/site.
set -u
S=/tmp/site V=/tmp/vparts
mkdir -p $S/bin $V
cp -r "$1"/. $V/
ls $V/vllm_C.part-aa $V/vllm_C.part-ab $V/vllm_py.tar.xz >/dev/null 2>&1 || { echo "SETUP: have $(ls $V | tr '\n' ' '), waiting for more parts"; exit 0; }
t0=$(date +%s)
[ -f $S/vllm/_C_stable_libtorch.abi3.so ] || cat $V/vllm_C.part-aa $V/vllm_C.part-ab | xz -d | tar -x -C $S
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S $V/whl/*.whl 2>&1 | grep -v "already exists" | tail -5
python3 -c 'import tarfile; tarfile.open("/tmp/vparts/vllm_py.tar.xz").extractall("/tmp/site", filter="fully_trusted")'
cat > $S/bin/vllm <<'EOF'
#!/usr/bin/env python3
import sys
from vllm.entrypoints.cli.main import main
if __name__ == "__main__":  # vLLM starts its engine core with spawn/forkserver: main must not rerun
    sys.exit(main())
EOF
chmod +x $S/bin/vllm
echo "SETUP: unpacked in $(( $(date +%s) - t0 )) s; /tmp/site $(du -sm $S | cut -f1) MB"
export PYTHONPATH=$S PATH=$S/bin:$PATH
python3 - <<'EOF'
import time; t=time.time()
import torch, vllm, vllm._C_stable_libtorch
from vllm.vllm_flash_attn import flash_attn_interface as f
from vllm.entrypoints.openai import api_server
import numba, numpy
print("SETUP: imports ok in %.1fs; vllm %s torch %s cuda %s; FA2 %s FA3 %s; numba %s numpy %s" % (
    time.time()-t, vllm.__version__, torch.__version__, torch.cuda.is_available(), f.FA2_AVAILABLE, f.FA3_AVAILABLE,
    numba.__version__, numpy.__version__))
EOF
