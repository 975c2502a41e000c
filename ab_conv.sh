#!/bin/bash
# Gaussian iteration A/B (untracked; deleted after the run)
export PYTHONPATH=.:benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
echo "## gaussian_launches variants"
python3 benchmarks/gaussian_launches.py paper_128k,paper_512k,paper_1m,paper_b1_2m,gqa_32k,gqa_512k --reps 10 \
  --variants "default;conv3e4:CONV_TOL=3e-4;conv1e3:CONV_TOL=1e-3;ch8192:MAX_CH=8192;ch8192c:MAX_CH=8192 CONV_TOL=1e-3;ib512:ITER_BLOCK=512;ib2048:ITER_BLOCK=2048;iw8:ITER_WARPS=8;iw2:ITER_WARPS=2" 2>&1 | grep -v -i warn
summ() { python3 -c "
import json,sys
for l in open(sys.argv[1]):
    if l.startswith('{'):
        r=json.loads(l); print(f\"{r['config']:12s} {r['method']:10s} {r['ms']:.4f} ms  ratio {r['ratio']:.3f}  cov {r['coverage']:.4f} err {r.get('rel_err')}\")
    elif 'rror' in l: print(l.rstrip())
" $1; }
for r in 1 2; do
  for v in 1e-4 1e-3; do
    echo "## bench gaussian CONV_TOL=$v round $r"
    python3 benchmarks/bench_decode.py --configs paper_128k,paper_512k,paper_1m,paper_b1_2m,gqa_32k,gqa_512k --methods gaussian \
      --warmup 5 --reps 20 --check --set gaussian.CONV_TOL=$v --out $OUT/c_${v}_$r > $OUT/c_${v}_$r.log 2>&1
    summ $OUT/c_${v}_$r.log
  done
done
