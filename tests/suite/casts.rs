//! Half-precision casts round to nearest even, bit for bit as PyTorch does
//! (tests/fixtures/cast_reference.json, from make_cast_reference.py): random values over many
//! magnitudes, f16 subnormals and overflow, exact ties, signed zeros and infinities.

use crate::common;

use trainer::tensor::cast::{from_half, to_half, HalfKind};

fn fixture() -> (Vec<f32>, Vec<u16>, Vec<u16>) {
    let text =
        std::fs::read_to_string(common::root().join("tests/fixtures/cast_reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let list = |k: &str| {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    let x = list("x_bits")
        .into_iter()
        .map(|b| f32::from_bits(b as u32))
        .collect();
    let f16 = list("f16_bits").into_iter().map(|b| b as u16).collect();
    let bf16 = list("bf16_bits").into_iter().map(|b| b as u16).collect();
    (x, f16, bf16)
}

#[test]
fn casts_to_f16_and_bf16_match_pytorch_bit_for_bit() {
    let (x, f16, bf16) = fixture();
    assert!(x.len() > 4000);
    for (kind, expected) in [(HalfKind::F16, &f16), (HalfKind::Bf16, &bf16)] {
        let mut ours = vec![0u16; x.len()];
        to_half(kind, &x, &mut ours);
        let wrong: Vec<_> = (0..x.len())
            .filter(|&i| ours[i] != expected[i])
            .take(5)
            .collect();
        assert!(
            wrong.is_empty(),
            "{kind:?}: first mismatches (x, ours, PyTorch): {:?}",
            wrong
                .iter()
                .map(|&i| (x[i], ours[i], expected[i]))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn widening_halves_is_exact() {
    let (_, f16, bf16) = fixture();
    for (kind, bits) in [(HalfKind::F16, &f16), (HalfKind::Bf16, &bf16)] {
        let mut wide = vec![0.0f32; bits.len()];
        from_half(kind, bits, &mut wide);
        let mut back = vec![0u16; bits.len()];
        to_half(kind, &wide, &mut back);
        assert_eq!(&back, bits, "{kind:?}: half -> f32 -> half changed a value");
    }
}
