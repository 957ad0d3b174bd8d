// Losses fused with their gradients. Each writes every sample's loss to row_stats[r] and its
// correct fraction to row_stats[n + r]; reduce_stats then adds their sums (in a fixed order, so
// runs are bit-reproducible) to stats = [loss sum, correct, samples]. With write_grad = 0
// (evaluation) `dout` is not touched. The gradient is d(mean loss)/d(out) * grad_scale, as in
// src/tensor/cpu.rs; cross_entropy's `dout` may be `logits` itself (each element is read by the
// lane that writes it, after the row's reductions). The model's output and its gradient come with their storage (`load`,
// `store`).

// One warp per row of logits; 8 rows per block of 256 threads.
extern "C" __global__ void cross_entropy(const void* logits, int ls, const float* labels, u64 n, u64 classes,
                                         float smoothing, float grad_scale, int write_grad, void* dout, int ds,
                                         double* row_stats, int counted, float ignore) {
    int lane = threadIdx.x & 31;
    u64 row = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row < n && counted && labels[row] == ignore) {
        // Not scored: no loss, no hit, no gradient.
        for (u64 j = lane; j < classes && write_grad; j += 32) store(dout, ds, row * classes + j, 0.0f);
        if (lane == 0) row_stats[row] = row_stats[n + row] = 0.0;
    } else if (row < n) {
        u64 x = row * classes;  // the row's first logit
        u64 label = (u64)labels[row];
        // max and argmax (lowest index among equal maxima, as torch.argmax)
        float best = __int_as_float(0xff800000); // -inf
        u64 arg = 0;
        for (u64 j = lane; j < classes; j += 32)
            if (load(logits, ls, x + j) > best) { best = load(logits, ls, x + j); arg = j; }
        for (int o = 16; o > 0; o >>= 1) {
            float other = __shfl_xor_sync(0xffffffffu, best, o);
            u64 other_arg = __shfl_xor_sync(0xffffffffu, arg, o);
            if (other > best || (other == best && other_arg < arg)) { best = other; arg = other_arg; }
        }
        // Read before any lane writes: the gradient may go over the logits (fused classifier).
        double at_label = (double)load(logits, ls, x + label);
        double sum_exp = 0.0, sum_x = 0.0;
        for (u64 j = lane; j < classes; j += 32) {
            double v = (double)load(logits, ls, x + j);
            sum_exp += exp(v - (double)best);
            sum_x += v;
        }
        for (int o = 16; o > 0; o >>= 1) {
            sum_exp += __shfl_xor_sync(0xffffffffu, sum_exp, o);
            sum_x += __shfl_xor_sync(0xffffffffu, sum_x, o);
        }
        double lse = (double)best + log(sum_exp);
        double nll = lse - at_label;
        double row_loss = smoothing > 0.0f
            ? (1.0 - smoothing) * nll + smoothing * (lse - sum_x / (double)classes)
            : nll;
        if (write_grad) {
            // The mean over the rows scored (count_scored's, when some are ignored).
            double scored = counted ? row_stats[2 * n] : (double)n;
            double g = (double)grad_scale / scored;
            double uniform = (double)smoothing / (double)classes;
            // Every lane has read the row (the shuffles above wait for all 32): a lane's
            // writes reach no value another lane has yet to read.
            __syncwarp();
            for (u64 j = lane; j < classes; j += 32) {
                double p = exp((double)load(logits, ls, x + j) - lse);
                double target = uniform + (j == label ? 1.0 - smoothing : 0.0);
                store(dout, ds, x + j, (float)((p - target) * g));
            }
        }
        if (lane == 0) {
            row_stats[row] = row_loss;
            row_stats[n + row] = arg == label ? 1.0 : 0.0;
        }
    }
}

// kind 0: mse, 1: bce_with_logits. One thread per sample, looping over its `dim` outputs.
extern "C" __global__ void elementwise_loss(int kind, const void* out, int os, const float* targets, u64 n, u64 dim,
                                            float grad_scale, int write_grad, void* dout, int ds, double* row_stats) {
    u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s < n) {
        // The CPU backend's operations in its order: the difference in f32, then f64.
        double g = (double)grad_scale / (double)n;
        double sum = 0.0, matched = 0.0;
        for (u64 j = 0; j < dim; j++) {
            u64 i = s * dim + j;
            float o = load(out, os, i);
            double x = o, t = targets[i], grad;
            if (kind == 0) {
                double d = (double)(o - targets[i]);
                sum += d * d;
                grad = 2.0 * d * g / (double)dim;
            } else {
                sum += fmax(x, 0.0) - x * t + log1p(exp(-fabs(x)));
                matched += ((x > 0.0) == (t >= 0.5)) ? 1.0 : 0.0;
                grad = (1.0 / (1.0 + exp(-x)) - t) * g / (double)dim;
            }
            if (write_grad) store(dout, ds, i, (float)grad);
        }
        row_stats[s] = sum / (double)dim;
        row_stats[n + s] = matched / (double)dim;
    }
}

// One block: stats += [sum of losses, sum of hits, n], each thread summing a fixed stride.
// The rows a cross-entropy scores, those whose label is not `ignore`, into row_stats[2n]. One
// block.
extern "C" __global__ void count_scored(const float* labels, u64 n, float ignore, double* row_stats) {
    double c = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) c += labels[i] != ignore ? 1.0 : 0.0;
    c = block_sum(c);
    if (threadIdx.x == 0) row_stats[2 * n] = c;
}

// Adds the rows' losses, hits and the rows scored (row_stats[2n] when `counted`, else n).
extern "C" __global__ void reduce_stats(const double* row_stats, u64 n, int counted, double* stats) {
    double loss = 0.0, hits = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        loss += row_stats[i];
        hits += row_stats[n + i];
    }
    loss = block_sum(loss);
    hits = block_sum(hits);
    if (threadIdx.x == 0) {
        stats[0] += loss;
        stats[1] += hits;
        stats[2] += counted ? row_stats[2 * n] : (double)n;
    }
}
