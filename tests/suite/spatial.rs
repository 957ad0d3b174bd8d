//! The CPU conv kernels against PyTorch (tests/fixtures/spatial_reference.json, from
//! make_spatial_reference.py): conv2d with stride, padding, dilation and groups, forward and
//! every gradient. Pooling, batch norm and layer norm are tested in their op folders
//! (src/ops/*/tests.rs), from the same fixtures through `cases`.

use crate::common;

use serde_json::Value;
use trainer::ops::conv2d::cpu::*;
use trainer::tensor::Conv2d;

pub(crate) fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub(crate) fn int(v: &Value) -> usize {
    v.as_u64().unwrap() as usize
}

pub(crate) fn pair(v: &Value) -> (usize, usize) {
    (int(&v[0]), int(&v[1]))
}

pub(crate) fn assert_close(ours: &[f32], torch: &[f32], what: &str) {
    assert_eq!(ours.len(), torch.len(), "{what}: lengths");
    let scale = torch.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (a, b)) in ours.iter().zip(torch).enumerate() {
        assert!(
            (a - b).abs() <= 2e-5 * scale,
            "{what}[{i}]: ours {a} vs PyTorch {b} (scale {scale})"
        );
    }
}

pub(crate) fn cases(op: &str) -> Vec<Value> {
    let text =
        std::fs::read_to_string(common::root().join("tests/fixtures/spatial_reference.json"))
            .unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["op"] == op)
        .cloned()
        .collect()
}

#[test]
fn conv2d_matches_pytorch_forward_and_backward() {
    let cases = cases("conv2d");
    assert_eq!(cases.len(), 5);
    for c in cases {
        let (k, n) = (pair(&c["k"]), int(&c["n"]));
        let s = Conv2d {
            c: int(&c["c"]),
            h: int(&c["h"]),
            w: int(&c["w"]),
            o: int(&c["o"]),
            kh: k.0,
            kw: k.1,
            stride: pair(&c["stride"]),
            pad: pair(&c["pad"]),
            dil: pair(&c["dil"]),
            groups: int(&c["groups"]),
        };
        let what = format!("{s:?}");
        let (x, w, dy) = (floats(&c["x"]), floats(&c["weight"]), floats(&c["dy"]));
        let b = c["bias"].is_array().then(|| floats(&c["bias"]));
        for threads in [1, 3] {
            let mut ws = vec![0.0; conv_workspace_len(&s, threads, n)];
            let mut y = vec![f32::NAN; floats(&c["y"]).len()];
            conv2d_forward(&s, &x, &w, b.as_deref(), &mut y, n, &mut ws);
            assert_close(
                &y,
                &floats(&c["y"]),
                &format!("{what} y, {threads} threads"),
            );
            let (mut dw, mut db, mut dx) =
                (vec![0.0; w.len()], vec![0.0; s.o], vec![f32::NAN; x.len()]);
            let db_arg = b.is_some().then_some(&mut db[..]);
            conv2d_backward(&s, &x, &w, &dy, &mut dw, db_arg, Some(&mut dx), n, &mut ws);
            assert_close(&dx, &floats(&c["dx"]), &format!("{what} dx"));
            assert_close(&dw, &floats(&c["dweight"]), &format!("{what} dW"));
            if b.is_some() {
                assert_close(&db, &floats(&c["dbias"]), &format!("{what} db"));
            }
        }
    }
}
