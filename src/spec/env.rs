//! The environment layer of a job: `TRAINER_SECTION__KEY` variables, each value read as
//! TOML as `--set` reads it, and which variable gave a key.

use super::SECTIONS;
use crate::error::Result;
use crate::job_err;
use figment::value::{Dict, Map};
use figment::{Metadata, Profile, Provider};

/// An environment variable that is a job key (`TRAINER_OPTIMIZER__LR`); variables whose
/// first part is not a section (TRAINER_BIN, TRAINER_REQUIRE_CUDA...) belong to other tools.
pub(super) struct JobVar {
    pub(super) name: String,
    /// The key path, in lower case (`optimizer`, `lr`).
    pub(super) path: Vec<String>,
    /// None where it is not UTF-8.
    text: Option<String>,
}

impl JobVar {
    /// The value, read as TOML as a --set's is (`3e-4`, `[1, 2]`, `{type = "sgd"}`,
    /// `"text"`); one that is not TOML is read as figment reads a variable (`sgd` is text).
    pub(super) fn value(&self) -> Option<figment::value::Value> {
        let text = self.text.as_deref()?;
        let as_toml = toml::from_str::<toml::Table>(&format!("value = {text}"))
            .ok()
            .filter(|t| t.len() == 1)
            .and_then(|mut t| t.remove("value"))
            // A date is text to the job (a name), as figment reads it.
            .filter(|v| !v.is_datetime())
            .and_then(|v| figment::value::Value::serialize(v).ok());
        Some(as_toml.unwrap_or_else(|| {
            text.parse()
                .unwrap_or_else(|_| figment::value::Value::from(text.to_string()))
        }))
    }
}

pub(super) fn job_env_vars() -> Vec<JobVar> {
    std::env::vars_os()
        .filter_map(|(name, text)| {
            let name = name.into_string().ok()?;
            let path: Vec<String> = name
                .strip_prefix("TRAINER_")?
                .split("__")
                .map(str::to_lowercase)
                .collect();
            SECTIONS.contains(&path[0].as_str()).then(|| JobVar {
                name,
                path,
                text: text.into_string().ok(),
            })
        })
        .collect()
}

/// The job's environment variables (`TRAINER_SECTION__KEY=value`) as one layer: a variable
/// gives the key its name spells, `__` between the parts.
pub(super) struct EnvVars;

impl Provider for EnvVars {
    fn metadata(&self) -> Metadata {
        Metadata::named("environment variable(s)")
    }
    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        let mut vars = job_env_vars();
        // A variable for a key inside a table another gives whole (TRAINER_OPTIMIZER__LR
        // beside TRAINER_OPTIMIZER='{...}') is the more precise: it goes in last.
        vars.sort_by_key(|v| v.path.len());
        let mut dict = Dict::new();
        for var in vars {
            let value = var.value().ok_or_else(|| {
                figment::Error::from(format!("environment variable {} is not UTF-8", var.name))
            })?;
            let (last, tables) = var.path.split_last().expect("a section at least");
            let mut at = &mut dict;
            for key in tables {
                let entry = at.entry(key.clone()).or_insert_with(|| Dict::new().into());
                if entry.as_dict().is_none() {
                    *entry = Dict::new().into();
                }
                let figment::value::Value::Dict(_, inner) = entry else {
                    unreachable!("made a table above")
                };
                at = inner;
            }
            at.insert(last.clone(), value);
        }
        Ok(Profile::Default.collect(dict))
    }
}

/// Refuses a job variable whose value is not UTF-8, or that picks a list element (figment
/// would take `LAYERS[1]` for a key of that name, and the error would blame the job file),
/// and warns once of variables that look like job keys but are not.
pub(super) fn check_env() -> Result<()> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let mut warnings = Vec::new();
    if let Some(var) = job_env_vars().iter().find(|v| v.text.is_none()) {
        return Err(job_err!(
            "environment variable {} is not UTF-8 text; a job key's value must be",
            var.name
        ));
    }
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if let Some(rest) = name.strip_prefix("TRAINER_") {
            let first = rest.split("__").next().unwrap_or("").to_lowercase();
            let is_job_key = SECTIONS.contains(&first.as_str());
            if is_job_key && rest.contains(['[', ']']) {
                let key = rest
                    .split("__")
                    .collect::<Vec<_>>()
                    .join(".")
                    .to_lowercase();
                return Err(job_err!(
                    "environment variable {name}: a variable cannot pick a list element; use \
                     --set {key}=VALUE (or set the whole list, TRAINER_{}=[...])",
                    rest.split('[').next().unwrap_or(rest)
                ));
            }
            let lower = rest.to_lowercase();
            let one_underscore = SECTIONS
                .iter()
                .find(|s| !rest.contains("__") && lower.starts_with(&format!("{s}_")));
            if let Some(section) = one_underscore {
                let key = &rest[section.len() + 1..];
                warnings.push(format!(
                    "environment variable {name} is not read: a job key takes two underscores \
                     after its section (TRAINER_{}__{key})",
                    section.to_uppercase()
                ));
            }
            if rest.contains("__") && !is_job_key {
                warnings.push(format!(
                    "environment variable {name} looks like a job key but `{first}` is not a section \
                     (sections: {}); it is ignored",
                    SECTIONS.join(", ")
                ));
            }
        }
    }
    // A process loads its job more than once (check, then --explain; a sweep's points).
    WARNED.call_once(|| warnings.iter().for_each(|w| tracing::warn!("{w}")));
    Ok(())
}

/// The job variable that gives the key at `path` (lower-case parts): its own
/// (`TRAINER_OPTIMIZER__LR`) or one that gives a table holding it
/// (`TRAINER_OPTIMIZER='{lr=0.1}'`).
pub(super) fn env_var_giving(path: &[String]) -> Option<String> {
    let holds = |var: &JobVar| {
        let rest = path[var.path.len()..].join(".");
        var.value().is_some_and(|v| v.find_ref(&rest).is_some())
    };
    let mut vars = job_env_vars();
    // In `EnvVars`' order, read backwards: the one that won first (the most precise, and of
    // two spellings of one key, `TRAINER_OPTIMIZER__LR` and `TRAINER_optimizer__lr`, the later).
    vars.sort_by_key(|v| v.path.len());
    vars.into_iter()
        .rev()
        .filter(|var| path.starts_with(&var.path))
        .find(|var| var.path.len() == path.len() || holds(var))
        .map(|var| var.name)
}
