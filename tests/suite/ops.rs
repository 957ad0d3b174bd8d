//! The ops' own tests, each in its folder under src/ops/ (the library does not compile them).

#[path = "../../src/ops/activation/tests.rs"]
mod activation;
#[path = "../../src/ops/attention/tests.rs"]
mod attention;
#[path = "../../src/ops/batchnorm/tests.rs"]
mod batchnorm;
#[path = "../../src/ops/dropout/tests.rs"]
mod dropout;
#[path = "../../src/ops/embedding/tests.rs"]
mod embedding;
#[path = "../../src/ops/layernorm/tests.rs"]
mod layernorm;
#[path = "../../src/ops/linear/tests.rs"]
mod linear;
#[path = "../../src/ops/multiply/tests.rs"]
mod multiply;
#[path = "../../src/ops/pool/tests.rs"]
mod pool;
#[path = "../../src/ops/position_embedding/tests.rs"]
mod position_embedding;
#[path = "../../src/ops/rmsnorm/tests.rs"]
mod rmsnorm;
#[path = "../../src/ops/rotary/tests.rs"]
mod rotary;
#[path = "../../src/ops/softmax/tests.rs"]
mod softmax;
