#!/bin/bash
# GPU-host side: run once per arriving part, from the checkout's root, with the part's folder as argument:
#   bash tools/gpu/sglang-0.5.17/sglang_setup.sh .gpu/sglang/p1      (copies it to /tmp/sgparts)
#   bash tools/gpu/sglang-0.5.17/sglang_setup.sh .gpu/sglang/p2      ... until every part is there: then it
#                                                                    checks them, unpacks into /tmp/sgl and
#                                                                    imports the launch path once
# The last part carries NPARTS and SHA256SUMS. tools/gpu/sglang-0.5.17/sglang_live.sh finds SGLang in /tmp/sgl.
# Nothing here compiles: SGLang's own JIT kernels (tvm-ffi + nvcc) build on the first forward pass of a server.
set -u
D=/tmp/sgl P=/tmp/sgparts
mkdir -p $P
[ -n "${1:-}" ] && cp -r "$1"/. $P/
if [ ! -f $P/NPARTS ] || [ "$(ls $P/sglang.part-* 2>/dev/null | wc -l)" -lt "$(cat $P/NPARTS)" ]; then
  echo "SETUP: have $(ls $P | tr '\n' ' '), waiting for more parts"; exit 0
fi
t0=$(date +%s)
if [ ! -d $D/site/sglang ]; then
  (cd $P && sha256sum -c --quiet SHA256SUMS) || { echo "SETUP: a part is damaged"; exit 3; }
  mkdir -p $D && cat $P/sglang.part-* | xz -d -T0 | tar -x -C $D || { echo "SETUP: unpack failed"; exit 3; }
fi
# SGLang's JIT kernels are built by tvm-ffi with `ninja` from PATH (the wheel's binary, not a console script)
mkdir -p $D/bin && ln -sf $D/site/ninja-*.data/scripts/ninja $D/bin/ninja && chmod +x $D/site/ninja-*.data/scripts/ninja
echo "SETUP: unpacked in $(( $(date +%s) - t0 )) s; $D $(du -sm $D | cut -f1) MB"
# transformers 5.12.1 (SGLang's pin) before SGLang's tree, both before the host's packages; SGLang only.
export PYTHONPATH=$D/site-tf:$D/site PATH=$D/bin:$PATH
python3 - <<'PY'
import importlib, time
t = time.time()
import torch, sgl_kernel, transformers, flashinfer, xgrammar, tvm_ffi
for m in ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
          "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3", "sglang.srt.models.dflash",
          "sglang.srt.layers.attention.triton_backend", "sglang.srt.speculative.ngram_worker",
          "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.speculative.standalone_worker_v2",
          "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.layers.sampler"):
    importlib.import_module(m)
print("SETUP: imports ok in %.1fs; torch %s (cuda %s, cc %s); transformers %s; sgl_kernel %s; flashinfer %s" % (
    time.time() - t, torch.__version__, torch.cuda.is_available(),
    torch.cuda.get_device_capability() if torch.cuda.is_available() else None, transformers.__version__,
    sgl_kernel.__version__, flashinfer.__version__))
PY
rc=$?
command -v nvcc >/dev/null && nvcc --version | tail -1
echo "SETUP: ninja $(ninja --version); torch has the DLPack C exchange API (no tvm-ffi addon build): $(python3 -c 'import torch; print(hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))')"
command -v g++ >/dev/null && echo "SETUP: g++ $(g++ -dumpversion)" || echo "SETUP: no g++ (the NGRAM corpus and every JIT kernel need a C++ compiler)"
[ $rc -eq 0 ] || { echo "SETUP: the launch path does not import (above)"; exit 3; }
