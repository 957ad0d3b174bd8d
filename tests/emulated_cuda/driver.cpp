// An emulated GPU: the parts of the CUDA driver API and of cuBLAS that src/tensor/cuda calls
// and NCCL that src/tensor/cuda calls (through cudarc), implemented on the host, so that the
// CUDA backend's own code (buffer sizes and storages, launch arguments, cuBLAS parameters,
// stream capture and replay, the all-reduce's streams and events) runs in CI without a GPU.
// Built as libcuda.so, libcublas.so, libcublasLt.so and libnccl.so by tests/emulated_cuda/build.sh.
//
// - Device memory is host memory: every allocation ends at a guard page, so a kernel or a
//   copy that runs past a buffer's end faults (reported with the kernel's name); copies,
//   memsets and products are checked against the allocations they touch.
// - Kernels are kernels/*.cu built for the host (the module image NVRTC made is ignored), run
//   by tests/kernels_on_host/cuda_on_host.h: blocks one after another, a block's threads as
//   fibers where the kernel has barriers or warp shuffles (kernel_table.py finds which), so
//   those behave, else as plain calls.
// - Work is queued per stream and runs as late as CUDA allows (see `submit`), so a missing
//   event wait or a host write to a pinned buffer still being copied shows; a stream being
//   captured (and any stream that waits on an event recorded in it) records its work, which
//   a graph launch replays with the argument values of the capture, as CUDA does.
// - cuBLAS products are loops accumulating in double, inputs and output in f32, f16 or bf16
//   (rounded to nearest even on store, as cuBLAS rounds its f32 result once); cuBLASLt's too,
//   with its bias and ReLU epilogues, and the descriptors, preferences and heuristic that
//   lead to one.
// - TRAINER_EMULATED_CUBLASLT=no-algorithm makes cuBLASLt's heuristic find no algorithm,
//   =refuses makes cublasLtMatmul refuse every product (CUBLAS_STATUS_NOT_SUPPORTED),
//   =invalid makes it call every product invalid (CUBLAS_STATUS_INVALID_VALUE), and
//   =bad-attribute makes setting a descriptor's epilogue fail (INVALID_VALUE): what a real
//   one may do for a shape, a pointer or an attribute it lacks, which the backend must
//   survive.
// - TRAINER_EMULATED_TRACE=FILE appends a line per kernel launch ("kernel NAME") and per
//   product ("cublasSgemm", "cublasGemmEx", "cublasLtMatmul EPILOGUE"), in the order they
//   are queued (a replayed graph adds none): for tests of which work a job queues. A cuBLAS
//   product with an operand off 16 bytes, which a real cuBLAS runs on its slower kernels for
//   unaligned data, is "cublasSgemm unaligned" or "cublasGemmEx unaligned".
//
// - NCCL's all-reduce between processes goes through files (see the NCCL section below); one
//   waiting for its peers leaves its stream not ready (cuEventQuery says so) until they come,
//   so the host's timeout on it runs. TRAINER_EMULATED_NCCL_STALL=RANK:N stalls one.
//
// One lock serialises every call: tests drive several contexts from several threads.
#include "../kernels_on_host/cuda_on_host.h"
#include "kernels.cu"

#include <signal.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

struct KernelEntry {
    const char* name;
    void (*thunk)(void**);
    int params;
    const size_t* sizes;
    bool may_wait;  // reaches a barrier or a warp shuffle: its threads run as fibers
};
#include "kernel_table.inc"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_FAILED = 719,
    CAPTURE_UNSUPPORTED = 900,
};

namespace emu {
std::recursive_mutex lock;
#define LOCKED std::lock_guard<std::recursive_mutex> guard(emu::lock)

// TRAINER_EMULATED_TRACE's file, if any: one line per queued kernel or product.
void trace(const char* fmt, const char* what) {
    static FILE* out = [] {
        const char* path = getenv("TRAINER_EMULATED_TRACE");
        return path && *path ? fopen(path, "a") : nullptr;
    }();
    if (!out) return;
    fprintf(out, fmt, what);
    fputc('\n', out);
    fflush(out);
}

// A cuBLAS product in the trace, marked "unaligned" where an operand is off 16 bytes.
void trace_product(const char* name, const void* a, const void* b, const void* c) {
    bool aligned = ((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0;
    trace(aligned ? "%s" : "%s unaligned", name);
}

// A failure that CUDA makes sticky (an illegal address, a failed launch): every later call
// returns it, as a real context does.
int sticky = SUCCESS;

void fail(int code, const char* fmt, const char* what) {
    fprintf(stderr, "emulated GPU: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    if (sticky == SUCCESS) sticky = code;
}

struct Allocation {
    size_t bytes;
    char* base;  // of the mapping, guard page included
    size_t span;
};
std::map<uintptr_t, Allocation> allocations;  // by start address
size_t allocated = 0;
const size_t PAGE = 4096;
const size_t TOTAL_MEMORY = 80ull << 30;

// Free device memory: an 80 GiB device's, but never more than the host has free, since the
// device's memory is the host's (a job planned for 80 GiB would be killed, not refused).
size_t free_memory() {
    struct sysinfo info;
    size_t host = sysinfo(&info) == 0 ? (size_t)(info.freeram + info.bufferram) * info.mem_unit : TOTAL_MEMORY;
    size_t device = TOTAL_MEMORY - allocated;
    return host < device ? host : device;
}

// `bytes` of zeros ending at a guard page, 16-byte aligned (what the kernels' vectorised
// paths need; cudaMalloc's 256 would leave up to 240 bytes of slack before the guard).
void* allocate(size_t bytes) {
    size_t body = (bytes + 15) / 16 * 16;
    if (body == 0) body = 16;
    size_t span = (body + PAGE - 1) / PAGE * PAGE + PAGE;
    char* base = (char*)mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    mprotect(base + span - PAGE, PAGE, PROT_NONE);
    char* start = base + span - PAGE - body;
    allocations[(uintptr_t)start] = {bytes, base, span};
    allocated += bytes;
    return start;
}

bool release(uintptr_t start) {
    auto it = allocations.find(start);
    if (it == allocations.end()) return false;
    allocated -= it->second.bytes;
    munmap(it->second.base, it->second.span);
    allocations.erase(it);
    return true;
}

// Whether [p, p + bytes) lies inside one device allocation.
bool inside(uintptr_t p, size_t bytes) {
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p >= it->first && p + bytes <= it->first + it->second.bytes;
}

bool check_range(uintptr_t p, size_t bytes, const char* what) {
    if (bytes == 0 || inside(p, bytes)) return true;
    char message[160];
    snprintf(message, sizeof message, "%zu bytes at 0x%llx, not inside one device allocation", bytes,
             (unsigned long long)p);
    fail(ILLEGAL_ADDRESS, "%s", (std::string(what) + ": " + message).c_str());
    return false;
}

// Pinned host memory (cuMemHostAlloc), by start: its size. A copy to or from it runs when
// its stream gets there; one to or from other (pageable) memory, at the call, as CUDA does.
std::map<uintptr_t, size_t> pinned;

bool is_pinned(const void* p, size_t bytes) {
    auto it = pinned.upper_bound((uintptr_t)p);
    if (it == pinned.begin()) return false;
    --it;
    return (uintptr_t)p >= it->first && (uintptr_t)p + bytes <= it->first + it->second;
}

// The kernel running now, for the fault handler's report.
const char* running = nullptr;

void on_fault(int sig, siginfo_t* info, void*) {
    fprintf(stderr, "emulated GPU: %s at address %p, %s\n", sig == SIGSEGV ? "segmentation fault" : "bus error",
            info->si_addr,
            running ? (std::string("in kernel ") + running + " (past the end of a device buffer?)").c_str()
                    : "outside any kernel");
    signal(sig, SIG_DFL);
    raise(sig);
}

struct FaultHandler {
    FaultHandler() {
        struct sigaction action = {};
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO;
        sigaction(SIGSEGV, &action, nullptr);
        sigaction(SIGBUS, &action, nullptr);
    }
};

// Work is queued per stream and runs only when the host waits for it (a stream or event
// synchronisation, a copy to pageable memory, a free) or when another stream's queued wait
// on an event needs it: as late as CUDA may run it. A host write to a pinned buffer that a
// queued copy still has to read, or a stream reading what another stream writes without
// waiting on its event, then gives wrong numbers here as it may on a GPU.
typedef std::function<void()> Op;

struct Stream;

// A capture's work, and for the check that ends it (every stream that joined must be
// joined back): the operations each stream recorded, and how many of each the origin
// stream has waited for through an event.
struct Capture {
    std::vector<Op> ops;
    std::map<Stream*, unsigned long long> recorded, rejoined;
};

// A queued operation, or (op empty) a wait until `stream` has run `position` entries.
struct Entry {
    Op op;
    Stream* stream;
    unsigned long long position;
};

struct Stream {
    std::shared_ptr<Capture> capture;  // set while this stream's work is being recorded
    std::vector<Entry> queue;          // entries not yet run
    unsigned long long queued = 0;     // entries ever queued
    unsigned long long ran = 0;        // entries run
    bool running = false;
};
Stream legacy_stream;
std::set<Stream*> streams;  // every live stream but the legacy one

struct Event {
    std::shared_ptr<Capture> capture;  // recorded in a capturing stream: which, after how
    Stream* captured_in = nullptr;     // many of that stream's recorded operations
    unsigned long long captured_after = 0;
    Stream* stream = nullptr;          // recorded outside a capture: where, and after how
    unsigned long long position = 0;   // many of its entries
    bool timing = true;                // created without CU_EVENT_DISABLE_TIMING
    // When its stream reached it (ms on the host's monotonic clock); NaN until then. Shared
    // with the stamp queued by cuEventRecord, which a later record leaves writing to an
    // orphan.
    std::shared_ptr<double> reached = std::make_shared<double>(NAN);
};

double now_ms() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct Graph {
    std::vector<Op> ops;
};

Stream* stream_of(void* handle) { return handle ? (Stream*)handle : &legacy_stream; }

// Thrown by an operation that waits for another process (an NCCL all-reduce whose peers'
// buffers are not all there yet): it stays queued, and runs again when the host next waits.
struct NotReady {};

// Runs `s`'s queue until `position` entries have run, or until an operation is not ready
// (then returns false: what CUDA's queries call not ready, where the host may poll).
bool advance(Stream* s, unsigned long long position) {
    if (s->ran >= position) return true;
    if (s->running) {  // it waits (further down) for what waits for this
        fail(LAUNCH_FAILED, "%s", "streams waiting on each other's events (a deadlock on a GPU)");
        return true;
    }
    s->running = true;
    size_t done = 0;
    bool ready = true;
    while (s->ran < position && done < s->queue.size()) {
        Entry& e = s->queue[done];
        if (e.op) {
            if (sticky == SUCCESS) {
                try {
                    e.op();
                } catch (const NotReady&) {
                    ready = false;
                    break;
                }
            }
        } else if (!advance(e.stream, e.position)) {
            ready = false;
            break;
        }
        done++;
        s->ran++;
    }
    s->queue.erase(s->queue.begin(), s->queue.begin() + done);
    s->running = false;
    return ready;
}

// The host waiting for `s`'s first `position` entries, as a synchronising call does: an
// operation waiting for another process is retried every millisecond. NCCL waits for a
// missing peer forever; this gives up after ten minutes so that a broken test ends.
void run_until(Stream* s, unsigned long long position) {
    for (long waited_ms = 0; !advance(s, position); waited_ms++) {
        if (waited_ms == 600000) fail(LAUNCH_FAILED, "%s", "an operation waited ten minutes for another process");
        usleep(1000);
    }
}

void run_all(Stream* s) { run_until(s, s->queued); }

void run_everything() {
    for (Stream* s : streams) run_all(s);
}

// Queues `op` on `stream`, or records it when the stream is being captured. The legacy
// stream waits for every other (blocking streams would; cudarc's are non-blocking, and this
// is the stricter order), then runs it at once.
CUresult submit(void* handle, Op op) {
    if (sticky != SUCCESS) return sticky;
    Stream* s = stream_of(handle);
    if (s->capture) {
        s->capture->ops.push_back(std::move(op));
        s->capture->recorded[s]++;
        return SUCCESS;
    }
    if (s == &legacy_stream) {
        run_everything();
        if (sticky == SUCCESS) op();
        return sticky;
    }
    s->queue.push_back({std::move(op), nullptr, 0});
    s->queued++;
    // CUDA_LAUNCH_BLOCKING=1, as the driver: every call returns once its work is done, so a
    // fault is reported by the call that queued it.
    static const bool blocking = getenv("CUDA_LAUNCH_BLOCKING") && atoi(getenv("CUDA_LAUNCH_BLOCKING")) == 1;
    if (blocking) run_all(s);
    return sticky;
}

int device_count() {
    const char* n = getenv("TRAINER_EMULATED_GPUS");
    return n ? atoi(n) : 1;
}

// TRAINER_EMULATED_FAULT=N: the Nth kernel to run faults instead (an illegal address, which
// CUDA makes sticky), for testing what a run does after a device error.
unsigned long long kernels_run = 0;

void run_kernel(const KernelEntry* k, unsigned grid, Dim3 block, std::vector<char> args) {
    static const char* fault_at = getenv("TRAINER_EMULATED_FAULT");
    if (fault_at && ++kernels_run == strtoull(fault_at, nullptr, 10)) {
        fail(ILLEGAL_ADDRESS, "kernel %s: an illegal address (injected by TRAINER_EMULATED_FAULT)", k->name);
        return;
    }
    std::vector<void*> pointers(k->params);
    size_t at = 0;
    for (int i = 0; i < k->params; i++) pointers[i] = args.data() + at, at += k->sizes[i];
    int failures_before = host_gpu::barrier_failures;
    running = k->name;
    launch_blocks(grid, block, [&] { k->thunk(pointers.data()); }, k->may_wait);
    running = nullptr;
    if (host_gpu::barrier_failures != failures_before) fail(LAUNCH_FAILED, "kernel %s: a barrier not every thread reaches", k->name);
}

// Reads a value of storage `type` (cudaDataType: 0 f32, 2 f16, 14 bf16).
inline double element(const void* p, int type, size_t i) {
    return load(p, type == 0 ? 0 : type == 2 ? 1 : 2, i);
}
inline void set_element(void* p, int type, size_t i, double v) { store(p, type == 0 ? 0 : type == 2 ? 1 : 2, i, (float)v); }
inline size_t type_bytes(int type) { return type == 0 ? 4 : 2; }

struct Blas {
    void* stream = nullptr;
};

// What cuBLASLt's epilogue does after the product: adds bias[i] (of storage `type`) to row i,
// then applies ReLU; none by default, as cublasGemmEx.
struct Epilogue {
    const void* bias = nullptr;
    int type = 0;
    bool relu = false;
};

// Column-major C = alpha·op(A)·op(B) + beta·C (then the epilogue), queued on `stream`, as
// cublasGemmEx and cublasLtMatmul.
CUresult gemm(void* stream, int transa, int transb, int m, int n, int k, float alpha, const void* a, int atype,
              int lda, const void* b, int btype, int ldb, float beta, void* c, int ctype, int ldc,
              Epilogue epilogue = {}) {
    const int INVALID = 7;  // CUBLAS_STATUS_INVALID_VALUE
    int a_rows = transa ? k : m, a_cols = transa ? m : k;
    int b_rows = transb ? n : k, b_cols = transb ? k : n;
    if (m < 0 || n < 0 || k < 0 || lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) ||
        ldc < (m > 1 ? m : 1))
        return INVALID;
    for (int t : {atype, btype, ctype})
        if (t != 0 && t != 2 && t != 14) return INVALID;
    if (m == 0 || n == 0) return SUCCESS;
    auto extent = [](int rows, int cols, int ld, int type) {
        return rows == 0 || cols == 0 ? 0 : ((size_t)(cols - 1) * ld + rows) * type_bytes(type);
    };
    if (k > 0 && (!check_range((uintptr_t)a, extent(a_rows, a_cols, lda, atype), "cuBLAS product, A") ||
                  !check_range((uintptr_t)b, extent(b_rows, b_cols, ldb, btype), "cuBLAS product, B")))
        return INVALID;
    if (!check_range((uintptr_t)c, extent(m, n, ldc, ctype), "cuBLAS product, C")) return INVALID;
    if (epilogue.bias && !check_range((uintptr_t)epilogue.bias, m * type_bytes(epilogue.type), "cuBLASLt bias"))
        return INVALID;
    return submit(stream, [=] {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double sum = 0;
                for (int l = 0; l < k; l++) {
                    double x = element(a, atype, transa ? l + (size_t)i * lda : i + (size_t)l * lda);
                    double y = element(b, btype, transb ? j + (size_t)l * ldb : l + (size_t)j * ldb);
                    sum += x * y;
                }
                size_t at = i + (size_t)j * ldc;
                double out = (double)alpha * sum;
                if (beta != 0.0f) out += (double)beta * element(c, ctype, at);
                if (epilogue.bias) out += element(epilogue.bias, epilogue.type, i);
                // NaN becomes 0, as CUTLASS's ReLU (fmaxf) makes it: what cuBLASLt's does is
                // unknown, so the backend must not depend on its passing NaN on.
                if (epilogue.relu && !(out > 0)) out = 0;
                set_element(c, ctype, at, out);
            }
    });
}
}  // namespace emu

static emu::FaultHandler fault_handler;

#define CHECK_STICKY \
    if (emu::sticky != SUCCESS) return emu::sticky

extern "C" {

// ---- initialisation, devices, contexts

CUresult cuInit(unsigned) { return SUCCESS; }
CUresult cuDriverGetVersion(int* v) { return *v = 13000, SUCCESS; }
CUresult cuDeviceGetCount(int* n) { return *n = emu::device_count(), SUCCESS; }
CUresult cuDeviceGet(int* dev, int ordinal) {
    if (ordinal < 0 || ordinal >= emu::device_count()) return 101;  // CUDA_ERROR_INVALID_DEVICE
    return *dev = ordinal, SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, int dev) {
    snprintf(name, len, "Emulated GPU %d (host CPU)", dev);
    return SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int) { return *bytes = emu::TOTAL_MEMORY, SUCCESS; }
// TRAINER_EMULATED_CC=7.5 (say) emulates an older GPU; 9.0 (an H100's) by default.
static int compute_capability(bool major) {
    const char* cc = getenv("TRAINER_EMULATED_CC");
    int a = 9, b = 0;
    if (cc) sscanf(cc, "%d.%d", &a, &b);
    return major ? a : b;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, int) {
    switch (attribute) {
        case 75: *value = compute_capability(true); break;   // compute capability major
        case 76: *value = compute_capability(false); break;  // minor
        case 115: *value = 1; break;    // memory pools supported
        case 16: *value = 132; break;   // multiprocessors
        case 1: *value = 1024; break;   // max threads per block
        case 10: *value = 32; break;    // warp size
        default: *value = 0;
    }
    return SUCCESS;
}
CUresult cuDeviceGetUuid_v2(void* uuid, int dev) {
    memset(uuid, 0, 16);
    ((unsigned char*)uuid)[0] = (unsigned char)dev;
    return SUCCESS;
}
CUresult cuDeviceGetUuid(void* uuid, int dev) { return cuDeviceGetUuid_v2(uuid, dev); }

static int contexts[64];
static thread_local void* current_context = nullptr;
CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) { return *ctx = &contexts[dev & 63], SUCCESS; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return SUCCESS; }
CUresult cuCtxSetCurrent(void* ctx) { return current_context = ctx, SUCCESS; }
CUresult cuCtxGetCurrent(void** ctx) { return *ctx = current_context, SUCCESS; }
CUresult cuCtxSynchronize() {
    LOCKED;
    emu::run_everything();
    return emu::sticky;
}

// ---- memory

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    LOCKED;
    CHECK_STICKY;
    if (bytes > emu::free_memory()) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
    void* start = emu::allocate(bytes);
    if (!start) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
    return *p = (CUdeviceptr)start, SUCCESS;
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void* stream) {
    LOCKED;
    if (emu::stream_of(stream)->capture) return CAPTURE_UNSUPPORTED;  // no allocation in a recorded step
    return cuMemAlloc_v2(p, bytes);
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    LOCKED;
    emu::run_everything();  // cuMemFree waits for the device
    if (!emu::release(p)) return emu::fail(INVALID_VALUE, "%s", "cuMemFree of an address that is no allocation"), INVALID_VALUE;
    return SUCCESS;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void* stream) {
    LOCKED;
    if (emu::stream_of(stream)->capture) return CAPTURE_UNSUPPORTED;
    if (!emu::inside(p, 1)) return INVALID_VALUE;
    return emu::submit(stream, [=] { emu::release(p); });  // freed when the stream gets there
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    LOCKED;
    *total = emu::TOTAL_MEMORY;
    *free_bytes = emu::free_memory();
    return SUCCESS;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    LOCKED;
    *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!*p) return 2;
    emu::pinned[(uintptr_t)*p] = bytes;
    return SUCCESS;
}
CUresult cuMemFreeHost(void* p) {
    LOCKED;
    emu::run_everything();  // as cuMemFreeHost, which waits for the device
    emu::pinned.erase((uintptr_t)p);
    free(p);
    return SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, void* stream) {
    LOCKED;
    CHECK_STICKY;
    if (!emu::check_range(dst, bytes, "copy to the device")) return emu::sticky;
    if (emu::is_pinned(src, bytes)) return emu::submit(stream, [=] { memcpy((void*)dst, src, bytes); });
    // Pageable memory is read at the call (CUDA stages it), and cannot be captured.
    if (emu::stream_of(stream)->capture) return CAPTURE_UNSUPPORTED;
    auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
    return emu::submit(stream, [=] { memcpy((void*)dst, staged->data(), bytes); });
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, void* stream) {
    LOCKED;
    CHECK_STICKY;
    if (!emu::check_range(src, bytes, "copy from the device")) return emu::sticky;
    if (emu::is_pinned(dst, bytes)) return emu::submit(stream, [=] { memcpy(dst, (const void*)src, bytes); });
    // Into pageable memory the copy is done when the call returns.
    emu::Stream* s = emu::stream_of(stream);
    if (s->capture) return CAPTURE_UNSUPPORTED;
    if (s == &emu::legacy_stream) emu::run_everything();
    else emu::run_all(s);
    CHECK_STICKY;
    memcpy(dst, (const void*)src, bytes);
    return SUCCESS;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* stream) {
    LOCKED;
    CHECK_STICKY;
    if (!emu::check_range(dst, bytes, "device copy, destination") ||
        !emu::check_range(src, bytes, "device copy, source"))
        return emu::sticky;
    return emu::submit(stream, [=] { memmove((void*)dst, (const void*)src, bytes); });
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) { return cuMemcpyHtoDAsync_v2(dst, src, bytes, nullptr); }
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) { return cuMemcpyDtoHAsync_v2(dst, src, bytes, nullptr); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) { return cuMemcpyDtoDAsync_v2(dst, src, bytes, nullptr); }
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void*, CUdeviceptr src, void*, size_t bytes, void* stream) {
    return cuMemcpyDtoDAsync_v2(dst, src, bytes, stream);
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, void* stream) {
    LOCKED;
    CHECK_STICKY;
    if (!emu::check_range(dst, n, "memset")) return emu::sticky;
    return emu::submit(stream, [=] { memset((void*)dst, value, n); });
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) { return cuMemsetD8Async(dst, value, n, nullptr); }

// ---- streams and events

CUresult cuStreamCreate(void** stream, unsigned) {
    LOCKED;
    auto s = new emu::Stream();
    emu::streams.insert(s);
    return *stream = s, SUCCESS;
}
CUresult cuStreamCreateWithPriority(void** stream, unsigned flags, int) { return cuStreamCreate(stream, flags); }
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) { return *least = 0, *greatest = -5, SUCCESS; }
CUresult cuStreamDestroy_v2(void* stream) {
    LOCKED;
    emu::run_everything();  // its work completes; another stream's queued wait may name it
    emu::streams.erase((emu::Stream*)stream);
    delete (emu::Stream*)stream;
    return SUCCESS;
}
CUresult cuStreamSynchronize(void* stream) {
    LOCKED;
    emu::Stream* s = emu::stream_of(stream);
    if (s->capture) return CAPTURE_UNSUPPORTED;
    if (s == &emu::legacy_stream) emu::run_everything();
    else emu::run_all(s);
    return emu::sticky;
}
CUresult cuStreamQuery(void* stream) { return cuStreamSynchronize(stream); }
CUresult cuEventCreate(void** event, unsigned flags) {
    LOCKED;
    auto e = new emu::Event();
    e->timing = !(flags & 2);  // CU_EVENT_DISABLE_TIMING
    return *event = e, SUCCESS;
}
CUresult cuEventDestroy_v2(void* event) {
    LOCKED;
    delete (emu::Event*)event;
    return SUCCESS;
}
CUresult cuEventRecord(void* event, void* stream) {
    LOCKED;
    CHECK_STICKY;
    auto e = (emu::Event*)event;
    emu::Stream* s = emu::stream_of(stream);
    e->capture = s->capture;
    if (s->capture) e->captured_in = s, e->captured_after = s->capture->recorded[s];
    // Outside a capture, a timing event stamps the time its stream reaches it: queued work
    // runs when the host waits, so the time between two events is that of the emulated work
    // between them.
    e->reached = std::make_shared<double>(NAN);
    if (e->timing && !s->capture) {
        auto reached = e->reached;
        emu::submit(stream, [reached] { *reached = emu::now_ms(); });
    }
    // The legacy stream runs its work at once: an event there is complete.
    e->stream = s->capture || s == &emu::legacy_stream ? nullptr : s;
    e->position = s->queued;
    return SUCCESS;
}
// The event's work is run (the host is asking for it): complete, unless an operation in it
// waits for another process.
CUresult cuEventQuery(void* event) {
    LOCKED;
    auto e = (emu::Event*)event;
    if (e->capture) return CAPTURE_UNSUPPORTED;
    if (e->stream && emu::streams.count(e->stream) && !emu::advance(e->stream, e->position))
        return emu::sticky != SUCCESS ? emu::sticky : NOT_READY;
    return emu::sticky;
}
CUresult cuEventSynchronize(void* event) {
    LOCKED;
    auto e = (emu::Event*)event;
    if (e->capture) return CAPTURE_UNSUPPORTED;
    if (e->stream && emu::streams.count(e->stream)) emu::run_until(e->stream, e->position);
    return emu::sticky;
}
// As CUDA: an event without timing is an invalid handle; one not reached yet is not ready.
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    LOCKED;
    auto a = (emu::Event*)start, b = (emu::Event*)end;
    if (!a->timing || !b->timing || a->capture || b->capture) return INVALID_HANDLE;
    if (std::isnan(*a->reached) || std::isnan(*b->reached)) return NOT_READY;
    *ms = (float)(*b->reached - *a->reached);
    return SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }
// A stream that waits on an event recorded in a capturing stream joins that capture;
// otherwise the wait is queued: the stream runs the event's work before what follows.
CUresult cuStreamWaitEvent(void* stream, void* event, unsigned) {
    LOCKED;
    CHECK_STICKY;
    emu::Stream* s = emu::stream_of(stream);
    auto e = (emu::Event*)event;
    if (e->capture) {
        s->capture = e->capture;
        auto& seen = e->capture->rejoined[e->captured_in];
        seen = std::max(seen, e->captured_after);
        return SUCCESS;
    }
    if (!e->stream || !emu::streams.count(e->stream) || e->stream == s || s->capture) return SUCCESS;  // nothing to wait for
    if (s == &emu::legacy_stream) {
        emu::run_until(e->stream, e->position);
        return emu::sticky;
    }
    s->queue.push_back({emu::Op(), e->stream, e->position});
    s->queued++;
    return SUCCESS;
}

// ---- stream capture and graphs

CUresult cuStreamBeginCapture_v2(void* stream, int) {
    LOCKED;
    CHECK_STICKY;
    emu::Stream* s = emu::stream_of(stream);
    if (s == &emu::legacy_stream || s->capture) return CAPTURE_UNSUPPORTED;
    s->capture = std::make_shared<emu::Capture>();
    return SUCCESS;
}
CUresult cuStreamIsCapturing(void* stream, int* status) {
    LOCKED;
    return *status = emu::stream_of(stream)->capture ? 1 : 0, SUCCESS;
}
// Ends the capture begun on `stream`; every stream that joined it leaves it too, and must
// have been joined back: its recorded work followed by an event that the capture waited on.
CUresult cuStreamEndCapture(void* stream, void** graph) {
    LOCKED;
    emu::Stream* s = emu::stream_of(stream);
    if (!s->capture) return INVALID_VALUE;
    auto capture = s->capture;
    s->capture.reset();
    bool unjoined = false;
    for (emu::Stream* joined : emu::streams) {
        if (joined->capture != capture) continue;
        joined->capture.reset();
        // Its last recorded operation must precede an event some stream of the capture
        // waited on (CUDA asks the origin; any waiter is looser, and simpler to track).
        unjoined |= capture->rejoined[joined] < capture->recorded[joined];
    }
    if (unjoined) {  // the capture is lost, the context not (no sticky error)
        fprintf(stderr, "emulated GPU: a stream joined the capture and was not joined back before it ended\n");
        return 904;  // CUDA_ERROR_STREAM_CAPTURE_UNJOINED
    }
    *graph = new emu::Graph{capture->ops};
    capture->ops.clear();
    return emu::sticky;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    LOCKED;
    return *exec = new emu::Graph(*(emu::Graph*)graph), SUCCESS;
}
CUresult cuGraphUpload(void*, void*) { return SUCCESS; }
CUresult cuGraphLaunch(void* exec, void* stream) {
    LOCKED;
    CHECK_STICKY;
    emu::Graph* g = (emu::Graph*)exec;
    // Where a replay stopped for an operation that was not ready, it goes on next time.
    auto next = std::make_shared<size_t>(0);
    return emu::submit(stream, [g, next] {
        for (; *next < g->ops.size(); ++*next) {
            if (emu::sticky != SUCCESS) return;
            g->ops[*next]();
        }
    });
}
CUresult cuGraphDestroy(void* graph) {
    LOCKED;
    delete (emu::Graph*)graph;
    return SUCCESS;
}
CUresult cuGraphExecDestroy(void* exec) { return cuGraphDestroy(exec); }

// ---- modules and launches

// The module is the host build of the kernel program; a function, its KernelEntry.
static int the_module;
CUresult cuModuleLoadData(void** module, const void*) { return *module = &the_module, SUCCESS; }
CUresult cuModuleUnload(void*) { return SUCCESS; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    for (const KernelEntry& k : KERNELS)
        if (strcmp(k.name, name) == 0) return *f = (void*)&k, SUCCESS;
    return NOT_FOUND;
}
CUresult cuFuncSetAttribute(void*, int, int) { return SUCCESS; }
CUresult cuFuncGetAttribute(int* value, int, void*) { return *value = 0, SUCCESS; }

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* stream, void** params, void** extra) {
    LOCKED;
    CHECK_STICKY;
    const KernelEntry* k = (const KernelEntry*)f;
    if (gy != 1 || gz != 1 || shared != 0 || extra) {
        emu::fail(INVALID_VALUE, "launch of %s: only 1-D grids without dynamic shared memory are emulated", k->name);
        return INVALID_VALUE;
    }
    if (gx == 0 || gx > 2147483647u || bx * by * bz == 0 || bx * by * bz > 1024) {
        emu::fail(INVALID_VALUE, "launch of %s: a grid or block CUDA refuses", k->name);
        return INVALID_VALUE;
    }
    // The argument values are copied now, as cuLaunchKernel (and a capture) does.
    std::vector<char> args;
    for (int i = 0; i < k->params; i++) {
        const char* v = (const char*)params[i];
        args.insert(args.end(), v, v + k->sizes[i]);
    }
    Dim3 block = {bx, by, bz};
    emu::trace("kernel %s", k->name);
    return emu::submit(stream, [=] { emu::run_kernel(k, gx, block, args); });
}

CUresult cuGetErrorName(int code, const char** name) {
    static char text[32];
    snprintf(text, sizeof text, "CUDA_ERROR_%d", code);
    return *name = text, SUCCESS;
}
CUresult cuGetErrorString(int code, const char** s) { return cuGetErrorName(code, s); }

// ---- cuBLAS

int cublasCreate_v2(void** handle) { return *handle = new emu::Blas(), 0; }
int cublasDestroy_v2(void* handle) { return delete (emu::Blas*)handle, 0; }
int cublasSetStream_v2(void* handle, void* stream) { return ((emu::Blas*)handle)->stream = stream, 0; }
int cublasSetMathMode(void*, int) { return 0; }
int cublasSetWorkspace_v2(void*, void* workspace, size_t bytes) {
    LOCKED;
    return emu::check_range((uintptr_t)workspace, bytes, "cuBLAS workspace") ? 0 : 7;
}
int cublasSetPointerMode_v2(void*, int mode) { return mode == 0 ? 0 : 15; }  // host pointers only
int cublasGetPointerMode_v2(void*, int* mode) { return *mode = 0, 0; }

int cublasSgemm_v2(void* handle, int transa, int transb, int m, int n, int k, const float* alpha, const float* a,
                   int lda, const float* b, int ldb, const float* beta, float* c, int ldc) {
    LOCKED;
    if (emu::sticky != SUCCESS) return 14;  // CUBLAS_STATUS_INTERNAL_ERROR
    emu::trace_product("cublasSgemm", a, b, c);
    return emu::gemm(((emu::Blas*)handle)->stream, transa, transb, m, n, k, *alpha, a, 0, lda, b, 0, ldb, *beta, c, 0, ldc);
}

int cublasSgemmStridedBatched(void* handle, int transa, int transb, int m, int n, int k, const float* alpha,
                              const float* a, int lda, long long stride_a, const float* b, int ldb, long long stride_b,
                              const float* beta, float* c, int ldc, long long stride_c, int batch) {
    LOCKED;
    if (emu::sticky != SUCCESS) return 14;
    emu::trace_product("cublasSgemmStridedBatched", a, b, c);
    for (int i = 0; i < batch; i++) {
        int r = emu::gemm(((emu::Blas*)handle)->stream, transa, transb, m, n, k, *alpha, a + i * stride_a, 0, lda,
                          b + i * stride_b, 0, ldb, *beta, c + i * stride_c, 0, ldc);
        if (r != 0) return r;
    }
    return 0;
}

int cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* a,
                 int atype, int lda, const void* b, int btype, int ldb, const void* beta, void* c, int ctype, int ldc,
                 int compute, int) {
    LOCKED;
    if (emu::sticky != SUCCESS) return 14;
    const int COMPUTE_32F = 68, COMPUTE_32F_FAST_TF32 = 77;
    if (compute != COMPUTE_32F && compute != COMPUTE_32F_FAST_TF32) return 15;  // NOT_SUPPORTED
    emu::trace_product("cublasGemmEx", a, b, c);
    return emu::gemm(((emu::Blas*)handle)->stream, transa, transb, m, n, k, *(const float*)alpha, a, atype, lda, b, btype, ldb,
                     *(const float*)beta, c, ctype, ldc);
}

// ---- cuBLASLt: the descriptors keep what was set; the heuristic offers one algorithm (which
// remembers the alignments it was asked for) for the epilogues emulated: none, bias, ReLU,
// bias then ReLU.

namespace emu {
struct LtDesc {
    int compute, scale;
    int transa = 0, transb = 0;
    unsigned epilogue = 1;  // CUBLASLT_EPILOGUE_DEFAULT
    unsigned long long bias = 0;
    int bias_type = -1;  // the output's
};
struct LtLayout {
    int type;
    unsigned long long rows, cols;
    long long ld;
};
struct LtPref {
    unsigned long long workspace = 0;
    unsigned alignment[4] = {256, 256, 256, 256};  // A, B, C, D: cuBLASLt's default
};
struct LtAlgo {
    unsigned magic, epilogue;
    unsigned alignment[4];
    char unused[64 - 24];
};
struct LtHeuristic {
    LtAlgo algo;
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};
const unsigned LT_ALGO = 0x4c54414c;
const int LT_INVALID = 7, LT_NOT_SUPPORTED = 15, LT_INTERNAL = 14;
bool lt_epilogue(unsigned e) { return e == 1 || e == 2 || e == 4 || e == 6; }
// TRAINER_EMULATED_CUBLASLT is `what`.
bool lt_knob(const char* what) {
    const char* knob = getenv("TRAINER_EMULATED_CUBLASLT");
    return knob && strcmp(knob, what) == 0;
}
bool lt_type(int t) { return t == 0 || t == 2 || t == 14; }
unsigned alignment_of(const void* p) {
    unsigned a = 1;
    while (a < 256 && ((uintptr_t)p & a) == 0) a <<= 1;
    return a;
}
}  // namespace emu

int cublasLtCreate(void** handle) { return *handle = new int(0), 0; }
int cublasLtDestroy(void* handle) { return delete (int*)handle, 0; }
int cublasLtMatmulDescCreate(void** desc, int compute, int scale) {
    return *desc = new emu::LtDesc{compute, scale}, 0;
}
int cublasLtMatmulDescDestroy(void* desc) { return delete (emu::LtDesc*)desc, 0; }
int cublasLtMatmulDescSetAttribute(void* d, int attr, const void* buf, size_t size) {
    emu::LtDesc* desc = (emu::LtDesc*)d;
    auto take = [&](auto& field) {
        if (size != sizeof field) return emu::LT_INVALID;
        memcpy(&field, buf, size);
        return 0;
    };
    switch (attr) {
        case 3: return take(desc->transa);
        case 4: return take(desc->transb);
        case 7: return emu::lt_knob("bad-attribute") ? emu::LT_INVALID : take(desc->epilogue);
        case 8: return take(desc->bias);
        case 26: return take(desc->bias_type);
        default: return emu::LT_INVALID;  // not one src/tensor/cuda sets
    }
}
int cublasLtMatrixLayoutCreate(void** layout, int type, unsigned long long rows, unsigned long long cols, long long ld) {
    if (!emu::lt_type(type) || ld < (long long)(rows > 1 ? rows : 1)) return emu::LT_INVALID;
    return *layout = new emu::LtLayout{type, rows, cols, ld}, 0;
}
int cublasLtMatrixLayoutDestroy(void* layout) { return delete (emu::LtLayout*)layout, 0; }
int cublasLtMatmulPreferenceCreate(void** pref) { return *pref = new emu::LtPref(), 0; }
int cublasLtMatmulPreferenceDestroy(void* pref) { return delete (emu::LtPref*)pref, 0; }
int cublasLtMatmulPreferenceSetAttribute(void* p, int attr, const void* buf, size_t size) {
    emu::LtPref* pref = (emu::LtPref*)p;
    if (attr == 1 && size == 8) return memcpy(&pref->workspace, buf, 8), 0;
    if (attr >= 5 && attr <= 8 && size == 4) return memcpy(&pref->alignment[attr - 5], buf, 4), 0;
    return emu::LT_INVALID;
}

namespace emu {
// Whether the layouts make a product D[m, n] = op(A)[m, k]·op(B)[k, n] with C = D.
bool lt_shape(const LtDesc* d, const LtLayout* a, const LtLayout* b, const LtLayout* c, const LtLayout* out) {
    unsigned long long m = out->rows, n = out->cols, k = d->transa ? a->rows : a->cols;
    bool a_ok = d->transa ? a->cols == m : a->rows == m;
    bool b_ok = d->transb ? (b->rows == n && b->cols == k) : (b->rows == k && b->cols == n);
    return a_ok && b_ok && a->type == b->type && c->type == out->type && c->rows == m && c->cols == n &&
           (a->type != 0 || out->type == 0);
}
}  // namespace emu

int cublasLtMatmulAlgoGetHeuristic(void*, void* d, void* a, void* b, void* c, void* out, void* p, int requested,
                                   emu::LtHeuristic* results, int* count) {
    emu::LtDesc* desc = (emu::LtDesc*)d;
    emu::LtPref* pref = (emu::LtPref*)p;
    *count = 0;
    if (requested < 1) return emu::LT_INVALID;
    if ((desc->compute != 68 && desc->compute != 77) || desc->scale != 0) return emu::LT_NOT_SUPPORTED;
    if (!emu::lt_shape(desc, (emu::LtLayout*)a, (emu::LtLayout*)b, (emu::LtLayout*)c, (emu::LtLayout*)out))
        return emu::LT_INVALID;
    if (!emu::lt_epilogue(desc->epilogue) || emu::lt_knob("no-algorithm")) return 0;  // no algorithm
    memset(results, 0, sizeof *results);
    results->algo.magic = emu::LT_ALGO;
    results->algo.epilogue = desc->epilogue;
    memcpy(results->algo.alignment, pref->alignment, sizeof pref->alignment);
    *count = 1;
    return 0;
}

int cublasLtMatmul(void*, void* d, const void* alpha_p, const void* a, void* al, const void* b, void* bl,
                   const void* beta_p, const void* c, void* cl, void* dp, void* dl, const emu::LtAlgo* algo,
                   void* workspace, size_t workspace_bytes, void* stream) {
    LOCKED;
    if (emu::sticky != SUCCESS) return emu::LT_INTERNAL;
    const emu::LtDesc* desc = (const emu::LtDesc*)d;
    const emu::LtLayout *la = (emu::LtLayout*)al, *lb = (emu::LtLayout*)bl, *lc = (emu::LtLayout*)cl,
                        *ld = (emu::LtLayout*)dl;
    if (!algo || algo->magic != emu::LT_ALGO || algo->epilogue != desc->epilogue || !emu::lt_shape(desc, la, lb, lc, ld))
        return emu::LT_INVALID;
    if (c != dp || lc->ld != ld->ld) return emu::LT_NOT_SUPPORTED;  // C in place of D only, as we use it
    if (emu::lt_knob("refuses")) return emu::LT_NOT_SUPPORTED;
    if (emu::lt_knob("invalid")) return emu::LT_INVALID;
    // An algorithm runs only on pointers as aligned as the heuristic was told they would be.
    const void* pointers[4] = {a, b, c, dp};
    for (int i = 0; i < 4; i++)
        if (emu::alignment_of(pointers[i]) < algo->alignment[i]) return emu::LT_NOT_SUPPORTED;
    bool has_bias = desc->epilogue & 4, relu = desc->epilogue & 2;
    int bias_type = desc->bias_type >= 0 ? desc->bias_type : ld->type;
    const void* bias = (const void*)desc->bias;
    if (has_bias && (!bias || (uintptr_t)bias % 16 != 0)) return emu::LT_NOT_SUPPORTED;
    int m = (int)ld->rows, n = (int)ld->cols, k = (int)(desc->transa ? la->rows : la->cols);
    if (workspace_bytes && !emu::check_range((uintptr_t)workspace, workspace_bytes, "cuBLASLt workspace"))
        return emu::LT_INVALID;
    static const char* names[] = {"", "DEFAULT", "RELU", "", "BIAS", "", "RELU_BIAS"};
    emu::trace("cublasLtMatmul %s", names[desc->epilogue]);
    emu::Epilogue epilogue = {has_bias ? bias : nullptr, bias_type, relu};
    return emu::gemm(stream, desc->transa, desc->transb, m, n, k, *(const float*)alpha_p, a, la->type, (int)la->ld,
                     b, lb->type, (int)lb->ld, *(const float*)beta_p, dp, ld->type, (int)ld->ld, epilogue);
}

// ---- NCCL: the ranks are processes of this machine; a communicator is a directory (its
// unique id names it) where each rank leaves a file per all-reduce and reads the others'.

struct ncclUniqueId {
    char internal[128];
};

namespace emu {
struct Comm {
    std::string dir;
    int rank, ranks;
    unsigned long long done = 0;  // all-reduces finished
    bool ended = false;           // destroyed or aborted: its queued all-reduces do nothing
};

std::string file(const Comm* c, const std::string& what, int rank) {
    return c->dir + "/" + what + "." + std::to_string(rank);
}

void write_file(const std::string& path, const void* data, size_t bytes) {
    std::string partial = path + ".partial";
    FILE* f = fopen(partial.c_str(), "wb");
    if (!f || fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
        fail(LAUNCH_FAILED, "NCCL: cannot write %s", path.c_str());
        return;
    }
    rename(partial.c_str(), path.c_str());  // the others see it whole or not at all
}

// Reads `bytes` of the file at `path`; false if it is not there yet.
bool read_if_there(const std::string& path, void* data, size_t bytes) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return false;
    size_t got = fread(data, 1, bytes, f);
    fclose(f);
    if (got != bytes)
        fail(LAUNCH_FAILED, "NCCL: %s is shorter than this rank's buffer (ranks reducing different lengths)",
             path.c_str());
    return true;
}

// `read_if_there`, waiting for the file (joining a communicator waits for every rank, as
// NCCL's does; this gives up after ten minutes so that a broken test ends).
bool read_when_there(const std::string& path, void* data, size_t bytes) {
    for (int waited_ms = 0; waited_ms < 600000; waited_ms++) {
        if (read_if_there(path, data, bytes)) return sticky == SUCCESS;
        usleep(1000);
    }
    fail(LAUNCH_FAILED, "NCCL: no peer wrote %s within ten minutes", path.c_str());
    return false;
}

// TRAINER_EMULATED_NCCL_STALL=RANK:N: that rank's Nth all-reduce never happens (a GPU or a
// network stuck), so that its peers wait for it, as NCCL's do, without a timeout of their own.
bool stalls(const Comm* c, unsigned long long id) {
    const char* knob = getenv("TRAINER_EMULATED_NCCL_STALL");
    int rank;
    unsigned long long n;
    return knob && sscanf(knob, "%d:%llu", &rank, &n) == 2 && rank == c->rank && id == n;
}

// Sums (or averages) the ranks' float buffers in rank order: the same bits on every rank.
// `id` is this all-reduce's number while it waits for its peers (0 before it starts): it
// throws NotReady until every peer's buffer is there, and runs again when the host waits.
void all_reduce(Comm* c, const float* send, float* recv, size_t count, bool average, unsigned long long& id) {
    if (c->ended) return;
    if (id == 0) {
        id = ++c->done;
        if (!stalls(c, id)) write_file(file(c, std::to_string(id), c->rank), send, count * 4);
    }
    if (stalls(c, id)) throw NotReady();
    std::string name = std::to_string(id);
    std::vector<float> sum(count, 0.0f), peer(count);
    for (int r = 0; r < c->ranks && sticky == SUCCESS; r++) {
        if (!read_if_there(file(c, name, r), peer.data(), count * 4)) throw NotReady();
        for (size_t i = 0; i < count; i++) sum[i] += peer[i];
    }
    if (average)
        for (float& v : sum) v /= (float)c->ranks;
    memcpy(recv, sum.data(), count * 4);
    // Every rank has written this one, so every rank has read the one before.
    if (id > 1) unlink(file(c, std::to_string(id - 1), c->rank).c_str());
    id = 0;
}
}  // namespace emu

int ncclGetVersion(int* version) { return *version = 22800, 0; }
const char* ncclGetErrorString(int) { return "emulated NCCL error"; }

int ncclGetUniqueId(ncclUniqueId* id) {
    char dir[] = "/tmp/trainer-emulated-nccl-XXXXXX";
    if (!mkdtemp(dir)) return 2;  // ncclSystemError
    memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "%s", dir);
    return 0;
}

// Joins the communicator once every rank has; two ranks on one device are refused, as NCCL
// does ("Duplicate GPU detected").
int ncclCommInitRank(void** comm, int ranks, ncclUniqueId id, int rank) {
    LOCKED;
    if (ranks < 1 || rank < 0 || rank >= ranks) return 4;  // ncclInvalidArgument
    auto c = new emu::Comm{std::string(id.internal, strnlen(id.internal, sizeof id.internal)), rank, ranks};
    int device = current_context ? (int)((int*)current_context - contexts) : 0;
    emu::write_file(emu::file(c, "device", rank), &device, sizeof device);
    for (int r = 0; r < ranks; r++) {
        int other;
        if (!emu::read_when_there(emu::file(c, "device", r), &other, sizeof other)) return 2;
        if (r != rank && other == device) {
            fprintf(stderr, "emulated NCCL: rank %d and rank %d are both on device %d\n", rank, r, device);
            return 5;  // ncclInvalidUsage
        }
    }
    *comm = c;
    return 0;
}

// Aborting drops the communicator's queued all-reduces (kept, not freed: a stream may still
// hold them). ncclCommDestroy would wait for them; cudarc only aborts.
int ncclCommAbort(void* comm) {
    LOCKED;
    auto c = (emu::Comm*)comm;
    c->ended = true;
    unlink(emu::file(c, std::to_string(c->done), c->rank).c_str());
    unlink(emu::file(c, "device", c->rank).c_str());
    rmdir(c->dir.c_str());  // the last rank out removes it
    return 0;
}
int ncclCommDestroy(void* comm) {
    LOCKED;
    emu::run_everything();
    return ncclCommAbort(comm);
}

int ncclAllReduce(const void* send, void* recv, size_t count, int datatype, int op, void* comm, void* stream) {
    LOCKED;
    const int FLOAT32 = 7, SUM = 0, AVG = 4;
    if (datatype != FLOAT32 || (op != SUM && op != AVG)) return 5;
    if (!emu::check_range((uintptr_t)send, count * 4, "NCCL all-reduce, send") ||
        !emu::check_range((uintptr_t)recv, count * 4, "NCCL all-reduce, receive"))
        return 5;
    auto c = (emu::Comm*)comm;
    auto id = std::make_shared<unsigned long long>(0);  // kept by a recording, for each replay
    CUresult r = emu::submit(stream, [=] { emu::all_reduce(c, (const float*)send, (float*)recv, count, op == AVG, *id); });
    return r == SUCCESS ? 0 : 1;  // ncclUnhandledCudaError
}

}  // extern "C"
