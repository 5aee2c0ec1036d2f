# Shared by the MPI benchmark scripts (source it): a token data set and a run config, and
# one `onnx-train train` under mpirun that stops the script with the log's tail on failure.

bench_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench_bin="$bench_root/target/release/onnx-train"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# write_run DIR MODEL VOCAB SEQ BATCH STEPS OPTIMIZER: random tokens below VOCAB in
# DIR/data and DIR/run.toml training MODEL with OPTIMIZER, no evaluation, no logs, no
# checkpoints.
write_run() {
  local dir="$1" model="$2" vocab="$3" seq="$4" batch="$5" steps="$6" optimizer="$7"
  mkdir -p "$dir/data"
  python3 "$bench_root/tools/random_tokens.py" "$dir/data/tokens.npy" "$vocab"
  cat > "$dir/run.toml" <<TOML
model_path = "$model"
train_data_dir = "$dir/data"
input_name = "input_ids"
output_name = "logits"
loss = "lm_cross_entropy"
seq_len = $seq
batch_size = $batch
num_train_steps = $steps
evaluation_period = 0
checkpoint_period = 0
progress = false
log_dir = ""
[optimizer]
kind = "$optimizer"
TOML
}

# gpt2_run DIR LAYERS HEADS WIDTH VOCAB SEQ BATCH STEPS: the `onnx-train gpt2` model of that
# shape in DIR/model.onnx (made once), and write_run's tokens and AdamW run.toml for it.
gpt2_run() {
  local dir="$1" layers="$2" heads="$3" width="$4" vocab="$5" seq="$6" batch="$7" steps="$8"
  mkdir -p "$dir"
  [ -f "$dir/model.onnx" ] || "$bench_bin" gpt2 --output "$dir/model.onnx" --layers "$layers" \
    --heads "$heads" --width "$width" --vocab "$vocab" --positions "$seq" > /dev/null
  write_run "$dir" "$dir/model.onnx" "$vocab" "$seq" "$batch" "$steps" adamw
}

# mpi_train DIR NAME NP FLAGS...: train DIR/run.toml on NP ranks into DIR/NAME, every
# rank on one thread (RAYON_NUM_THREADS=1), one rank per core.
mpi_train() {
  local dir="$1" name="$2" np="$3"; shift 3
  RAYON_NUM_THREADS=1 timeout -k 10 1200 mpirun --oversubscribe -np "$np" "$bench_bin" train --config "$dir/run.toml" --output-dir "$dir/$name" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$dir/$name.log"; exit 1; }
}
