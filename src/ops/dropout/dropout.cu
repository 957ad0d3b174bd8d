extern "C" __global__ void dropout(float p, u64 key, u64 first, const void* x, int xs, void* y, int ys, u64 n) {
    drop(p, key, first, x, xs, y, ys, n);
}

extern "C" __global__ void dropout_in_place(float p, u64 key, u64 first, void* y, int ys, u64 n) {
    drop(p, key, first, y, ys, y, ys, n);
}
