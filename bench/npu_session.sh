#!/usr/bin/env bash
# What npu_attn's Ascend path still needs from a machine with an Ascend NPU, in one run.
#
# Nothing NPU has run on hardware: the `npu` strategy, the DeviceManager's NPU branch and
# torchair graph mode are checked against torch_npu 2.13.0's schemas and sources only
# (docs/ascend-npu.md). On an Ascend host (CANN installed, its set_env.sh sourced, torch_npu
# matching torch) this runs, in order:
#   1. the environment: CANN toolkit and driver versions, npu-smi, torch / torch_npu versions;
#   2. `python -m npu_attn doctor` (devices, dtypes that work, every strategy's self-test, and its
#      Ascend section: CANN/driver versions and the fused kernel against the CPU kernel);
#   3. the fused attention (`npu` strategy) on the NPU against npu_attn's CPU kernel and a
#      float64 reference on the same inputs: float16 and bfloat16, no mask / bool / additive /
#      key-padding masks, causal, GQA;
#   4. the NPU tests of the suite (translation, release boundary, DeviceManager);
#   5. the demo on the NPU (every strategy, one table) and one torchair-compiled step.
# Usage: bash bench/npu_session.sh [python]   (default: .venv/bin/python); logs in bench_out/npu/
set -euo pipefail
PY=${1:-.venv/bin/python}
OUT=bench_out/npu
mkdir -p "$OUT"

if ! "$PY" -c "import torch_npu, torch; assert torch.npu.is_available()" 2>"$OUT/import.log"; then
  echo "torch_npu does not import or sees no NPU (see $OUT/import.log): source CANN's" \
    "set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) and check npu-smi" >&2
  exit 1
fi

echo "== 1. environment" | tee "$OUT/environment.txt"
{
  for info in /usr/local/Ascend/ascend-toolkit/latest/*/ascend_toolkit_install.info \
    /usr/local/Ascend/driver/version.info; do
    [ -f "$info" ] && echo "$info:" && cat "$info"
  done
  command -v npu-smi >/dev/null && npu-smi info
  "$PY" -c "import torch, torch_npu; print('torch', torch.__version__, 'torch_npu',
    torch_npu.__version__, 'devices', torch.npu.device_count())"
} 2>&1 | tee -a "$OUT/environment.txt"

echo "== 2. doctor"
"$PY" -m npu_attn doctor | tee "$OUT/doctor.log"

echo "== 3. fused attention on the NPU against the CPU kernel and float64"
"$PY" - <<'PYTHON' | tee "$OUT/fused_attention.log"
import torch, torch_npu  # noqa: F401
import npu_attn

torch.manual_seed(0)
B, H, HK, L, S, D = 2, 8, 2, 333, 77, 64
cases = {
    "plain": {},
    "bool mask": {"attn_mask": torch.rand(L, S) > 0.2},
    "additive mask": {"attn_mask": torch.randn(B, 1, L, S)},
    "key padding (B,1,1,S)": {"attn_mask": torch.rand(B, 1, 1, S) > 0.2},
    "causal": {"is_causal": True},
}
for dtype in (torch.float16, torch.bfloat16):
    for gqa in (False, True):
        q = torch.randn(B, H, L, D)
        k, v = (torch.randn(B, HK if gqa else H, S, D) for _ in range(2))
        for name, kw in cases.items():
            kw = dict(kw, enable_gqa=gqa)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(),
                **{**kw, "attn_mask": None if kw.get("attn_mask") is None
                   else kw["attn_mask"].double() if kw["attn_mask"].dtype != torch.bool
                   else kw["attn_mask"]})
            args = [t.to(dtype) for t in (q, k, v)]
            cpu = npu_attn.scaled_dot_product_attention(*args, backend="tiled", **kw)
            npu_kw = {**kw, "attn_mask": None if kw.get("attn_mask") is None
                      else kw["attn_mask"].npu()}
            out = npu_attn.scaled_dot_product_attention(
                *(t.npu() for t in args), backend="npu", **npu_kw).cpu()
            e_npu = float((out.double() - ref).abs().max())
            e_cpu = float((cpu.double() - ref).abs().max())
            print(f"{str(dtype)[6:]:8} gqa={gqa!s:5} {name:22} npu err {e_npu:.2e}  "
                  f"cpu tiled err {e_cpu:.2e}  {'OK' if e_npu <= 4 * e_cpu + 1e-3 else 'CHECK'}")
PYTHON

echo "== 4. the NPU tests"
"$PY" -m pytest -q tests/py/test_npu_backend.py tests/py/test_torch_npu_release.py \
  tests/py/test_device_manager.py | tee "$OUT/tests.log"

echo "== 5. the demo on the NPU, and a torchair-compiled step"
"$PY" -m npu_attn demo --steps 3 --out "$OUT/demo" | tee "$OUT/demo.log"
"$PY" - <<'PYTHON' | tee "$OUT/torchair.log"
import time
import torch, torch_npu  # noqa: F401
import npu_attn
from npu_attn.tools.pipelines import build_pipeline, prompt_embeddings

pipe = build_pipeline("sd15").to("npu", torch.float16)
pipe.set_progress_bar_config(disable=True)
embeds = prompt_embeddings(pipe, torch.float16, "npu")
print(npu_attn.compile(pipe, "npu"))  # backend None: torchair on the NPU
for label in ("first step (compiles)", "second step"):
    start = time.perf_counter()
    pipe(**embeds, num_inference_steps=1, output_type="latent")
    torch.npu.synchronize()
    print(label, f"{time.perf_counter() - start:.2f} s")
PYTHON
echo "done: $OUT"
