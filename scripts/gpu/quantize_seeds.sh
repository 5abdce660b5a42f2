#!/usr/bin/env bash
# 2.0-bpw SmolLM2 files at the defaults (exllamav3's corpus, 250 rows, refitted scales), one per
# seed, made on the device machine's cores with the CUDA tile search (the same bytes as the CPU's),
# each evaluated on exllamav3's slice against the Q4_1 file's distributions (NOTES.md, session 31).
# Staged beforehand: /tmp/stash/c0* (the split `tar | gzip -1` of the Q4_1 GGUF, cal.safetensors
# from scripts/exllamav3_calibration.py and eval.txt, carried 28 MiB a call) and .device/dev.tgz
# (`trellm`). SEEDS="..." picks the seeds; finished seeds are skipped, a cut run resumes.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
W=/tmp/xq
mkdir -p $W
[ -x /tmp/trellm ] || tar xzf .device/dev.tgz -C /tmp
T=/tmp/trellm
[ -f $W/eval.txt ] || cat /tmp/stash/c0* | tar xzf - -C $W
(lscpu | grep -E "Model name|^CPU\(s\)"; nproc; nvidia-smi --query-gpu=name --format=csv) > $OUT/machine.txt 2>&1
cat $OUT/machine.txt
G=$W/SmolLM2-135M-Instruct.Q4_1.gguf
[ -d $W/src/.source ] || $T quantize --model $G --out $W/src --bits 4 --calib-rows 0 --stop-after-layers 1 -q > $OUT/src.log 2>&1
[ -f $W/base.kld ] || $T eval --model $G --file $W/eval.txt --chunks 40 --save-logits $W/base.kld -q --json > $W/base.json 2>&1
echo "prep (t=${SECONDS}s)"; head -c 300 $W/base.json; echo
for seed in ${SEEDS:-1 3 4 5 6 7 8}; do
    [ -f $W/eval-2-s$seed.json ] && continue
    t0=$SECONDS
    $T quantize --model $W/src/.source --out $W/q2-s$seed --bits 2 --seed $seed --calibration $W/cal.safetensors --device cuda -q > $W/quantize-s$seed.log 2>&1 || { echo "seed $seed: quantize failed"; tail -3 $W/quantize-s$seed.log; break; }
    t1=$SECONDS
    $T eval --model $W/q2-s$seed --file $W/eval.txt --chunks 40 --kl-base $W/base.kld --json -q > $W/eval-2-s$seed.json 2>$W/eval-s$seed.err
    echo "seed $seed: quantize $((t1 - t0)) s, eval $((SECONDS - t1)) s (t=${SECONDS}s): $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["kld_mean"], d["kld_err"], d["ppl"], d["same_top"])' $W/eval-2-s$seed.json)"
done
cp $W/*.json $W/*.log $OUT/ 2>/dev/null
echo "== done (t=${SECONDS}s)"
