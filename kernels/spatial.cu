// The geometries the image ops' kernels take (ops/conv2d/conv2d.cu, ops/pool/pool.cu), field
// for field the host's ConvGeom and PoolGeom (src/tensor/cuda/mod.rs).

struct ConvGeom {
    u64 n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow;
};






struct PoolGeom {
    u64 n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow;
};




