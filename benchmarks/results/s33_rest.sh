# the rest of session 33's GPU test sweep: every GPU test not in s33_gpu_tests_passed.txt, three processes
d=$(sed 's/^/--deselect /' benchmarks/results/s33_gpu_tests_passed.txt | tr '\n' ' ')
p="python -m pytest -m gpu -v -p no:cacheprovider $d"
($p tests/backends/kernels/test_moe_prefill_ws.py > $OUT/r_ws.log 2>&1; echo rc=$? >> $OUT/r_ws.log) &
($p tests/backends/kernels/test_moe_prefill_cuda.py tests/backends/kernels/test_moe_prefill.py tests/backends/kernels/test_msa_attention.py tests/backends/kernels/test_msa_attention_cuda.py tests/fused/test_sparse_attention.py tests/runtime tests/frontend > $OUT/r_prefill_rt.log 2>&1; echo rc=$? >> $OUT/r_prefill_rt.log) &
($p tests/backends/kernels/test_moe_routing.py tests/backends/kernels/test_qkv_fused.py tests/backends/kernels/test_msa_indexer.py tests/backends/kernels/test_msa_indexer_cuda.py tests/backends/kernels/test_moe_decode.py tests/backends/kernels/test_moe_cuda.py tests/fused/test_moe.py tests/backends/kernels/test_moe_cuda_route.py tests/backends/kernels/test_moe_cuda_timeline.py tests/test_cli_compile.py > $OUT/r_rest.log 2>&1; echo rc=$? >> $OUT/r_rest.log) &
wait
for f in $OUT/r_*.log; do echo "$(basename $f): $(grep -cE 'PASSED' $f) passed lines; $(grep -E 'passed|failed' $f | tail -1)"; grep -E 'FAILED|ERROR' $f | head -5; done
