// y = a · b elementwise; and an input's gradient dy · other, written or added (`add`).

extern "C" __global__ void multiply(const void* a, int a_s, const void* b, int b_s, void* y, int ys, u64 n) {
    In in[2] = {{a, a_s}, {b, b_s}};
    map_values<2>(in, y, ys, n, [=](u64, const float* v) { return v[0] * v[1]; });
}

extern "C" __global__ void multiply_backward(const void* dy, int dys, const void* other, int os, void* dx, int dxs,
                                             u64 n, int add) {
    In in[3] = {{dy, dys}, {other, os}, {dx, dxs}};
    map_values<3>(in, dx, dxs, n, [=](u64, const float* v) { return add ? v[2] + v[0] * v[1] : v[0] * v[1]; });
}
