# One call on a lent GPU (the `device` tool): Llama-3-8B's decode step through the engine with the
# step compiled as one command buffer and with XLA's default command buffers (the caller's
# XLA_FLAGS wins over programs.compiler_options), int8/int4, HF transformers on the same config,
# and the attention kernel against JAX's and cuDNN's. Results under $OUT; BENCHMARKS.md has them.
#   run: BUDGET=540 bash scripts/gpu_session.sh 2>&1 | tee $OUT/log.txt   (carry .whl: gguf)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
T0=$(date +%s)
left() { echo $((${BUDGET:-540} - ($(date +%s) - T0))); }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
quiet() { grep -v -E "^[WIE]0000|Warning|warn|^  "; }
B="python3 scripts/bench_step.py --model scripts/configs/llama-3-8b --context 512 --steps 24"
DEFAULT_CB=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION
echo "== bf16, one command buffer (left $(left))"
timeout $(($(left) - 330)) $B --batch 1,32 --trace-dir /tmp/tr --json-out $OUT/step_bf16.json --hf 2>&1 | quiet
cp /tmp/tr/kernels-*.json $OUT/ 2>/dev/null
echo "== bf16, XLA's default command buffers (left $(left))"
XLA_FLAGS=$DEFAULT_CB timeout $(($(left) - 240)) $B --batch 1,32 --json-out $OUT/step_default_cb.json 2>&1 | quiet
echo "== int8, int4 (left $(left))"
timeout $(($(left) - 100)) $B --batch 1,32 --quantization int8,int4 --json-out $OUT/step_q.json 2>&1 | quiet
echo "== attention kernel (left $(left))"
timeout $(($(left) - 5)) python3 scripts/bench_attention.py --backends reference,gpu --runs 5 >$OUT/attn.log 2>&1
tail -12 $OUT/attn.log
echo "== done (left $(left))"
