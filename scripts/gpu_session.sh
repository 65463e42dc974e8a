# One call on a lent GPU (the `device` tool), most important first, each part time-boxed:
#   1. the decode step's own kernels compiled on the GPU against the reference (scripts/gpu_check.py);
#   2. Llama-3-8B's decode step through the engine (bf16 at 1 and 32 rows, with a kernel trace);
#   3. the same with XLA's split-K GEMMs allowed (the engine forces them off; the caller's
#      XLA_FLAGS wins over programs.compiler_options);
#   4. int8 / int4 (the Pallas dequantizing matmul at decode rows);
#   5. the 2-layer llama decode step test compiled on the GPU (gpu vs reference backend).
# Results under $OUT; BENCHMARKS.md has them.
#   run: BUDGET=560 bash scripts/gpu_session.sh 2>&1 | tee $OUT/log.txt   (carry .whl: gguf)
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
B="python3 scripts/bench_step.py --model scripts/configs/llama-3-8b --context 512 --steps 16"
echo "== kernels (left $(left))"
JAX_PLATFORMS=cuda box 130 python3 scripts/gpu_check.py --runs 20 --json-out $OUT/check.json 2>&1 | quiet
echo "== bf16, the engine's options (left $(left))"
box 150 $B --batch 1,32 --trace-dir /tmp/tr --json-out $OUT/step_bf16.json 2>&1 | quiet
cp /tmp/tr/kernels-*.json $OUT/ 2>/dev/null
echo "== bf16, XLA's split-K allowed (left $(left))"
XLA_FLAGS=--xla_gpu_experimental_force_split_k=0 box 90 $B --batch 1 \
  --json-out $OUT/step_splitk.json 2>&1 | quiet
echo "== int8, int4 (left $(left))"
box 150 $B --batch 1,32 --quantization int8,int4 --json-out $OUT/step_q.json 2>&1 | quiet
echo "== the llama decode step test, compiled (left $(left))"
JAX_PLATFORMS=cuda box 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_decode_fused.py \
  -k llama 2>&1 | tail -5
echo "== done (left $(left))"
