//! Where a key's value came from, for error messages: its --set argument, its environment
//! variable or the job file.

use super::env::{env_var_giving, job_env_vars};
use super::keys::{canonical_key, file_table, holds, parse_sets};
use crate::error::Result;
use std::path::Path;

/// Where a key's value came from, for error messages: its --set argument, its environment
/// variable or the job file.
pub struct KeySources {
    file: String,
    file_keys: toml::Table,
    /// Each --set's key, as a path with positions for list elements (`canonical_key`), and
    /// as given. A --set into a list copies the list to edit one element: the others'
    /// keys still come from where the list did.
    set_keys: Vec<(Vec<String>, String)>,
}

impl KeySources {
    pub fn new(file: &Path, sets: &[String]) -> Result<Self> {
        let file_keys = file_table(file)?;
        // The same refusals as loading the job, for a --set that is not a key path.
        parse_sets(sets, &file_keys)?;
        Ok(Self::of_tables(file.display().to_string(), sets, file_keys))
    }

    /// From the job file's table already read (`file` names the file in messages).
    pub(super) fn of_tables(file: String, args: &[String], file_keys: toml::Table) -> Self {
        let set_keys = args
            .iter()
            .filter_map(|arg| arg.split_once('='))
            .map(|(key, _)| (canonical_key(&file_keys, key), key.trim().to_string()))
            .collect();
        KeySources {
            file,
            file_keys,
            set_keys,
        }
    }

    /// "--set KEY", "environment TRAINER_…" or the file, for a key such as `optimizer.lr` or
    /// `model.layers[2].out`.
    pub fn of(&self, key: &str) -> String {
        self.of_path(&canonical_key(&self.file_keys, key))
    }

    /// `path`: the key's parts, with positions for list elements (`model`, `layers`, `2`,
    /// `out`).
    pub(super) fn of_path(&self, path: &[String]) -> String {
        // The --set of the key, of a table that holds it (`--set optimizer={...}` for
        // `optimizer.lr`) or of a key it holds (`--set optimizer.lr=...` for `optimizer`).
        let related = |part: &[String]| {
            self.set_keys
                .iter()
                .find(|(set, _)| set.starts_with(part) || part.starts_with(set))
        };
        if let Some((_, given)) = related(path) {
            return format!("--set {given}");
        }
        if let Some(var) = env_var_giving(path) {
            return format!("environment {var}");
        }
        // A variable below the key (TRAINER_DATA__BATCH__SIZE for `data.batch`) made it a
        // table: the key is that variable's fault, whatever the file says.
        if let Some(var) = job_env_vars()
            .into_iter()
            .find(|v| v.path.starts_with(path))
        {
            return format!("environment {}", var.name);
        }
        if !holds(&self.file_keys, path) {
            // A key no layer holds (a required one left out) is the fault of the --set that
            // gave or changed its table, if one did: `--set 'optimizer.schedule={type="step"}'`,
            // `--set model.layers[1].type="linear"` (for the missing `out`).
            for len in (2..path.len()).rev() {
                if let Some((_, given)) = related(&path[..len]) {
                    return format!("--set {given}");
                }
            }
        }
        self.file.clone()
    }
}
