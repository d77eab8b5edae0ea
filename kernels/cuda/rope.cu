// RoPE rows gathered by position from the model's table on the device (rope::Rope::row is the
// specification: the table's row p is Rope::row(p), computed on the host in f64 and uploaded
// once). One block per row, one thread per value; a position outside the table traps.
extern "C" __global__ void rope_rows(const float* __restrict__ table, unsigned table_rows,
                                     const unsigned* __restrict__ positions,
                                     float* __restrict__ out) {
    unsigned p = positions[blockIdx.x];
    if (p >= table_rows) __trap();
    out[(size_t)blockIdx.x * TKV_ROPE_DIM + threadIdx.x] =
        table[(size_t)p * TKV_ROPE_DIM + threadIdx.x];
}
