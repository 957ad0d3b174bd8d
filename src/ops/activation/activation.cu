// Activation functions, by id (`activation_id`): relu, gelu, gelu_tanh, tanh, sigmoid, silu.
#define SQRT_2_OVER_PI 0.7978845608f
#define GELU_COEF 0.044715f

__device__ __forceinline__ float act(int f, float x) {
    switch (f) {
        case 0: return x > 0.0f || x != x ? x : 0.0f;  // NaN passes, as PyTorch's ReLU
        case 1: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case 2: return 0.5f * x * (1.0f + tanhf(SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)));
        case 3: return tanhf(x);
        case 4: return 1.0f / (1.0f + expf(-x));
        default: return x / (1.0f + expf(-x));
    }
}

__device__ __forceinline__ float act_derivative(int f, float x, float y) {
    switch (f) {
        case 0: return y > 0.0f ? 1.0f : 0.0f;  // from y, so ReLU can run in place
        case 1: {
            float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
            float pdf = expf(-0.5f * x * x) * 0.3989422804f;
            return cdf + x * pdf;
        }
        case 2: {
            float t = tanhf(SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x));
            return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_COEF * x * x);
        }
        case 3: return 1.0f - y * y;
        case 4: return y * (1.0f - y);
        default: {
            float s = 1.0f / (1.0f + expf(-x));
            return s * (1.0f + x * (1.0f - s));
        }
    }
}

// y = f(x); also in place (x = y).
__device__ __forceinline__ void activate(int f, const void* x, int xs, void* y, int ys, u64 n) {
    In in[1] = {{x, xs}};
    map_values<1>(in, y, ys, n, [=](u64, const float* v) { return act(f, v[0]); });
}

extern "C" __global__ void activation_forward(int f, const void* x, int xs, void* y, int ys, u64 n) {
    activate(f, x, xs, y, ys, n);
}

extern "C" __global__ void activation_in_place(int f, void* y, int ys, u64 n) { activate(f, y, ys, y, ys, n); }

extern "C" __global__ void activation_backward(int f, const void* x, int xs, const void* y, int ys, const void* dy,
                                               int dys, void* dx, int dxs, u64 n) {
    In in[3] = {{x, xs}, {y, ys}, {dy, dys}};
    map_values<3>(in, dx, dxs, n, [=](u64, const float* v) { return v[2] * act_derivative(f, v[0], v[1]); });
}

// Mixed precision: the rounding of a neighbour fused into an in-place activation (see
// graph::Network's `Fusion`): y = round(f(round(x))); dx = round(round(dy) * f'(x, y)). ReLU's
// outer rounding changes nothing (its results are half values already). In a half-width
// buffer the roundings are the stores' own.
extern "C" __global__ void activation_in_place_rounding(int f, int kind, void* y, int ys, u64 n) {
    In in[1] = {{y, ys}};
    map_values<1>(in, y, ys, n, [=](u64, const float* v) { return round_half(act(f, round_half(v[0], kind)), kind); });
}

extern "C" __global__ void activation_backward_rounding(int f, int kind, const void* x, int xs, const void* y, int ys,
                                                        const void* dy, int dys, void* dx, int dxs, u64 n) {
    In in[3] = {{x, xs}, {y, ys}, {dy, dys}};
    map_values<3>(in, dx, dxs, n, [=](u64, const float* v) {
        return round_half(round_half(v[2], kind) * act_derivative(f, v[0], v[1]), kind);
    });
}
