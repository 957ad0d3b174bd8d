// Optimizer updates over the flat parameter buffer (one launch for all parameters) and the
// global gradient norm. Formulas as in src/tensor/cpu.rs (PyTorch's).

// Two passes, no atomics, so the norm (and clipping) is bit-reproducible: every block writes
// its partial sum, then one block adds the partials in order.
extern "C" __global__ void sum_squares_partial(const float* buf, u64 n, double* partials) {
    double acc = 0.0;
    GRID_STRIDE(i, n) { double v = buf[i]; acc += v * v; }
    acc = block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

extern "C" __global__ void sum_partials(const double* partials, u64 count, double* out) {
    double acc = 0.0;
    for (u64 i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[0] = acc;
}

// clip_grad_norm_ decided on the device (no read-back, so the host does not wait for the
// step): every thread derives the factor from the sum of squares, in double as the host
// does (src/tensor/mod.rs, Backend::clip_to_norm), and scales only when it is below 1.
extern "C" __global__ void clip_by_norm(float* g, u64 n, const double* sum_sq, double max_norm) {
    double coef = max_norm / (sqrt(sum_sq[0]) + 1e-6);
    if (!(coef < 1.0)) return;
    float factor = (float)coef;
    GRID_STRIDE(i, n) g[i] *= factor;
}

// The per-step values (`args`) are read from device memory, so a recorded update follows the
// learning-rate schedule: args = [lr, first_step] (SgdStep::args in src/tensor/mod.rs).
// Mixed precision: with half_s = 1 (f16) or 2 (bf16) each updated parameter is also stored,
// rounded, into the half-width copy the products read (`Backend::sgd_step`'s `half_copy`):
// refreshing it here saves a second pass over the parameters. half_s = 0: no copy.
// With has_decays, decays[i] = 0 exempts parameter i from weight decay.
extern "C" __global__ void sgd_step(float* p, const float* g, float* buf, u64 n, float momentum,
                                    float dampening, int nesterov, float weight_decay, const float* args,
                                    void* half_copy, int half_s, const float* decays, int has_decays) {
    float lr = args[0];
    int first_step = args[1] != 0.0f;
    GRID_STRIDE(i, n) {
        float wd = has_decays && decays[i] == 0.0f ? 0.0f : weight_decay;
        float d = g[i] + wd * p[i];
        if (momentum != 0.0f) {
            buf[i] = first_step ? d : momentum * buf[i] + (1.0f - dampening) * d;
            d = nesterov ? d + momentum * buf[i] : buf[i];
        }
        float updated = p[i] - lr * d;
        p[i] = updated;
        if (half_s) store(half_copy, half_s, i, updated);
    }
}

// args = [decay, step_size, sqrt(bias_correction2)] (AdamStep::args): decay = 1 - lr*wd for
// AdamW (l2 = 0); decay = 1 and l2 = wd for Adam. half_copy, half_s, decays: as sgd_step's.
extern "C" __global__ void adam_step(float* p, const float* g, float* m, float* v, u64 n, float beta1, float beta2,
                                     float eps, float l2, const float* args, void* half_copy, int half_s,
                                     const float* decays, int has_decays) {
    float decay = args[0], step_size = args[1], bias_correction2_sqrt = args[2];
    GRID_STRIDE(i, n) {
        int exempt = has_decays && decays[i] == 0.0f;
        float grad = g[i] + (exempt ? 0.0f : l2) * p[i];
        float param = p[i] * (exempt ? 1.0f : decay);
        float mi = m[i] + (grad - m[i]) * (1.0f - beta1);
        float vi = v[i] * beta2 + (1.0f - beta2) * grad * grad;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
        float updated = param - step_size * mi / denom;
        p[i] = updated;
        if (half_s) store(half_copy, half_s, i, updated);
    }
}
