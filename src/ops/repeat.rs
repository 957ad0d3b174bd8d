//! repeat: a named block of layers (model.blocks.NAME) written `times` times in its place,
//! as GPT's transformer blocks. Not an op: loading the job expands it (spec::blocks), so
//! the graph never builds one.

use super::{Build, Checks, Op};
use crate::error::Result;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RepeatSpec {
    /// The block's name in model.blocks.
    pub block: String,
    /// How many copies, one after another.
    #[schemars(range(min = 1, max = 4096))]
    pub times: usize,
}

impl RepeatSpec {
    pub(super) fn check(&self, c: &mut Checks) {
        c.size("times", self.times, 1);
    }
}

/// A repeat left in a model (not loaded through `spec::load_job`, which expands them).
pub fn build(_: &RepeatSpec, at: &mut Build) -> Result<(Op, Vec<usize>)> {
    Err(at.error(
        "repeat",
        "a repeat layer is expanded when the job is loaded, and this model was not",
    ))
}
