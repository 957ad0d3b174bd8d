//! The problems of a layer's settings that types cannot express (ranges), as (key, message);
//! `spec::validate` puts the layer's path before each key.

use super::Size2;

/// The largest value a size setting (a layer's width, a kernel, a stride...) may have:
/// 2,147,483,647, the largest dimension cuBLAS takes. It also keeps the shape arithmetic of
/// any accepted job far from overflowing.
pub const MAX_SIZE: usize = i32::MAX as usize;

pub fn size_range(min: usize) -> String {
    format!("must be at least {min} and at most {MAX_SIZE}")
}

/// A layer's problems, each as its key and message.
#[derive(Debug, Default)]
pub struct Checks {
    pub found: Vec<(&'static str, String)>,
}

impl Checks {
    pub fn add(&mut self, key: &'static str, message: impl std::fmt::Display) {
        self.found.push((key, message.to_string()));
    }

    pub fn check(&mut self, ok: bool, key: &'static str, message: impl std::fmt::Display) {
        if !ok {
            self.add(key, message);
        }
    }

    /// A size: at least `min`, at most `MAX_SIZE`.
    pub fn size(&mut self, key: &'static str, given: usize, min: usize) {
        let message = format!("{given} given; {}", size_range(min));
        self.check((min..=MAX_SIZE).contains(&given), key, message);
    }

    /// A size given as one number or [height, width].
    pub fn size2(&mut self, key: &'static str, given: Size2, min: usize) {
        let (h, w) = given.pair();
        let ok = |d| (min..=MAX_SIZE).contains(&d);
        let message = format!("{given} given; {}", size_range(min));
        self.check(ok(h) && ok(w), key, message);
    }
}
