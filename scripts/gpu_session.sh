# One call on a lent GPU (the `device` tool), most important first, each part time-boxed; STAGES
# picks and orders them (default "check trace steps"; "sweep" re-tunes, ~230 s):
#   check: the kernels against XLA / the reference on the GPU (scripts/gpu_check.py at 1 and 64
#      sequences, <= 60 s), the dequantizing matmul's inline PTX (codes as f32 denormals) among them;
#   trace: Llama-3-8B's one-row decode step, int4 then bf16, under the profiler in one process:
#      device time per kernel (bench_step.py's kernels-*.json, copied to $OUT);
#   sweep: the Pallas dequantizing matmul tuned at Llama-3-8B's projection shapes, int4 and int8,
#      1 and 32 rows, against XLA's product and a bf16 dot (scripts/bench_linear_gpu.py; writes
#      the best blocks to $OUT/tuned.json, which the later stages then use);
#   steps: Llama-3-8B's decode step through the engine with int4, then int8, weights: XLA's
#      products vs the kernel, 1 and 32 rows, one process per format (~210 s each; QUANTS picks);
#   multistep: Llama-3-8B (random bf16 / int4 weights) single-stream decode through `LLM` with
#      num_scheduler_steps 1 and 8 interleaved (scripts/bench_generate.py, ~150 s);
#   knobs: the bf16 step at 1 and 32 rows with --xla_gpu_experimental_force_split_k=0 / 1
#      alternating, two each (~330 s; 0 first: the three sessions before ran 1 first, once each);
#   attn: the int4 step at 1 and 8 rows, 512 and 4,096 tokens of context, with the decode
#      attention's split-K (4 programs an SM, the default) and without (0: no merge launch), ~220 s.
# The three default stages take ~630 s: with BUDGET=575 the int8 steps are cut short.
# Results under $OUT; BENCHMARKS.md has them.
#   run: BUDGET=575 bash scripts/gpu_session.sh 2>&1 | tee $OUT/log.txt   (carry .whl: gguf)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
T0=$(date +%s)
left() { echo $((${BUDGET:-560} - ($(date +%s) - T0))); }
box() { local t=$(($1 < $(left) - 5 ? $1 : $(left) - 5)); shift; timeout $t "$@"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
quiet() { grep -v -E "^[WIE]0000|Warning|warn|^  "; }
tuning() { [ -s $OUT/tuned.json ] && echo "--linear-tuning $OUT/tuned.json"; }
step() { echo "python3 scripts/bench_step.py --model scripts/configs/llama-3-8b --context 512 \
  --steps 16 $(tuning)"; }
for stage in ${STAGES:-check trace steps}; do
  case $stage in
  check)
    echo "== the kernels against XLA / the reference (left $(left))"
    JAX_PLATFORMS=cuda box ${CHECK_S:-60} python3 scripts/gpu_check.py --runs 5 --seqs 1,64 \
      --json-out $OUT/check.json 2>&1 | quiet ;;
  trace)
    echo "== one-row decode step under the profiler, int4 and bf16 (left $(left))"
    JAX_PLATFORMS=cuda box ${TRACE_S:-150} $(step) --batch 1 --quantization int4,none \
      --trace-dir /tmp/trace --json-out $OUT/trace_steps.json 2>&1 | quiet
    for f in /tmp/trace/kernels-*.json; do [ -f "$f" ] && cp "$f" $OUT/; done ;;
  sweep)
    echo "== the dequantizing matmul, tuned (left $(left))"
    JAX_PLATFORMS=cuda box ${SWEEP_S:-230} python3 scripts/bench_linear_gpu.py \
      --budget ${STAGE_B_S:-150} --tuned-out $OUT/tuned.json --json-out $OUT/sweep.json 2>&1 |
      grep -v -E "^[WIE]0000|^\{" ;;
  steps)
    for q in ${QUANTS:-int4 int8}; do
      echo "== $q decode step, xla vs gpu (left $(left))"
      JAX_PLATFORMS=cuda box ${STEP_S:-210} $(step) --batch 1,32 --quantization $q \
        --linear-backend xla,gpu --json-out $OUT/step_$q.json 2>&1 | quiet
    done ;;
  multistep)
    echo "== single-stream decode, 1 vs 8 steps a program (left $(left))"
    JAX_PLATFORMS=cuda box ${MULTI_S:-150} python3 scripts/bench_generate.py \
      --model scripts/configs/llama-3-8b --load-format dummy --dtype bfloat16 \
      --quantization int4,none --num-scheduler-steps 1,8 --prompt-len 128 --decode-tokens 128 \
      --runs 3 --no-hf 2>&1 | quiet | tee $OUT/multistep.txt ;;
  knobs)
    for sk in 0 1 0 1; do
      echo "== bf16 step, force_split_k=$sk (left $(left))"
      XLA_FLAGS=--xla_gpu_experimental_force_split_k=$sk JAX_PLATFORMS=cuda box 85 $(step) \
        --batch 1,32 --quantization none 2>&1 | quiet | grep -v '^{"bench"'
    done ;;
  attn)
    for ctx in 512 4096; do
      echo "== int4 step, decode attention split-K 4 / 0 programs an SM, context $ctx (left $(left))"
      JAX_PLATFORMS=cuda box ${ATTN_S:-110} $(step | sed "s/--context 512/--context $ctx/") \
        --batch 1,8 --quantization int4 --decode-programs-per-core 4,0 \
        --json-out $OUT/attn_$ctx.json 2>&1 | quiet | grep -v '^{"bench"'
    done ;;
  *) echo "unknown stage $stage" ;;
  esac
done
echo "== done (left $(left))"
