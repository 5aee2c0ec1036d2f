#!/bin/bash
# ZeRO stages on the GPT-2 124M shape under mpirun -np 2, one thread per rank, in the order of
# BENCHMARKS.md (issue 9). Build first: cargo build --release --features mpi --example gpt2
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for spec in "0 0" "2 0" "3 0" "3 4" "0 0" "3 0"; do
  set -- $spec; z=$1; r=$2; tag=z$z-r$r
  RAYON_NUM_THREADS=1 timeout -k 10 900 mpirun --oversubscribe -np 2 target/release/examples/gpt2 --bench --steps 4 --dp 2 --zero $z --recompute $r --layers 12 --heads 12 --width 768 --batch-size 1 --seq-len 64 --output-dir runs/gpt2-124m-$tag > /tmp/b124-$tag.log 2>&1
  echo "rc $? $tag $(grep 'train loss' /tmp/b124-$tag.log)"
  python3 -c "
import json; p=json.load(open('runs/gpt2-124m-$tag/bench/perf.json')); print('$tag', {k:p[k] for k in p if 'ms' in k or 'bytes' in k})"
done
