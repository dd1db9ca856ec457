#!/usr/bin/env bash
# One device call: correctness on the GPU first, then benchmarks; everything is logged and
# packed into $OUT/results.tgz (+ $OUT/summary.md). Run from the repo root on the GPU machine.
#   bash bench/gpu_suite.sh parity bench:gated_rms_norm bench:fused_experts:nocompile 'py:bench/ops/kda_decode.py'
# The wheels it installs (carry ".whl"; a fresh checkout has none): fla-core and transformers 5.24 for
# the models' parity, starlette / uvicorn / httptools / pydantic for `kernelgate serve` (the image has none):
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download -q --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl fla-core==0.6.0 transformers==5.24.0 starlette uvicorn httptools pydantic pydantic-core \
#     annotated-types typing-inspection typing_extensions
# 'sh:...' steps inherit PYTHONPATH, which puts the carried wheels (/tmp/site: fla-core, transformers)
# first: extend it (PYTHONPATH=$PYTHONPATH:bench/e2e), never replace it -- Session 22 lost a call to a
# probe that ran without fla (every KDA layer on the torch reference, 5x slower).
set -uo pipefail
DEST=${OUT:-bench/results}
RES=$(mktemp -d)
mkdir -p "$DEST"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# Triton's compile + autotune cache survives between device calls: carry the parts a previous call
# returned (.triton-cache/part.*, ignored by git) and they are unpacked before anything compiles.
# When .triton-cache grows towards the carry limit, bench/repack_triton_cache.sh merges it into xz parts.
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
if ls .triton-cache/part.* >/dev/null 2>&1; then
  cat .triton-cache/part.* | tar xzf - -C "$TRITON_CACHE_DIR" && echo "triton cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) unpacked"
fi
if ls .triton-cache/xz.* >/dev/null 2>&1; then   # (the same, repacked with xz where gzip's parts exceed the carry limit)
  cat .triton-cache/xz.* | xz -dc | tar xf - -C "$TRITON_CACHE_DIR" && echo "triton cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) unpacked"
fi
for first in .triton-cache/new-*.0; do             # what earlier calls added (below), each call's own parts
  [ -e "$first" ] && cat "${first%.0}".* | tar xzf - -C "$TRITON_CACHE_DIR" && echo "triton cache: + ${first%.0}"
done
STAMP=$(mktemp) && sleep 1                         # entries newer than this are this call's
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$RES/gpu.txt"
python3 -m kernelgate doctor > "$RES/doctor.txt" 2>&1
KERNELGATE_PLATFORM=xpu python3 -m kernelgate doctor > "$RES/doctor-xpu.txt" 2>&1
for step in "$@"; do
  STEP_T=$STEP_TIMEOUT
  if [[ $step =~ ^(.*)@([0-9]+)$ ]]; then step=${BASH_REMATCH[1]}; STEP_T=${BASH_REMATCH[2]}; fi   # 'step@seconds'
  echo "=== $step ($(date +%T))"
  case $step in
    parity*)
      filt=${step#parity}; filt=${filt#:}
      timeout "$STEP_T" python3 -m pytest -v -n 16 -p no:cacheprovider tests/test_parity.py ${filt:+-k "$filt"} \
        > "$RES/parity.txt" 2>&1
      grep -E "FAILED|ERROR|[0-9]+ passed|failed" "$RES/parity.txt" | sort | uniq | tail -n 60 ;;
    bench:*)
      spec=${step#bench:}; op=${spec%%:*}; extra=(); [[ $spec == *:nocompile ]] && extra=(--no-compile)
      timeout "$STEP_T" python3 -m kernelgate bench "$op" "${extra[@]}" --out "$RES" 2>&1 | grep -v "^wrote" ;;
    py:*)
      cmd=${step#py:}; name=$(basename "${cmd%% *}" .py); [ -e "$RES/$name.txt" ] && name=$name-$(date +%H%M%S)
      timeout "$STEP_T" python3 $cmd 2>&1 | tee "$RES/$name.txt" | tail -n 40 ;;
    sh:*)
      timeout "$STEP_T" bash -c "${step#sh:}" 2>&1 | tail -n 40 ;;
  esac
done
tar czf "$DEST/results.tgz" -C "$RES" .
mkdir -p "$DEST/triton-cache"
# only what this call compiled or autotuned (the whole cache exceeds the carry limit): <= 16 MiB per file back
new=new-$(date +%Y%m%d%H%M%S)
(cd "$TRITON_CACHE_DIR" && find . -type f -newer "$STAMP" -print0 | tar czf - --null -T -) \
  | split -b 15M -d -a 1 - "$DEST/triton-cache/$new."
echo "triton cache: $(find "$TRITON_CACHE_DIR" -type f -newer "$STAMP" | wc -l) new files, $(du -sh "$DEST/triton-cache" | cut -f1) packed" \
     "(copy $DEST/triton-cache/$new.* to .triton-cache to carry them)"
cat "$RES"/*.md > "$DEST/summary.md" 2>/dev/null || true
