"""The lowest layer: the CPU fast path (`cpu`: oneDNN-packed linears, `optimize_for_cpu`, the package's cache
folder), several linears as one GEMM (`fused_linear`), the training-time-test attention (`unrolled_attention`) and
preallocated KV buffers (`reserved_cache`)."""
