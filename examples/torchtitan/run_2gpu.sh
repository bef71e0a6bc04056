#!/usr/bin/env bash
# torchtitan's own trainer on 2 GPUs: bf16 against NVFP4 (--model.converters nvfp4), activation checkpointing
# off and on, then a DCP save / kill / resume check (docs/distributed.md, "torchtitan's trainer on 2 GPUs").
#
# usage (from anywhere; it works in the repository root):
#   examples/torchtitan/run_2gpu.sh [all|compare|resume|summary] [STEPS] [RESUME_STEPS]
#     compare   for each AC mode, bf16 then NVFP4 for STEPS steps (default 300); checkpointing off
#     resume    NVFP4 for RESUME_STEPS steps (even, default 40) saving a DCP checkpoint at half; a second run of
#               the same job killed (SIGKILL to its worker processes) once its half-way checkpoint is saved and
#               restarted, resuming from it; the resumed steps' loss lines and the final checkpoints must equal
#               the uninterrupted run's bit for bit (in torchtitan's deterministic mode)
#     summary   the table of the compare runs done so far (RUN_DIR/summary.md, summary.json)
#     all       compare, summary, resume (the default)
# environment:
#   CONFIG        the job config (default examples/torchtitan/llama3_1b.toml; examples/torchtitan/debug_model.toml)
#   NGPU          processes, one GPU each (default 2)
#   RUN_DIR       logs, checkpoints and the table (default runs/torchtitan/2gpu)
#   AC_MODES      activation checkpointing modes compared (default "none full")
#   WARMUP        first steps left out of the throughput means (default 20)
#   RESUME_CONVERTERS  the converters of the resume check (default nvfp4; empty: bf16)
#   EXTRA         more torchtitan options for every run, e.g. "--nvfp4.keep_bf16 output"
#   PYTHON        the interpreter (default python3); TORCHRUN the launcher (default "$PYTHON -m torch.distributed.run")
# Each run's log is RUN_DIR/NAME.log (rank 0); its dump folder RUN_DIR/NAME. No network is used: the data are
# the standard library's .py files (the main job's corpus), the tokenizer is written here.
set -uo pipefail

cd "$(dirname "$0")/../.."
PHASE=${1:-all}
STEPS=${2:-300}
RESUME_STEPS=${3:-40}
CONFIG=${CONFIG:-examples/torchtitan/llama3_1b.toml}
NGPU=${NGPU:-2}
RUN_DIR=${RUN_DIR:-runs/torchtitan/2gpu}
AC_MODES=${AC_MODES:-none full}
WARMUP=${WARMUP:-20}
RESUME_CONVERTERS=${RESUME_CONVERTERS-nvfp4}
PYTHON=${PYTHON:-python3}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
read -r -a LAUNCH <<< "${TORCHRUN:-$PYTHON -m torch.distributed.run}"

# NVLink multicast off in every process (shared hosts); nothing fetched from the Hugging Face hub
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if (( RESUME_STEPS < 2 || RESUME_STEPS % 2 )); then
    echo "RESUME_STEPS must be even and at least 2, got $RESUME_STEPS" >&2; exit 2
fi
"$PYTHON" -c "import torchtitan.train, datasets, nvfp4_recipe.torchtitan_job" || {
    echo "needs torchtitan 0.2 (pip install 'nvfp4-recipe[torchtitan]') and its datasets package" >&2; exit 2; }
mkdir -p "$RUN_DIR"
TOKENIZER=$("$PYTHON" -m nvfp4_recipe.byte_tokenizer "$RUN_DIR/byte_tokenizer") || exit 2

# train NAME OPTION...: one torchtitan job in RUN_DIR/NAME, rank 0's log in RUN_DIR/NAME.log; its exit status
train() {
    local name=$1; shift
    echo "== $name: $*"
    "${LAUNCH[@]}" --standalone --nproc-per-node "$NGPU" --local-ranks-filter 0 -m torchtitan.train \
        --job.config_file "$CONFIG" --job.dump_folder "$RUN_DIR/$name" --model.hf_assets_path "$TOKENIZER" \
        "$@" "${EXTRA_ARGS[@]}" >> "$RUN_DIR/$name.log" 2>&1
    local status=$?
    grep -E "step: *[0-9]+ " "$RUN_DIR/$name.log" | tail -n 1
    (( status == 0 )) || echo "!! $name exited with status $status (log: $RUN_DIR/$name.log)"
    return $status
}

converters() {  # the options of a recipe: bf16 or nvfp4
    [[ $1 == nvfp4 ]] && echo "--model.converters nvfp4"
}

compare() {
    local ac recipe name
    for ac in $AC_MODES; do
        for recipe in bf16 nvfp4; do
            name=$recipe-ac_$ac
            rm -rf "${RUN_DIR:?}/$name" "$RUN_DIR/$name.log"
            # shellcheck disable=SC2046
            train "$name" --training.steps "$STEPS" --activation_checkpoint.mode "$ac" \
                --checkpoint.no-enable $(converters "$recipe")
        done
    done
}

summary() {
    local runs=() ac recipe
    for ac in $AC_MODES; do
        for recipe in bf16 nvfp4; do
            [[ -f $RUN_DIR/$recipe-ac_$ac.log ]] && runs+=("$recipe-ac_$ac=$RUN_DIR/$recipe-ac_$ac.log")
        done
    done
    (( ${#runs[@]} )) || { echo "no compare runs in $RUN_DIR"; return 1; }
    "$PYTHON" examples/torchtitan/report.py summary --warmup "$WARMUP" --json "$RUN_DIR/summary.json" \
        "${runs[@]}" | tee "$RUN_DIR/summary.md"
}

# wait_for_checkpoint LOG PID: until LOG says a checkpoint was saved (0), or PID ends first (1)
wait_for_checkpoint() {
    until grep -q "Finished saving the checkpoint" "$1" 2>/dev/null; do
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
}

resume() {
    local half=$((RESUME_STEPS / 2)) pid launcher workers
    # shellcheck disable=SC2206
    local job=(--training.steps "$RESUME_STEPS" --checkpoint.enable --checkpoint.interval "$half"
               --debug.deterministic --debug.deterministic_warn_only
               ${RESUME_CONVERTERS:+--model.converters $RESUME_CONVERTERS})
    export CUBLAS_WORKSPACE_CONFIG=:4096:8
    rm -rf "${RUN_DIR:?}"/resume-{reference,killed} "$RUN_DIR"/resume-{reference,killed,resumed}.log
    train resume-reference "${job[@]}" || return 1

    train resume-killed "${job[@]}" &
    pid=$!
    if ! wait_for_checkpoint "$RUN_DIR/resume-killed.log" "$pid"; then
        echo "!! resume-killed ended before saving its step-$half checkpoint"; return 1
    fi
    # kill the trainer processes by id: the children of the launcher (each in a session of its own), the
    # launcher being the only child of the background job
    launcher=$(pgrep -P "$pid")
    workers=$(pgrep -P "$launcher")
    [[ -n $workers ]] || { echo "!! no trainer processes found under torchrun"; return 1; }
    kill -KILL $workers
    wait "$pid"
    echo "== resume-killed: killed after saving step $half"
    [[ -f $RUN_DIR/resume-killed/checkpoint/step-$RESUME_STEPS/.metadata ]] && {
        echo "!! resume-killed reached step $RESUME_STEPS before the kill: rerun with more RESUME_STEPS"; return 1; }

    # the same job in the same folder: it loads the newest checkpoint, step $half
    mv "$RUN_DIR/resume-killed.log" "$RUN_DIR/resume-killed-before.log"
    train resume-killed "${job[@]}" || return 1
    mv "$RUN_DIR/resume-killed.log" "$RUN_DIR/resume-resumed.log"
    grep -m1 "Training starts at step" "$RUN_DIR/resume-resumed.log"
    "$PYTHON" examples/torchtitan/report.py resume --after "$half" \
        --logs "$RUN_DIR/resume-reference.log" "$RUN_DIR/resume-resumed.log" \
        --checkpoints "$RUN_DIR/resume-reference/checkpoint/step-$RESUME_STEPS" \
                      "$RUN_DIR/resume-killed/checkpoint/step-$RESUME_STEPS" | tee "$RUN_DIR/resume.txt"
}

case $PHASE in
    compare) compare ;;
    summary) summary ;;
    resume) resume ;;
    all) compare; summary; resume ;;
    *) echo "unknown phase $PHASE: all, compare, resume or summary" >&2; exit 2 ;;
esac
