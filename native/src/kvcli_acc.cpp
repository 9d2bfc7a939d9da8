// kvcli_acc (kvcli_observation.h): a layer's observation sums in zero pages from mmap, resident only where written,
// seen by the graph as a tensor on the CPU (kvcli_graph.cpp adds into it).
#include "kvcli_cache.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <utility>
#if !defined(_WIN32)
#include <sys/mman.h>
#endif


kvcli_acc & kvcli_acc::operator=(kvcli_acc && o) noexcept {
    if (this != &o) {
        release();
        std::swap(data_, o.data_);
        std::swap(n_, o.n_);
        std::swap(bytes_, o.bytes_);
        std::swap(written_, o.written_);
        std::swap(ctx_, o.ctx_);
        std::swap(buf_, o.buf_);
        std::swap(t_, o.t_);
    }
    return *this;
}

void kvcli_acc::allocate(size_t n) {
    release();
    bytes_ = std::max<size_t>(n, 1) * sizeof(float);
#if !defined(_WIN32)
    // anonymous pages read as zeros and become resident when first written: only the cells a layer uses
    void * p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        bytes_ = 0;
        throw std::bad_alloc();
    }
#else
    void * p = std::calloc(n ? n : 1, sizeof(float));
    if (!p) {
        bytes_ = 0;
        throw std::bad_alloc();
    }
#endif
    data_ = static_cast<float *>(p);
    n_ = n;
    written_ = false;
}

void kvcli_acc::release() {
    if (buf_) {
        ggml_backend_buffer_free(buf_);   // a buffer over our pointer: frees its own bookkeeping only
    }
    if (ctx_) {
        ggml_free(ctx_);
    }
    if (data_) {
#if !defined(_WIN32)
        munmap(data_, bytes_);
#else
        std::free(data_);
#endif
    }
    data_ = nullptr;
    n_ = bytes_ = 0;
    written_ = false;
    ctx_ = nullptr;
    buf_ = nullptr;
    t_ = nullptr;
}

ggml_tensor * kvcli_acc::tensor(int64_t ne0, int64_t ne1, int64_t ne2) {
    if (!data_ || (size_t) (ne0 * ne1 * ne2) != n_) {
        throw kvcli_error("kvcli_acc::tensor: shape does not match the accumulator");
    }
    if (t_ && t_->ne[0] == ne0 && t_->ne[1] == ne1 && t_->ne[2] == ne2) {
        return t_;
    }
    if (!ctx_) {
        ggml_init_params ip = { ggml_tensor_overhead(), nullptr, true };
        ctx_ = ggml_init(ip);
        buf_ = ggml_backend_cpu_buffer_from_ptr(data_, bytes_);
        if (!ctx_ || !buf_) {
            throw kvcli_error("kvcli_acc::tensor: could not wrap the accumulator");
        }
    } else if (t_) {
        throw kvcli_error("kvcli_acc::tensor: the accumulator was already seen with another shape");
    }
    t_ = ggml_new_tensor_3d(ctx_, GGML_TYPE_F32, ne0, ne1, ne2);
    if (ggml_backend_tensor_alloc(buf_, t_, data_) != GGML_STATUS_SUCCESS) {
        throw kvcli_error("kvcli_acc::tensor: could not place the tensor");
    }
    return t_;
}
