//! transformers' config.json beside a weights file: what the tensors' shapes cannot tell
//! (heads, epsilons, θ), read for the Hugging Face models' checks.

use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// Whether the model's f32 value (an epsilon, θ) is the config's.
pub(super) fn same_value(ours: f32, theirs: f64) -> bool {
    (f64::from(ours) / theirs - 1.0).abs() <= 1e-6
}

/// The config.json beside `weights` and what it says, read as transformers' config of
/// `model`; None where there is none.
pub(super) fn config_beside<T: DeserializeOwned>(
    weights: &Path,
    model: &str,
) -> Result<Option<(PathBuf, T)>, String> {
    let path = weights.with_file_name("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let config = serde_json::from_str(&text)
        .map_err(|e| format!("{} beside it is not a {model} config: {e}", path.display()))?;
    Ok(Some((path, config)))
}
