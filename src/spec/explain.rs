//! `trainer check JOB --explain`: every resolved value of a job and the layer it came from
//! (default, the file, the environment, `--set`). Figment tags each value with the provider
//! that supplied it; a value in the resolved spec that no layer holds is a default.

use super::env::env_var_giving;
use super::keys::{dotted, file_table, lookup_table, parse_sets, KeyStep};
use super::load::{layers, SET_LAYER};
use crate::error::Result;
use crate::runtime_err;
use figment::value::Value;
use std::path::Path;

/// One line per resolved value: key, value (as TOML), source.
pub fn explain(path: &Path, sets: &[String]) -> Result<String> {
    let spec = super::load_job(path, sets)?;
    let file = file_table(path)?;
    let figment = layers(path, &parse_sets(sets, &file)?);
    let resolved = spec
        .recorded()
        .map(toml::Value::Table)
        .map_err(|e| runtime_err!("cannot serialise the resolved spec: {e}"))?;
    let mut leaves = Vec::new();
    flatten(&mut Vec::new(), &resolved, &mut leaves);
    leaves.retain(|(key, _)| applies(&spec, &dotted(key)));
    let sources = super::KeySources::of_tables(path.display().to_string(), sets, file.clone());
    // Sections in file order (job, data, model, ...).
    let section = |path: &[KeyStep]| match path.first() {
        Some(KeyStep::Key(k)) => super::SECTIONS.iter().position(|s| s == k),
        _ => None,
    };
    leaves.sort_by_key(|(path, _)| section(path));

    let rows: Vec<[String; 3]> = leaves
        .into_iter()
        .map(|(key, value)| {
            let source = match layered_value(&figment, &key) {
                // `--set model.layers[1].out=...` replaces the list (a copy of the file's):
                // its other values are still the file's.
                Some(_) if in_list(&key) && sources.of(&dotted(&key)).starts_with("--set ") => {
                    format!("--set {}", dotted(&key))
                }
                Some(_) if in_list(&key) && lookup_table(&file, &key) == Some(&value) => {
                    format!("file {}", path.display())
                }
                Some(v) => describe_source(&figment, &v, &key),
                None if key == [KeyStep::Key("job".into()), KeyStep::Key("name".into())] => {
                    "default (the job file's name)".into()
                }
                None => "default".into(),
            };
            [dotted(&key), value.to_string(), source]
        })
        .collect();
    let width = |i: usize| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0);
    let (w0, w1) = (width(0).max(3), width(1).max(5));
    let mut out = format!("{:<w0$}  {:<w1$}  source\n", "key", "value");
    for [k, v, s] in rows {
        out += &format!("{k:<w0$}  {v:<w1$}  {s}\n");
    }
    Ok(out)
}

/// Whether a resolved key does anything for this job: a setting of another optimizer, of
/// dynamic loss scaling without it, or of data parallelism without replicas is recorded
/// (config.toml holds every key) but not shown, since setting it would be refused.
fn applies(spec: &super::JobSpec, key: &str) -> bool {
    use super::{OptimizerKind, Scaling};
    let adam = matches!(
        spec.optimizer.kind,
        OptimizerKind::Adam | OptimizerKind::Adamw
    );
    match key {
        "optimizer.betas" | "optimizer.eps" => adam,
        "optimizer.momentum" | "optimizer.dampening" | "optimizer.nesterov" => {
            spec.optimizer.kind == OptimizerKind::Sgd
        }
        "precision.init_scale"
        | "precision.growth_factor"
        | "precision.backoff_factor"
        | "precision.growth_interval" => spec.precision.scaling() == Scaling::Dynamic,
        // As config.toml records them: parallel.devices = "all" has replicas only once the
        // GPUs are counted.
        _ if key.starts_with("parallel.") => {
            spec.parallel.replicas().is_some() || spec.parallel.devices.is_some()
        }
        _ => true,
    }
}

/// Leaves of the resolved spec: scalars and arrays of scalars; tables and arrays of tables
/// (model.layers) are walked into.
fn flatten(
    path: &mut Vec<KeyStep>,
    value: &toml::Value,
    out: &mut Vec<(Vec<KeyStep>, toml::Value)>,
) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                path.push(KeyStep::Key(k.clone()));
                flatten(path, v, out);
                path.pop();
            }
        }
        toml::Value::Array(items) if items.iter().any(|v| v.is_table()) => {
            for (i, v) in items.iter().enumerate() {
                path.push(KeyStep::Index(i));
                flatten(path, v, out);
                path.pop();
            }
        }
        leaf => out.push((path.clone(), leaf.clone())),
    }
}

fn in_list(path: &[KeyStep]) -> bool {
    path.iter().any(|s| matches!(s, KeyStep::Index(_)))
}

/// The value at `path` in the layered (not yet defaulted) data, if any layer gave one.
fn layered_value(figment: &figment::Figment, path: &[KeyStep]) -> Option<Value> {
    let Some(KeyStep::Key(first)) = path.first() else {
        return None;
    };
    let mut value = figment.find_value(first).ok()?;
    for seg in &path[1..] {
        value = match (seg, value) {
            (KeyStep::Key(k), Value::Dict(_, dict)) => dict.get(k)?.clone(),
            (KeyStep::Index(i), Value::Array(_, items)) => items.get(*i)?.clone(),
            _ => return None,
        };
    }
    Some(value)
}

fn describe_source(figment: &figment::Figment, value: &Value, path: &[KeyStep]) -> String {
    let Some(meta) = figment.get_metadata(value.tag()) else {
        return "unknown".into();
    };
    if meta.name == SET_LAYER {
        return format!("--set {}", dotted(path));
    }
    match &meta.source {
        Some(figment::Source::File(file)) => format!("file {}", file.display()),
        // The only other layer is the environment: TRAINER_SECTION__KEY, or a variable that
        // gives a table holding the key; an array (model.layers) can only be given whole.
        _ => {
            let keys: Vec<String> = path
                .iter()
                .map_while(|s| match s {
                    KeyStep::Key(k) => Some(k.clone()),
                    _ => None,
                })
                .collect();
            let var = env_var_giving(&keys)
                .unwrap_or_else(|| format!("TRAINER_{}", keys.join("__").to_uppercase()));
            format!("environment {var}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys a job cannot take are left out; parallel.devices = "all" is data parallelism
    /// before the GPUs are counted (the replicas are not known yet).
    #[test]
    fn only_the_keys_a_job_can_take_apply() {
        let mlp = Path::new(env!("CARGO_MANIFEST_DIR")).join("jobs/mlp.toml");
        let job = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            super::super::load_job(&mlp, &sets).unwrap()
        };
        let adamw = job(&[]);
        assert!(applies(&adamw, "optimizer.betas") && !applies(&adamw, "optimizer.momentum"));
        assert!(!applies(&adamw, "precision.init_scale"));
        assert!(!applies(&adamw, "parallel.timeout"));
        let all = job(&["parallel.devices=\"all\""]);
        assert!(applies(&all, "parallel.timeout"));
        let fp16 = job(&["precision.mode=\"fp16\""]);
        assert!(applies(&fp16, "precision.init_scale"));
    }
}
