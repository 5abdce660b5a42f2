#!/usr/bin/env bash
# tg128 and pp512 of EXL3 folders (trellm bench) beside GGUF files (llama-bench, built by
# ../shared/peers/build_llamacpp_tools.sh), same threads, interleaved, on an otherwise idle machine.
#   scripts/exl3_use_vs_llama.sh THREADS REPS PATH...   (a folder runs in trellm, a .gguf in both)
# Prints one line per model and tool: tool, model, pp512 tok/s, tg128 tok/s.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
threads=${1:?usage: exl3_use_vs_llama.sh THREADS REPS PATH...}
reps=${2:?}
shift 2
bin=$repo/target/release/trellm
llama=${LLAMA_BIN:-$("$repo/../shared/peers/build_llamacpp_tools.sh")}
for m in "$@"; do
    if [ -d "$m" ] || [[ $m == *.gguf ]]; then
        "$bin" bench --model "$m" --threads "$threads" -r "$reps" --json |
            python3 -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); \
print('trellm', sys.argv[1], round(d['pp_tok_s'], 1), round(d['tg_tok_s'], 1))" "$m"
    fi
    if [[ $m == *.gguf ]]; then
        "$llama/llama-bench" -m "$m" -t "$threads" -r "$reps" -o json 2>/dev/null |
            python3 -c "import json,sys; r=json.load(sys.stdin); \
v={('pp' if x['n_prompt'] else 'tg'): x['avg_ts'] for x in r}; \
print('llama-bench', sys.argv[1], round(v['pp'], 1), round(v['tg'], 1))" "$m"
    fi
done
