#!/usr/bin/env bash
# The GPU tables of the captured-clone issue, in four parts that each fit one call of the device tool
# (10 minutes a call, 30 minutes of device time a session), most important first.
#
#   bash scripts/gpu_benchmarks.sh PART OUTDIR     PART: 1, 2, 3 or 4; OUTDIR: $OUT on the device machine
#   SMOKE=1 bash scripts/gpu_benchmarks.sh PART OUTDIR
#                                                  the same commands on this CPU with tiny sizes and one round:
#                                                  checks the plumbing before device time is spent on it
#                                                  (time limits 4x, for this CPU; part 1: the GPU target with the
#                                                  2B forward and the clone engines only, one warm-up, and the
#                                                  small-op models without torch.compile: minutes, not 15)
#
# On the device machine (torch, torchvision, Lightning and timm installed; no hydra, no wandb, no registry):
#   run(command="bash scripts/gpu_benchmarks.sh 1 $OUT", timeout_s=600)
# and then parts 2, 3 and 4 straight after (the machine stays warm for 30 s only; part 4 gets what is left). Every
# benchmark runs under its own `timeout`, so one that overruns loses only its own table; everything written is
# packed into OUTDIR/gpu_partN.tar.gz (the device returns at most 8 files) and the log into OUTDIR/gpu_partN.log.
# Unpack into experiments/results/gpu/ and commit with the device line of the tool's reply.
#
#   part 1: the tests that need a GPU (tests/clone/test_accelerator_path.py on CUDA, FlexAttention); the GPU target
#           (ResNet-50, ViT-B/16, DenseNet-121 at batch 32: captured / fwd 2B and torch.func.jvp / captured), fp32
#           and bf16 autocast; the four small-op models with every engine, torch.compile included
#   part 2: the training step (plain, plain 2B, clone eager / captured / compiled, double backprop, torch.func.jvp)
#           for ResNet-18 with BatchNorm, the MLP and the small ViT, fp32 and bf16 autocast
#   part 3: the small-op models at batch 8, 32 and 128 (fp32 and bf16) and the recurrent models with every engine
#   part 4: the paper's 13 architectures (JVP w.r.t. the input, 100x100 and 400x400)
# Timings of the first run (H100, 2026-11-25): parts 1-3 took 338, 438 and 500 s; the recurrent models overran
# 170 s and the paper's table 150 s, which is why each now has more and the paper a call of its own.
set -u -o pipefail
part=${1:?usage: gpu_benchmarks.sh PART OUTDIR (PART: 1, 2, 3 or 4)}
out=${2:?usage: gpu_benchmarks.sh PART OUTDIR}
case $part in 1|2|3|4) ;; *) echo "gpu_benchmarks.sh: PART must be 1, 2, 3 or 4, got '$part'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
res=$(mktemp -d)
log="$out/gpu_part$part.log"
mkdir -p "$out"

if [ "${SMOKE:-0}" = 1 ]; then  # this CPU: tiny batches, one round, short limits scaled down with them
    dev=cpu; rounds=1; repeats=1; big="--batch-size 1 --warmup 1"; slower=4; paper_shapes=small; batches="2"
    train_models="mlp200:8 resnet18:2 vit:2"; gpu_methods=forward_2B,eager,captured; small_compile="--no-compile"
else
    python - <<'EOF' || { echo "gpu_benchmarks.sh: torch sees no CUDA device (use SMOKE=1 on a CPU)" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
    dev=cuda; rounds=30; repeats=20; big=""; slower=1; paper_shapes=paper; batches="8 32 128"
    train_models="resnet18:32 mlp200:64 vit:32"; small_compile=""
    gpu_methods=forward_B,forward_2B,eager,captured,torch.func.jvp,forward_ad
fi

pack() {  # everything written so far, in one file (the device returns at most 8)
    tar -czf "$out/gpu_part$part.tar.gz" -C "$res" . && echo "packed $(ls "$res" | wc -l) files into $out/gpu_part$part.tar.gz"
}
trap pack EXIT

step() {  # step NAME SECONDS COMMAND...: one benchmark under its own time limit; a failure is logged, never fatal
    local name=$1 limit=$(($2 * slower))
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - t0))s" | tee -a "$log"
}

train_methods=plain,plain_2b,clone,clone_eager,double_backprop,func_jvp,plain_compiled,clone_compiled
{ echo "gpu_benchmarks.sh part $part, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} | tee "$log"

case $part in
1)
    # correctness first: the accelerator's path in float64 on the GPU's own kernels against forward AD on the CPU,
    # and FlexAttention (no backward on the CPU); the result is in the log
    step gpu_tests 75 python -m pytest tests/clone/test_accelerator_path.py tests/clone/test_flex_attention.py -q \
        -p no:cacheprovider -rs -k "not cpu-accelerator-path"
    step gpu_fp32 120 python -m jvpreg.bench capture --suites gpu --methods $gpu_methods --device $dev \
        --rounds $rounds $big --no-progress --out "$res/bench_capture_gpu_fp32"
    step gpu_bf16 120 python -m jvpreg.bench capture --suites gpu --methods $gpu_methods --device $dev \
        --autocast bf16 --rounds $rounds $big --no-progress --out "$res/bench_capture_gpu_bf16"
    step small_fp32 270 python -m jvpreg.bench capture --suites small --device $dev --rounds $rounds $small_compile \
        --no-progress --out "$res/bench_capture_small_fp32"
    ;;
2)
    for amp in none bf16; do  # one model per benchmark: a compile that overruns loses one table, not three
        for spec in $train_models; do
            step "train_${spec%%:*}_$amp" 90 python -m jvpreg.bench train --models "$spec" --methods $train_methods \
                --device $dev --autocast $amp --repeats $repeats --out "$res/bench_train_${spec%%:*}_$amp"
        done
    done
    ;;
3)
    for b in $batches; do
        for amp in none bf16; do
            step "small_b${b}_$amp" 35 python -m jvpreg.bench capture --suites small --no-compile --device $dev \
                --batch-size "$b" --autocast $amp --rounds $rounds --no-progress \
                --out "$res/bench_capture_small_b${b}_$amp"
        done
    done
    step rnn_fp32 330 python -m jvpreg.bench capture --suites rnn --device $dev --rounds $rounds \
        --no-progress --out "$res/bench_capture_rnn_fp32"
    ;;
4)
    step paper 540 python -m jvpreg.bench paper --shapes $paper_shapes --kinds x \
        --methods func_jvp,forward_ad,double_vjp,clone,fwd_2b --device $dev --repeats $repeats \
        --cell-budget 2 --no-plot --quiet --out "$res" --name "paper_$dev"
    ;;
esac
