// What the kernels (kernels/*.cu) need of CUDA, for running them on the host: a launch runs
// its blocks one after another, and a block's threads as fibers on one host thread. A thread
// runs until it finishes or waits: at __syncthreads until every thread of the block is there,
// at a warp shuffle until its 32 lanes are. A barrier some threads never reach
// is reported as a failure (on a GPU it hangs or is undefined). Between barriers each warp runs
// as far as it can before the next one starts, in index order, or in reverse when
// `host_gpu::reverse_order` is set: a kernel that reads shared memory without the barrier that
// orders it gives different results in the two orders.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

// Switching fibers: glibc's swapcontext saves and restores the signal mask, a system call at
// every switch, which made a launch of a few thousand threads cost milliseconds (the emulated
// GPU of tests/emulated_cuda runs whole training jobs through this). On x86-64 a switch is
// the callee-saved registers and the stack pointer, written out here.
#if defined(__x86_64__)
extern "C" void host_gpu_switch(void** save_sp, void* next_sp);
asm(R"(
    .text
    .globl host_gpu_switch
    .type host_gpu_switch, @function
host_gpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size host_gpu_switch, .-host_gpu_switch
)");
#define HOST_GPU_FAST_SWITCH 1
#endif

struct Dim3 {
    unsigned x, y, z;
};
// Not static: the fibers switch under the compiler's feet, so these live in memory.
Dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}

namespace host_gpu {
const unsigned MAX_THREADS = 1024;
const size_t STACK_BYTES = 64 * 1024;
enum State { Ready, AtSyncthreads, AtShuffle, Done };

struct Fiber {
#ifdef HOST_GPU_FAST_SWITCH
    void* sp;  // its saved stack pointer, where host_gpu_switch left it
#else
    ucontext_t context;
#endif
    State state;
};
Fiber fibers[MAX_THREADS];
#ifdef HOST_GPU_FAST_SWITCH
void* scheduler;
#else
ucontext_t scheduler;
#endif
unsigned current, block_threads;
bool reverse_order = false;
int barrier_failures = 0;
char* stacks = (char*)malloc(MAX_THREADS * STACK_BYTES);
void (*body)(void*);
void* body_arg;
uint64_t shuffle_slots[MAX_THREADS];

inline unsigned thread_id() { return threadIdx.x + threadIdx.y * blockDim.x; }

// Set while a launch runs its threads as plain calls, one after another (`launch_blocks`
// for a kernel that never waits): nothing can wait then.
bool direct = false;

// Back to the scheduler until the barrier `s` lets this thread go.
inline void wait(State s) {
    if (direct) {
        printf("a kernel launched as one that never waits reached a barrier or a shuffle\n");
        abort();
    }
    fibers[current].state = s;
#ifdef HOST_GPU_FAST_SWITCH
    host_gpu_switch(&fibers[current].sp, scheduler);
#else
    swapcontext(&fibers[current].context, &scheduler);
#endif
    asm volatile("" ::: "memory");
}

inline void fiber_main() {
    body(body_arg);
    fibers[current].state = Done;
#ifdef HOST_GPU_FAST_SWITCH
    void* finished;
    host_gpu_switch(&finished, scheduler);  // never resumed
#endif
    // (with ucontext, returning goes back to the scheduler: uc_link)
}

// Each lane gets `v` of lane `source(lane)` of its warp.
template <class T, class Source>
T shuffle(T v, Source source) {
    unsigned id = thread_id(), lane = id & 31;
    memcpy(&shuffle_slots[id], &v, sizeof(T));
    wait(AtShuffle);
    T got;
    memcpy(&got, &shuffle_slots[id - lane + source(lane)], sizeof(T));
    wait(AtShuffle);  // no lane writes its slot again before every lane has read
    return got;
}

// mma.sync.m16n8k16 with bf16 operands and f32 sums, as flash_mma.cu's
// mma_bf16_m16n8k16 documents the lanes' parts: the warp's lanes publish theirs, then each
// computes its four results (exact products, summed in double, rounded once).
uint32_t mma_slots[MAX_THREADS][6];
inline float bf16_value(uint32_t bits) {
    uint32_t u = bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline void mma_bf16_m16n8k16(float* d, const uint32_t* a, const uint32_t* b) {
    unsigned id = thread_id(), lane = id & 31, first = id - lane;
    memcpy(mma_slots[id], a, 16);
    memcpy(mma_slots[id] + 4, b, 8);
    wait(AtShuffle);
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        unsigned g = l / 4, c = 2 * (l % 4);
        const uint32_t* s = mma_slots[first + l];
        for (unsigned r = 0; r < 4; r++) {
            unsigned row = g + 8 * (r & 1), col = c + 8 * (r >> 1);
            A[row][col] = bf16_value(s[r] & 0xffffu);
            A[row][col + 1] = bf16_value(s[r] >> 16);
        }
        for (unsigned r = 0; r < 2; r++) {
            B[c + 8 * r][g] = bf16_value(s[4 + r] & 0xffffu);
            B[c + 8 * r + 1][g] = bf16_value(s[4 + r] >> 16);
        }
    }
    wait(AtShuffle);  // no lane writes its slot again before every lane has read
    unsigned g = lane / 4, c = 2 * (lane % 4);
    for (unsigned e = 0; e < 4; e++) {
        unsigned row = g + 8 * (e / 2), col = c + (e & 1);
        double sum = d[e];
        for (unsigned k = 0; k < 16; k++) sum += (double)A[row][k] * (double)B[k][col];
        d[e] = (float)sum;
    }
}

// ldmatrix .x4, as flash_mma.cu's ldmatrix_x4 documents it: the lanes publish their rows'
// addresses, then each reads its four registers.
inline void ldmatrix_x4(uint32_t* r, const uint16_t* row, bool trans) {
    unsigned id = thread_id(), lane = id & 31, first = id - lane;
    memcpy(&shuffle_slots[id], &row, sizeof row);
    wait(AtShuffle);
    unsigned g = lane / 4, c = 2 * (lane % 4);
    for (unsigned m = 0; m < 4; m++) {
        const uint16_t* rows[8];
        for (unsigned k = 0; k < 8; k++) memcpy(&rows[k], &shuffle_slots[first + 8 * m + k], sizeof rows[k]);
        uint32_t lo = trans ? rows[c][g] : rows[g][c], hi = trans ? rows[c + 1][g] : rows[g][c + 1];
        r[m] = lo | hi << 16;
    }
    wait(AtShuffle);  // no lane writes its slot again before every lane has read
}

inline void report(const char* why) {
    unsigned counts[4] = {0, 0, 0, 0};
    for (unsigned t = 0; t < block_threads; t++) counts[fibers[t].state]++;
    printf("block %u of a launch: %s (%u threads at __syncthreads, %u at a shuffle, %u finished)\n", blockIdx.x, why,
           counts[AtSyncthreads], counts[AtShuffle], counts[Done]);
    barrier_failures++;
}

// Runs the lanes of warp `w` as far as they go: until each has finished or waits at
// __syncthreads (a shuffle lets its lanes go once all 32 are there).
inline void run_warp(unsigned w) {
    for (;;) {
        for (unsigned k = 0; k < 32; k++) {
            unsigned t = w * 32 + (reverse_order ? 31 - k : k);
            if (fibers[t].state != Ready) continue;
            current = t;
            threadIdx = {t % blockDim.x, t / blockDim.x, 0};
#ifdef HOST_GPU_FAST_SWITCH
            host_gpu_switch(&scheduler, fibers[t].sp);
#else
            swapcontext(&scheduler, &fibers[t].context);
#endif
        }
        for (unsigned t = w * 32; t < w * 32 + 32; t++)
            if (fibers[t].state != AtShuffle) return;
        for (unsigned t = w * 32; t < w * 32 + 32; t++) fibers[t].state = Ready;
    }
}

// Runs every thread of block blockIdx until all have finished. Each warp runs as far as it can
// before the next starts (from the first warp, or from the last in reverse order), so a warp
// that reads shared memory without a barrier finds either nothing or everything written.
inline void run_block() {
#ifdef HOST_GPU_FAST_SWITCH
    for (unsigned t = 0; t < block_threads; t++) {
        // A fresh stack as host_gpu_switch leaves one: six saved registers (zeros), then the
        // address it returns to, fiber_main, entered with the stack aligned as after a call.
        void** top = (void**)(stacks + (t + 1) * STACK_BYTES);
        top[-1] = nullptr;
        top[-2] = (void*)&fiber_main;
        for (int r = 3; r <= 8; r++) top[-r] = nullptr;
        fibers[t].sp = top - 8;
        fibers[t].state = Ready;
    }
#else
    static ucontext_t blank;
    static bool has_blank = false;
    if (!has_blank) getcontext(&blank), has_blank = true;
    for (unsigned t = 0; t < block_threads; t++) {
        fibers[t].context = blank;
        fibers[t].context.uc_stack.ss_sp = stacks + t * STACK_BYTES;
        fibers[t].context.uc_stack.ss_size = STACK_BYTES;
        fibers[t].context.uc_link = &scheduler;
        makecontext(&fibers[t].context, fiber_main, 0);
        fibers[t].state = Ready;
    }
#endif
    const unsigned warps = block_threads / 32;
    for (;;) {
        for (unsigned k = 0; k < warps; k++) run_warp(reverse_order ? warps - 1 - k : k);
        unsigned done = 0, at_syncthreads = 0;
        for (unsigned t = 0; t < block_threads; t++) {
            done += fibers[t].state == Done;
            at_syncthreads += fibers[t].state == AtSyncthreads;
        }
        if (done == block_threads) return;
        if (at_syncthreads < block_threads) return report("a barrier that not every thread it waits for reaches");
        for (unsigned t = 0; t < block_threads; t++) fibers[t].state = Ready;
    }
}
}  // namespace host_gpu

template <class T>
T __shfl_down_sync(unsigned, T v, int delta) {
    return host_gpu::shuffle(v, [=](unsigned lane) { return lane + delta < 32 ? lane + delta : lane; });
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) {
    return host_gpu::shuffle(v, [=](unsigned lane) { return lane ^ mask; });
}
inline void __syncthreads() { host_gpu::wait(host_gpu::AtSyncthreads); }
// A warp's barrier: its lanes go on once all 32 are there, as at a shuffle.
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)__shfl_xor_sync(mask, 0, 0); }

// Runs `kernel` (a closure calling one kernel) as a launch of `grid` blocks of `block` threads
// (a multiple of 32, at most 1024). A kernel with no barrier and no shuffle (`may_wait`
// false) runs its threads as plain calls, without fibers: the same result, faster.
template <class K>
void launch_blocks(unsigned grid, Dim3 block, K kernel, bool may_wait = true) {
    using namespace host_gpu;
    block_threads = block.x * block.y * block.z;
    if (block_threads == 0 || block_threads % 32 != 0 || block_threads > MAX_THREADS) {
        printf("launch of %u threads a block: not a multiple of 32 up to %u\n", block_threads, MAX_THREADS);
        barrier_failures++;
        return;
    }
    blockDim = block;
    gridDim = {grid, 1, 1};
    body = [](void* k) { (*(K*)k)(); };
    body_arg = &kernel;
    direct = !may_wait;
    for (unsigned b = 0; b < grid; b++) {
        blockIdx = {b, 0, 0};
        if (may_wait) {
            run_block();
            continue;
        }
        for (unsigned t = 0; t < block_threads; t++) {
            current = t;
            threadIdx = {t % blockDim.x, t / blockDim.x, 0};
            body(body_arg);
        }
    }
    direct = false;
}

// A launch of blocks of 256 threads covering `threads` (at most 65536 blocks), as
// src/tensor/cuda's `grid`.
template <class K>
void launch(uint64_t threads, K kernel) {
    uint64_t blocks = (threads + 255) / 256;
    blocks = blocks < 1 ? 1 : blocks > 65536 ? 65536 : blocks;
    launch_blocks((unsigned)blocks, {256, 1, 1}, kernel);
}
