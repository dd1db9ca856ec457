#!/usr/bin/env bash
# One device call: correctness on the GPU first, then every benchmark. Results under $OUT (or bench/results).
# Usage on the GPU machine (repo root): bash bench/gpu_suite.sh [parity|bench|all] [op ...]
set -uo pipefail
DEST=${OUT:-bench/results}
OUT=$(mktemp -d)   # many files: packed into $DEST/results.tgz at the end
mkdir -p "$DEST"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
what=${1:-all}; shift || true
ops=("$@")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m kernelgate doctor > "$OUT/doctor.txt" 2>&1; cat "$OUT/doctor.txt"
python3 -m kernelgate doctor --platform xpu > "$OUT/doctor-xpu.txt" 2>&1
if [[ $what == parity || $what == all ]]; then
  timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_parity.py ${ops:+-k "$(IFS='|'; echo "${ops[*]}")"} \
    2>&1 | tail -n 60 | tee "$OUT/parity.txt"
fi
if [[ $what == bench || $what == all ]]; then
  [[ ${#ops[@]} -eq 0 ]] && ops=(all)
  for op in "${ops[@]}"; do
    timeout 300 python3 -m kernelgate bench "$op" --out "$OUT" 2>&1 | grep -v "^wrote" | tee -a "$OUT/bench.txt"
  done
fi
tar czf "$DEST/results.tgz" -C "$OUT" .
cat "$OUT"/*.md > "$DEST/summary.md" 2>/dev/null || true
