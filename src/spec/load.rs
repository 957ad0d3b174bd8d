//! Loading a job: the file, then `TRAINER_*` environment variables, then `--set` (highest),
//! layered with figment. Errors name the file, the line and column where the file is at
//! fault, the key path, what was given and what is allowed (with a "did you mean").

use super::{JobSpec, SECTIONS};
use crate::error::{Error, Result};
use crate::job_err;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use std::path::{Path, PathBuf};

/// Where a job came from, kept for error messages and the run directory.
#[derive(Debug, Clone)]
pub struct JobSource {
    pub path: PathBuf,
    /// `--set` overrides as given, `key=value`.
    pub sets: Vec<String>,
}

/// Reads, layers, deserialises and validates a job. Relative data paths are resolved against
/// the job file's directory, so the resolved spec (config.toml in a run) stands on its own.
pub fn load_job(path: &Path, sets: &[String]) -> Result<JobSpec> {
    let file = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|e| job_err!("cannot read job file {file}: {e}"))?;

    // 1. Syntax, with line and column.
    if let Err(e) = toml::from_str::<toml::Table>(&text) {
        return Err(job_err!("{}", toml_error(&file, &text, &e, None)));
    }
    // 2. The file on its own, so that its mistakes are reported at their line. Missing keys
    //    are left to the layered pass: an override may supply them.
    let file_alone: std::result::Result<JobSpec, _> =
        serde_path_to_error::deserialize(toml::Deserializer::new(&text));
    if let Err(e) = file_alone {
        if !e.inner().message().starts_with("missing field") {
            let key = e.path().to_string();
            return Err(job_err!(
                "{}",
                toml_error(&file, &text, e.inner(), Some(&key))
            ));
        }
    }

    // 3. The layers.
    let set_table = parse_sets(sets)?;
    warn_about_ignored_env();
    let mut spec: JobSpec = layers(path, &set_table)
        .extract()
        .map_err(|e| layered_error(&file, &set_table, e))?;

    if spec.job.name.is_none() {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("job");
        spec.job.name = Some(stem.to_string());
    }
    let base = path.parent().unwrap_or(Path::new("."));
    resolve_paths(&mut spec, base);
    super::validate(
        &spec,
        &KeySources {
            file,
            sets: set_table,
        },
    )?;
    // The resolved spec names the batch size even when it is the default.
    if spec.data.global_batch_size.is_none() {
        spec.data.batch_size = Some(spec.batch_size());
    }
    Ok(spec)
}

/// The layers, lowest first: the file, the environment, `--set`. Figment tags every value
/// with the layer it came from (`trainer check --explain` reads those tags).
pub(super) fn layers(path: &Path, sets: &toml::Table) -> Figment {
    Figment::new()
        .merge(Toml::file_exact(path))
        .merge(job_env())
        .merge(SetArgs(sets.clone()))
}

/// `TRAINER_SECTION__KEY=value`; variables whose first part is not a section (TRAINER_BIN,
/// TRAINER_REQUIRE_CUDA...) belong to other tools and are not job keys.
fn job_env() -> Env {
    Env::prefixed("TRAINER_").split("__").filter(|key| {
        // Keys are still upper case here: figment lowercases after filtering.
        let first = key
            .as_str()
            .split('.')
            .next()
            .unwrap_or("")
            .to_ascii_lowercase();
        SECTIONS.contains(&first.as_str())
    })
}

fn warn_about_ignored_env() {
    for (name, _) in std::env::vars() {
        if let Some(rest) = name.strip_prefix("TRAINER_") {
            let first = rest.split("__").next().unwrap_or("").to_lowercase();
            if rest.contains("__") && !SECTIONS.contains(&first.as_str()) {
                tracing::warn!(
                    "environment variable {name} looks like a job key but `{first}` is not a section \
                     (sections: {}); it is ignored",
                    SECTIONS.join(", ")
                );
            }
        }
    }
}

/// The `--set` overrides as one provider, so errors can say a value came from `--set`.
struct SetArgs(toml::Table);

/// The name of the `--set` layer in figment's metadata.
pub(super) const SET_LAYER: &str = "--set";

impl Provider for SetArgs {
    fn metadata(&self) -> Metadata {
        Metadata::named(SET_LAYER)
    }
    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        Serialized::defaults(&self.0).data()
    }
}

/// Parses one `--set KEY=VALUE`. The value is read as TOML (`3e-4`, `true`, `[1, 2]`,
/// `"text"`); anything that is not valid TOML is taken as a string.
pub fn parse_set_arg(arg: &str) -> Result<(Vec<String>, toml::Value)> {
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| job_err!("--set {arg}: expected KEY=VALUE, e.g. --set optimizer.lr=3e-4"))?;
    let parts: Vec<String> = key
        .trim()
        .split('.')
        .map(|s| s.trim().to_string())
        .collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(job_err!(
            "--set {arg}: `{key}` is not a key path; expected dotted keys such as optimizer.lr"
        ));
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    Ok((parts, value))
}

pub(super) fn parse_sets(sets: &[String]) -> Result<toml::Table> {
    let mut root = toml::Table::new();
    for arg in sets {
        let (parts, value) = parse_set_arg(arg)?;
        let mut table = &mut root;
        for part in &parts[..parts.len() - 1] {
            let entry = table
                .entry(part.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry.as_table_mut().ok_or_else(|| {
                job_err!("--set {arg}: `{part}` was already set to a value, not a table")
            })?;
        }
        table.insert(parts[parts.len() - 1].clone(), value);
    }
    Ok(root)
}

/// Formats a TOML error as `file:line:col: key `a.b`: message` plus a suggestion.
fn toml_error(file: &str, text: &str, e: &toml::de::Error, key: Option<&str>) -> String {
    let place = match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            format!("{file}:{line}:{col}")
        }
        None => file.to_string(),
    };
    let message = e.message().trim_end();
    let key = match key {
        Some(k) if !k.is_empty() && k != "." => format!(" key `{k}`:"),
        _ => String::new(),
    };
    format!("{place}:{key} {message}{}", did_you_mean(message))
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.chars().rev().take_while(|&c| c != '\n').count() + 1;
    (line, col)
}

/// Where a key's value came from, for error messages: its --set argument, its environment
/// variable or the job file.
pub struct KeySources {
    file: String,
    sets: toml::Table,
}

impl KeySources {
    pub fn new(file: &Path, sets: &[String]) -> Result<Self> {
        Ok(KeySources {
            file: file.display().to_string(),
            sets: parse_sets(sets)?,
        })
    }

    /// "--set KEY", "environment TRAINER_…" or the file, for a key such as `optimizer.lr` or
    /// `model.layers[2].out` (an index names the array, which is what --set replaces).
    pub fn of(&self, key: &str) -> String {
        let path: Vec<String> = key
            .split('.')
            .map(|part| part.split('[').next().unwrap_or(part).to_string())
            .collect();
        self.of_path(&path, key)
    }

    fn of_path(&self, path: &[String], key: &str) -> String {
        if set_contains(&self.sets, path) {
            format!("--set {key}")
        } else if let Some((var, _)) = std::env::vars().find(|(k, _)| env_matches(k, path)) {
            format!("environment {var}")
        } else {
            self.file.clone()
        }
    }
}

fn layered_error(file: &str, sets: &toml::Table, errors: figment::Error) -> Error {
    let sources = KeySources {
        file: file.to_string(),
        sets: sets.clone(),
    };
    let lines: Vec<String> = errors
        .into_iter()
        .map(|e| {
            let mut path = e.path.clone();
            // Figment's path may already end with the key's name (it does for an unknown key
            // from the environment or --set): name it once.
            let mut name_key = |name: &str| {
                if path.last().map(String::as_str) != Some(name) {
                    path.push(name.to_string());
                }
            };
            let message = match &e.kind {
                figment::error::Kind::UnknownField(name, expected) => {
                    name_key(name);
                    let expected: Vec<String> = expected.iter().map(|s| format!("`{s}`")).collect();
                    let msg = format!("unknown key, expected one of {}", expected.join(", "));
                    let hint = did_you_mean(&format!("unknown field `{name}`, {msg}"));
                    format!("{msg}{hint}")
                }
                figment::error::Kind::UnknownVariant(given, allowed) => {
                    let allowed: Vec<String> = allowed.iter().map(|s| format!("\"{s}\"")).collect();
                    format!("\"{given}\" given; allowed: {}", allowed.join(", "))
                }
                figment::error::Kind::MissingField(name) => {
                    name_key(name);
                    "missing key: it is required".to_string()
                }
                kind => kind.to_string(),
            };
            let key = path.join(".");
            format!("{}: key `{key}`: {message}", sources.of_path(&path, &key))
        })
        .collect();
    Error::Job(lines.join("\n"))
}

fn set_contains(sets: &toml::Table, path: &[String]) -> bool {
    let mut table = sets;
    for (i, part) in path.iter().enumerate() {
        match table.get(part) {
            Some(toml::Value::Table(t)) if i + 1 < path.len() => table = t,
            Some(_) => return true,
            None => return false,
        }
    }
    true
}

fn env_matches(var: &str, path: &[String]) -> bool {
    var.strip_prefix("TRAINER_")
        .is_some_and(|rest| rest.eq_ignore_ascii_case(&path.join("__")))
}

/// From serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant"), the
/// closest allowed name, when one is close enough to be a likely typo.
pub(crate) fn did_you_mean(message: &str) -> String {
    let Some(given) = ["unknown field `", "unknown variant `"]
        .iter()
        .find_map(|p| {
            message
                .split_once(p)
                .and_then(|(_, rest)| rest.split('`').next())
        })
    else {
        return String::new();
    };
    let Some((_, allowed)) = message.split_once("expected") else {
        return String::new();
    };
    let best = allowed
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|candidate| (edit_distance(given, candidate), candidate))
        .min();
    match best {
        Some((d, candidate)) if d <= (given.len() / 3).max(2) => {
            format!(" (did you mean `{candidate}`?)")
        }
        _ => String::new(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

fn resolve_paths(spec: &mut JobSpec, base: &Path) {
    let d = &mut spec.data;
    for p in [
        &mut d.path,
        &mut d.test_path,
        &mut d.train_images,
        &mut d.train_labels,
        &mut d.test_images,
        &mut d.test_labels,
        &mut spec.model.init_from,
    ]
    .into_iter()
    .flatten()
    {
        if p.is_relative() {
            let joined = base.join(&*p);
            *p = std::path::absolute(&joined).unwrap_or(joined);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_the_closest_key() {
        let m = "unknown field `lrr`, expected one of `type`, `lr`, `weight_decay`";
        assert_eq!(did_you_mean(m), " (did you mean `lr`?)");
        let m = "unknown variant `lienar`, expected one of `linear`, `relu`";
        assert_eq!(did_you_mean(m), " (did you mean `linear`?)");
        assert_eq!(did_you_mean("unknown field `zzzzzz`, expected `lr`"), "");
    }

    #[test]
    fn set_values_are_read_as_toml() {
        let (k, v) = parse_set_arg("optimizer.lr=3e-4").unwrap();
        assert_eq!(k, ["optimizer", "lr"]);
        assert_eq!(v, toml::Value::Float(3e-4));
        assert_eq!(
            parse_set_arg("job.name=abc").unwrap().1,
            toml::Value::String("abc".into())
        );
        assert_eq!(
            parse_set_arg("data.shuffle=false").unwrap().1,
            toml::Value::Boolean(false)
        );
        assert!(parse_set_arg("optimizer.lr").is_err());
        assert!(parse_set_arg("optimizer..lr=1").is_err());
    }
}
