#!/usr/bin/env bash
# Every GPU table in ONE command that fits 8 minutes of device time (one lent slot), most important first.
#
#   bash scripts/gpu_benchmarks.sh OUTDIR              on the device machine: run(command="bash scripts/gpu_benchmarks.sh $OUT",
#                                                      timeout_s=540)
#   bash scripts/gpu_benchmarks.sh --dry-run OUTDIR    the same commands on this CPU, tiny sizes, one round: checks the
#                                                      plumbing before device time is spent on it (limits 5x, for a CPU)
#
# Parts, each under its own `timeout` (a hang or an overrun loses that table only), 450 s of limits in all:
#   gpu_tests   60 s  the tests that need a GPU (accelerator path in float64 against forward AD, FlexAttention)
#   train_fp32  90 s  training step: plain, plain 2B, clone (captured, compiled, CUDA graphs), clone on a quarter of the rows (row_subset=0.25), double
#                     backprop, with peak memory: ResNet-18 (BatchNorm), the small ViT, the MLP. No DiT: jvpreg.models
#                     has none (skipped).
#   train_bf16  75 s  the same under bf16 autocast
#   jvp_b32     75 s  JVP at batch 32: ResNet-50, ViT-B/16, DenseNet-121 (forward 2B, captured clone, torch.func.jvp)
#   meanflow    40 s  mean-flow training step on two DiT sizes: jvpreg (fused attention) vs torch.func.jvp and
#                     torch.autograd.functional.jvp (math attention), bf16 not used
#   paper      110 s  the paper's 13 architectures, reduced: JVP w.r.t. the input at the small shapes, clone vs forward
#                     2B vs torch.func.jvp, few repeats, a per-cell budget
# Everything written goes into OUTDIR/gpu_tables.tar.gz (the device returns few files) and the log into
# OUTDIR/gpu_benchmarks.log. Unpack into experiments/results/gpu/ and commit with the device line of the tool's reply.
set -u -o pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:?usage: gpu_benchmarks.sh [--dry-run] OUTDIR}
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
res=$(mktemp -d)
log="$out/gpu_benchmarks.log"
mkdir -p "$out"

if [ $dry = 1 ]; then  # this CPU: tiny batches, one round, limits scaled up for a slow shared CPU
    dev=cpu; slower=5; repeats=1; rounds=1; jvp_size="--batch-size 1 --warmup 1"; paper="--batch-size 1 --image-size 32"
    train_models="resnet18:8 vit:2 mlp200:8"; paper_models="--models rnn,unet,resnet50"  # 8: row_subset=0.25 keeps 2 rows for BatchNorm
else
    python - <<'EOF' || { echo "gpu_benchmarks.sh: torch sees no CUDA device (use --dry-run on a CPU)" >&2; exit 2; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
    dev=cuda; slower=1; repeats=10; rounds=10; jvp_size=""; paper=""
    train_models="resnet18:32,vit:32,mlp200:64"; paper_models=""
fi
train_models=${train_models// /,}

pack() {  # everything written so far, in one file
    tar -czf "$out/gpu_tables.tar.gz" -C "$res" . && echo "packed $(ls "$res" | wc -l) files into $out/gpu_tables.tar.gz"
}
trap pack EXIT

step() {  # step NAME SECONDS COMMAND...: one part under its own time limit; a failure is logged, never fatal
    local name=$1 limit=$(($2 * slower))
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - t0))s" | tee -a "$log"
}

{ echo "gpu_benchmarks.sh$([ $dry = 1 ] && echo ' --dry-run'), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} | tee "$log"

train_methods=plain,plain_2b,clone,clone_compiled,clone_graphed,clone_rows25,double_backprop
[ $dry = 1 ] && train_methods=plain,plain_2b,clone,clone_rows25,double_backprop  # no Inductor compiles on a CPU
step gpu_tests 60 python -m pytest tests/clone/test_accelerator_path.py tests/clone/test_flex_attention.py tests/clone/test_graphed_engine.py -q \
    -p no:cacheprovider -rs -k "not cpu-accelerator-path"
step train_fp32 90 python -m jvpreg.bench train --models "$train_models" --methods $train_methods --device $dev \
    --repeats $repeats --out "$res/bench_train_${dev}_fp32"
step train_bf16 75 python -m jvpreg.bench train --models "$train_models" --methods $train_methods --device $dev \
    --autocast bf16 --repeats $repeats --out "$res/bench_train_${dev}_bf16"
step jvp_b32 75 python -m jvpreg.bench capture --suites gpu --methods forward_2B,captured,torch.func.jvp --device $dev \
    --rounds $rounds $jvp_size --no-progress --out "$res/bench_capture_${dev}_b32"
step meanflow 40 python -m jvpreg.bench meanflow --device $dev --repeats $repeats --warmup 2 \
    $([ $dry = 1 ] && echo "--sizes dit_s --batch-size 4") --out "$res/bench_meanflow_${dev}"
step paper 110 python -m jvpreg.bench paper --shapes small --kinds x $paper $paper_models \
    --methods clone,fwd_2b,func_jvp --device $dev --repeats 3 --warmup 1 --cell-budget 1 --no-plot --quiet \
    --out "$res" --name "paper_${dev}_reduced"
