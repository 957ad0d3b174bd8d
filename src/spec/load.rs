//! Loading a job: the file, then `TRAINER_*` environment variables, then `--set` (highest),
//! layered with figment. Errors name the file, the line and column where the file is at
//! fault, the key path, what was given and what is allowed (with a "did you mean").

use super::keys::{dotted, element_name, lookup, lookup_table, parse_key, KeyStep};
use super::messages::{
    belongs_elsewhere, date_given, did_you_mean, key_below, key_offset, line_col, plain, read_as,
    toml_error, with_enum_choices,
};
use super::{JobSpec, SECTIONS};
use crate::error::{Error, Result};
use crate::job_err;
use figment::providers::{Format, Serialized, Toml};
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
    let file_table = toml::from_str::<toml::Table>(&text)
        .map_err(|e| job_err!("{}", toml_error(&file, &text, &e, None)))?;
    // 2. The file on its own, so that its mistakes are reported at their line. Missing keys
    //    are left to the layered pass: an override may supply them.
    let file_alone: std::result::Result<JobSpec, _> =
        serde_path_to_error::deserialize(toml::Deserializer::new(&text));
    if let Err(e) = file_alone {
        if !e.inner().message().starts_with("missing field") {
            let key = e.path().to_string();
            let first = toml_error(&file, &text, e.inner(), Some((&key, &file_table)));
            let more = match e.inner().message().starts_with("unknown field") {
                true => other_unknown_keys(&file, &text, &file_table, &key, e.inner().message()),
                false => Vec::new(),
            };
            return Err(job_err!("{}", [vec![first], more].concat().join("\n")));
        }
    }

    // 3. The layers.
    let set_table = parse_sets(sets, &file_table)?;
    warn_of_merged_tables(sets, &file_table, &set_table);
    check_env()?;
    let mut spec: JobSpec = layers(path, &set_table)
        .extract()
        .map_err(|e| layered_error(&file, &file_table, &set_table, sets, e))?;

    if spec.job.name.is_none() {
        // A stem that is not UTF-8 keeps its other characters (its bytes become U+FFFD).
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        spec.job.name = Some(stem.unwrap_or_else(|| "job".into()));
    }
    let base = path.parent().unwrap_or(Path::new("."));
    resolve_paths(&mut spec, base);
    let sources = KeySources::of_tables(file, sets, file_table);
    take_the_higher_of_two_ways(&mut spec, &sources, &set_table);
    validate(&spec, &sources)?;
    warn_of_choosing_by_the_test_set(&spec);
    warn_of_parallel_settings_without_data_parallelism(&spec);
    // The resolved spec names the batch size even when it is the default.
    if spec.data.global_batch_size.is_none() {
        spec.data.batch_size = Some(spec.batch_size());
    }
    Ok(spec)
}

/// The file's unknown keys after the first (at `key`, with its `message`), each said as
/// the first is, so that one reading of the error fixes them all. Each section is read on
/// its own (a key the job lacks in one, say optimizer.lr, would stop the reading of the
/// others), again after each unknown key found is taken out.
fn other_unknown_keys(
    file: &str,
    text: &str,
    table: &toml::Table,
    key: &str,
    message: &str,
) -> Vec<String> {
    let full_key = |key: &str, message: &str| {
        let (below, _) = key_below(message);
        match (key, below) {
            ("" | ".", Some(b)) => b.to_string(),
            (k, Some(b)) => format!("{k}.{b}"),
            (k, None) => k.to_string(),
        }
    };
    let mut rest = table.clone();
    let taken = parse_key(&full_key(key, message)).is_some_and(|s| remove_key(&mut rest, &s));
    if !taken {
        return Vec::new();
    }
    let mut found = Vec::new();
    let sections: Vec<String> = rest.keys().cloned().collect();
    for section in sections {
        // Bounded: each pass takes one key out, and a key that cannot be taken out ends it.
        for _ in 0..100 {
            let Some(value) = rest.get(&section) else {
                break;
            };
            let alone = toml::Table::from_iter([(section.clone(), value.clone())]);
            let Ok(again) = toml::to_string(&alone) else {
                break;
            };
            let read: std::result::Result<JobSpec, _> =
                serde_path_to_error::deserialize(toml::Deserializer::new(&again));
            let Err(e) = read else {
                break;
            };
            if !e.inner().message().starts_with("unknown field") {
                break;
            }
            let key = e.path().to_string();
            let full = full_key(&key, e.inner().message());
            let said = toml_error(file, &again, e.inner(), Some((&key, &alone)));
            // Said at its place in the file as written.
            let place = parse_key(&full)
                .and_then(|steps| key_offset(text, &steps))
                .map(|offset| {
                    let (line, col) = line_col(text, offset);
                    format!("{file}:{line}:{col}")
                })
                .unwrap_or_else(|| file.to_string());
            let after_place = said.find(": key `").map_or(said.as_str(), |i| &said[i..]);
            found.push(format!("{place}{after_place}"));
            if !parse_key(&full).is_some_and(|steps| remove_key(&mut rest, &steps)) {
                break;
            }
        }
    }
    found
}

/// Takes the key at `steps` out of `table`; whether it was there.
fn remove_key(table: &mut toml::Table, steps: &[KeyStep]) -> bool {
    fn within(value: &mut toml::Value, steps: &[KeyStep]) -> bool {
        match steps {
            [KeyStep::Key(k)] => value
                .as_table_mut()
                .is_some_and(|t| t.remove(k.as_str()).is_some()),
            [step, rest @ ..] => {
                let next = match step {
                    KeyStep::Key(k) => value.as_table_mut().and_then(|t| t.get_mut(k.as_str())),
                    KeyStep::Index(i) => value.as_array_mut().and_then(|a| a.get_mut(*i)),
                    _ => None,
                };
                next.is_some_and(|next| within(next, rest))
            }
            [] => false,
        }
    }
    match steps {
        [KeyStep::Key(k)] => table.remove(k.as_str()).is_some(),
        [KeyStep::Key(k), rest @ ..] => table.get_mut(k.as_str()).is_some_and(|v| within(v, rest)),
        _ => false,
    }
}

/// Keys that say one thing two ways (data.batch_size and data.global_batch_size;
/// parallel.replicas and parallel.devices), given by two layers: the higher layer's is taken,
/// as for one key, and said (`--set data.global_batch_size=512` on a file with a batch_size:
/// no --set could take the file's key away). Given by one layer, both stay, and validation
/// refuses them.
fn take_the_higher_of_two_ways(spec: &mut JobSpec, sources: &KeySources, sets: &toml::Table) {
    // The layer that gives a key: 0 the file, 1 the environment, 2 --set. (A table given
    // whole gives only the keys it holds.)
    let layer = |key: &str| {
        let path: Vec<String> = key.split('.').map(String::from).collect();
        let steps: Vec<KeyStep> = path.iter().cloned().map(KeyStep::Key).collect();
        match (lookup_table(sets, &steps), env_var_giving(&path)) {
            (Some(_), _) => (2, sources.of(key)),
            (None, Some(var)) => (1, format!("environment {var}")),
            (None, None) => (0, "the job file".to_string()),
        }
    };
    let take = |a: &str, b: &str, given: bool| -> Option<bool> {
        if !given {
            return None;
        }
        let ((layer_a, from_a), (layer_b, from_b)) = (layer(a), layer(b));
        let (winner, loser, from_w, from_l) = match layer_a.cmp(&layer_b) {
            std::cmp::Ordering::Equal => return None,
            std::cmp::Ordering::Greater => (a, b, from_a, from_b),
            std::cmp::Ordering::Less => (b, a, from_b, from_a),
        };
        tracing::info!("{winner} ({from_w}) takes the place of {loser} ({from_l})");
        Some(winner == a)
    };
    let data = &mut spec.data;
    let both = data.batch_size.is_some() && data.global_batch_size.is_some();
    match take("data.global_batch_size", "data.batch_size", both) {
        Some(true) => data.batch_size = None,
        Some(false) => data.global_batch_size = None,
        None => {}
    }
    let parallel = &mut spec.parallel;
    let both = parallel.replicas.is_some() && parallel.devices.is_some();
    match take("parallel.devices", "parallel.replicas", both) {
        Some(true) => parallel.replicas = None,
        Some(false) => parallel.devices = None,
        None => {}
    }
}

/// The settings of data parallelism, given without it, do nothing: said (`check --explain`
/// leaves them out, as it does another optimizer's keys). Not refused: a job written for
/// torchrun keeps them when it runs alone or as one rank (RANK=0, WORLD_SIZE=1), and so does
/// such a run's config.toml; in a multi-process environment they are not said either.
fn warn_of_parallel_settings_without_data_parallelism(spec: &JobSpec) {
    let parallel = &spec.parallel;
    let launcher = ["RANK", "WORLD_SIZE", "SLURM_PROCID"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if parallel.replicas().is_some() || parallel.devices.is_some() || launcher {
        return;
    }
    let given: Vec<&str> = [
        ("parallel.launch", parallel.launch != super::Launch::Auto),
        ("parallel.timeout", parallel.timeout.is_some()),
        (
            "parallel.backend",
            parallel.backend != super::CollectiveBackend::Auto,
        ),
        ("parallel.overlap", !parallel.overlap),
        ("parallel.bucket_mb", parallel.bucket_mb.is_some()),
    ]
    .into_iter()
    .filter_map(|(key, set)| set.then_some(key))
    .collect();
    if !given.is_empty() {
        tracing::warn!(
            "{} only appl{} with data parallelism (parallel.replicas or parallel.devices, or \
             a multi-process run's RANK and WORLD_SIZE): without it, ignored",
            given.join(", "),
            if given.len() == 1 { "ies" } else { "y" }
        );
    }
}

/// Early stopping or keep_best on a test metric choose by the test set, whose score is then
/// no longer an unbiased estimate: said, not refused (a job may have no other split).
fn warn_of_choosing_by_the_test_set(spec: &JobSpec) {
    let chosen_by = [
        spec.train
            .early_stopping
            .as_ref()
            .map(|e| ("train.early_stopping.metric", e.metric.as_str())),
        spec.checkpoint
            .keep_best
            .as_ref()
            .map(|b| ("checkpoint.keep_best.metric", b.metric.name())),
    ];
    for (key, metric) in chosen_by.into_iter().flatten() {
        if let Some(column) = metric.strip_prefix("test_") {
            tracing::warn!(
                "{key} = \"{metric}\" chooses by the test set, whose score is then optimistic; \
                 hold out a validation split (data.val_fraction) and choose by \"val_{column}\""
            );
        }
    }
}

/// A table given whole with `--set` (`optimizer={type="sgd", lr=0.1}`) or an environment
/// variable (`TRAINER_OPTIMIZER='{type="sgd"}'`) is merged into the file's, as every layer
/// is: the keys it leaves out keep the file's values, which may not be what was meant (a
/// warm-up kept under another schedule), so they are named. (A list element given whole
/// replaces the element.)
fn warn_of_merged_tables(sets: &[String], file: &toml::Table, set_table: &toml::Table) {
    // Tables given whole, and where: (how it was given, its key path).
    let mut whole: Vec<(String, &str, Vec<KeyStep>)> = Vec::new();
    for arg in sets {
        if let Ok((steps, toml::Value::Table(_))) = parse_set_arg(arg) {
            whole.push((
                format!("--set {}={{...}}", dotted(&steps)),
                "the --set",
                steps,
            ));
        }
    }
    for var in job_env_vars() {
        if var.value().is_some_and(|v| v.as_dict().is_some()) {
            let steps = var.path.into_iter().map(KeyStep::Key).collect();
            let given_as = format!("environment {}={{...}}", var.name);
            whole.push((given_as, "the variable", steps));
        }
    }
    if whole.is_empty() {
        return;
    }
    // What the environment gives, as one table (its variables nest by `__`).
    let env_table = EnvVars
        .data()
        .ok()
        .and_then(|mut profiles| profiles.remove(&Profile::Default))
        .and_then(|dict| toml::Table::try_from(dict).ok())
        .unwrap_or_default();
    for (given_as, there, steps) in whole {
        if !steps.iter().all(|s| matches!(s, KeyStep::Key(_))) {
            continue;
        }
        let Some(toml::Value::Table(in_file)) = lookup_table(file, &steps) else {
            continue;
        };
        // What every layer above the file gives there together (`--set optimizer={...}
        // --set optimizer.lr=...`, or a variable and a --set).
        let given = |table: &toml::Table, k: &str| match lookup_table(table, &steps) {
            Some(toml::Value::Table(t)) => t.contains_key(k),
            _ => false,
        };
        let key = dotted(&steps);
        let kept: Vec<String> = in_file
            .keys()
            .filter(|k| !given(set_table, k) && !given(&env_table, k))
            .map(|k| format!("{key}.{k}"))
            .collect();
        if kept.is_empty() {
            continue;
        }
        let one = kept.len() == 1;
        let warning = format!(
            "{given_as} is merged into the job file's {key}: {} keep{} the file's value{} \
             (give {} in {there} to change {})",
            kept.join(", "),
            if one { "s" } else { "" },
            if one { "" } else { "s" },
            if one { "it" } else { "them" },
            if one { "it" } else { "them" },
        );
        tracing::warn!("{warning}");
    }
}

/// An environment variable that is a job key (`TRAINER_OPTIMIZER__LR`); variables whose
/// first part is not a section (TRAINER_BIN, TRAINER_REQUIRE_CUDA...) belong to other tools.
struct JobVar {
    name: String,
    /// The key path, in lower case (`optimizer`, `lr`).
    path: Vec<String>,
    /// None where it is not UTF-8.
    text: Option<String>,
}

impl JobVar {
    /// The value, read as TOML as a --set's is (`3e-4`, `[1, 2]`, `{type = "sgd"}`,
    /// `"text"`); one that is not TOML is read as figment reads a variable (`sgd` is text).
    fn value(&self) -> Option<figment::value::Value> {
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

fn job_env_vars() -> Vec<JobVar> {
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

/// The layers, lowest first: the file, the environment, `--set`. Figment tags every value
/// with the layer it came from (`trainer check --explain` reads those tags).
pub(super) fn layers(path: &Path, sets: &toml::Table) -> Figment {
    Figment::new()
        .merge(Toml::file_exact(path))
        .merge(EnvVars)
        .merge(SetArgs(sets.clone()))
}

/// The job's environment variables (`TRAINER_SECTION__KEY=value`) as one layer: a variable
/// gives the key its name spells, `__` between the parts.
struct EnvVars;

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
fn check_env() -> Result<()> {
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

/// Parses one `--set KEY=VALUE`. The key is dotted (`optimizer.lr`) and may pick array
/// elements (`model.layers[2].out`, `model.layers[fc].out`). The value is read as TOML
/// (`3e-4`, `true`, `[1, 2]`, `"text"`); anything that is not valid TOML is taken as a string.
pub fn parse_set_arg(arg: &str) -> Result<(Vec<KeyStep>, toml::Value)> {
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| job_err!("--set {arg}: expected KEY=VALUE, e.g. --set optimizer.lr=3e-4"))?;
    let steps = parse_key(key.trim()).ok_or_else(|| {
        job_err!(
            "--set {arg}: `{}` is not a key path; expected dotted keys such as optimizer.lr, \
             or model.layers[2].out (a layer by position, from 0; [-1] is the last) or \
             model.layers[fc].out (by name)",
            key.trim()
        )
    })?;
    let raw = raw.trim();
    let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}"));
    if let Err(e) = &parsed {
        // Meant as TOML (a string, list or table) but malformed: taken as text it would be
        // a value with the quotes or brackets in it.
        if raw.starts_with(['"', '\'', '[', '{']) {
            return Err(job_err!(
                "--set {arg}: `{raw}` is not a valid TOML value ({}); e.g. \"text\", [1, 2], \
                 {{ key = 1 }}",
                e.message().trim().replace('\n', ": ")
            ));
        }
        let digits = raw.strip_prefix(['-', '+']).unwrap_or(raw);
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
            return Err(job_err!(
                "--set {arg}: `{raw}` is not a number TOML can hold ({}); quote it for text: \
                 \"{raw}\"",
                e.message()
            ));
        }
        // A number TOML does not read (.5, 1., 1e309) would otherwise become a string, and
        // then "a string given" where a number was meant.
        let numeric = raw.bytes().any(|b| b.is_ascii_digit())
            && raw.bytes().all(|b| b"0123456789.eE+-_".contains(&b));
        if let Some(f) = raw.replace('_', "").parse::<f64>().ok().filter(|_| numeric) {
            let write = match f.is_finite() {
                true => format!("write {f:?} (a digit on each side of a decimal point)"),
                false => "it is beyond the largest number, about 1.8e308".to_string(),
            };
            return Err(job_err!(
                "--set {arg}: `{raw}` is not a number as TOML writes one: {write}; quote it for \
                 text: \"{raw}\""
            ));
        }
    }
    let value = parsed
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    // TOML reads -1e309 as -inf (and refuses 1e309): the same overflow either way.
    if matches!(value, toml::Value::Float(f) if f.is_infinite()) && !raw.contains("inf") {
        return Err(job_err!(
            "--set {arg}: `{raw}` is beyond the largest number, about 1.8e308 (write inf or \
             -inf if that is meant); quote it for text: \"{raw}\""
        ));
    }
    Ok((steps, value))
}

/// Each key's path with every list element picked by its position from the start, as the job
/// file's lists stand: `model.layers[hidden].out` and `model.layers[-3].out` are both
/// `["model", "layers", "1", "out"]`, so that two spellings of one key compare equal. A
/// selector the file cannot resolve stays as written (setting it fails later, with its own
/// message), and so does a key that is not a key path.
pub fn canonical_keys(file: &Path, keys: &[String]) -> Result<Vec<Vec<String>>> {
    let table = file_table(file)?;
    Ok(keys.iter().map(|key| canonical_key(&table, key)).collect())
}

fn canonical_key(table: &toml::Table, key: &str) -> Vec<String> {
    let Some(steps) = parse_key(key.trim()) else {
        return vec![key.trim().to_string()];
    };
    let Some((KeyStep::Key(first), rest)) = steps.split_first() else {
        return vec![key.trim().to_string()];
    };
    // Where the path has got to in the file; None once the file has nothing there.
    let mut at: Option<&toml::Value> = table.get(first);
    let mut path = vec![first.clone()];
    for step in rest {
        let (part, next) = match step {
            KeyStep::Key(k) => (k.clone(), at.and_then(|v| v.get(k.as_str()))),
            KeyStep::Index(i) => (i.to_string(), at.and_then(|v| v.get(*i))),
            KeyStep::FromEnd(n) => {
                let array = at.and_then(toml::Value::as_array);
                match array.and_then(|a| a.len().checked_sub(*n)) {
                    Some(i) => (i.to_string(), array.and_then(|a| a.get(i))),
                    None => (format!("-{n}"), None),
                }
            }
            KeyStep::Named(name) => {
                let array = at.and_then(toml::Value::as_array);
                let found = array.and_then(|a| {
                    a.iter()
                        .position(|e| element_name(e) == Some(name.as_str()))
                });
                match found {
                    Some(i) => (i.to_string(), array.and_then(|a| a.get(i))),
                    None => (name.clone(), None),
                }
            }
        };
        path.push(part);
        at = next;
    }
    path
}

/// The `--set` overrides as one table, applied in the order given. Figment replaces an
/// array as a whole, so a key that picks an element copies the array into the table first,
/// from an earlier `--set` or else from the job file (`file`), and edits the copy.
pub(super) fn parse_sets(sets: &[String], file: &toml::Table) -> Result<toml::Table> {
    let mut root = toml::Value::Table(toml::Table::new());
    for arg in sets {
        let (steps, value) = parse_set_arg(arg)?;
        let fail = |why: String| job_err!("--set {arg}: {why}");
        if let Some(first) = steps.iter().position(|s| !matches!(s, KeyStep::Key(_))) {
            let array = &steps[..first];
            if lookup(&root, array).is_none() {
                let from_file = lookup_table(file, array).ok_or_else(|| {
                    fail(format!(
                        "the job file has no list `{0}` to pick an element of; set the whole \
                         list instead, e.g. --set {0}=[...]",
                        dotted(array)
                    ))
                })?;
                assign(&mut root, array, from_file.clone(), &mut String::new()).map_err(fail)?;
            }
        }
        assign(&mut root, &steps, value, &mut String::new()).map_err(fail)?;
    }
    match root {
        toml::Value::Table(table) => Ok(table),
        _ => unreachable!("the root stays a table: every key starts with a name"),
    }
}

/// The job file's top-level table (its syntax was checked when the job was loaded).
pub(super) fn file_table(path: &Path) -> Result<toml::Table> {
    let file = path.display();
    let text =
        std::fs::read_to_string(path).map_err(|e| job_err!("cannot read job file {file}: {e}"))?;
    toml::from_str(&text).map_err(|e| job_err!("{file}: {}", e.message()))
}

/// Sets the value at `steps` under `at`, creating tables for missing keys; an element must
/// exist. `path` is the key so far, for errors.
fn assign(
    at: &mut toml::Value,
    steps: &[KeyStep],
    value: toml::Value,
    path: &mut String,
) -> std::result::Result<(), String> {
    let Some((step, rest)) = steps.split_first() else {
        *at = value;
        return Ok(());
    };
    let next = match step {
        KeyStep::Key(key) => {
            let table = at
                .as_table_mut()
                .ok_or_else(|| format!("`{path}` was already set to a value, not a table"))?;
            let entry = table
                .entry(key.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            *path += &if path.is_empty() {
                key.clone()
            } else {
                format!(".{key}")
            };
            entry
        }
        KeyStep::Index(_) | KeyStep::FromEnd(_) => {
            let array = at
                .as_array_mut()
                .ok_or_else(|| format!("`{path}` is not a list"))?;
            let len = array.len();
            let index = match *step {
                KeyStep::Index(i) => Some(i),
                KeyStep::FromEnd(n) => len.checked_sub(n),
                _ => unreachable!("a position"),
            };
            *path += &dotted(std::slice::from_ref(step));
            index
                .and_then(|i| array.get_mut(i))
                .ok_or_else(|| match len {
                    0 => format!("`{path}`: the list is empty"),
                    _ => format!(
                        "`{path}`: the list has {len} elements, [0] to [{}] (or [-1] to [-{len}])",
                        len - 1
                    ),
                })?
        }
        KeyStep::Named(name) => {
            let array = at
                .as_array_mut()
                .ok_or_else(|| format!("`{path}` is not a list"))?;
            let names: Vec<String> = array
                .iter()
                .filter_map(element_name)
                .map(String::from)
                .collect();
            let list = path.clone();
            *path += &format!("[{name}]");
            match array.iter_mut().find(|v| element_name(v) == Some(name)) {
                Some(element) => element,
                None if names.is_empty() => {
                    return Err(format!(
                        "no element of `{list}` has a name; pick one by position: {list}[0]"
                    ))
                }
                None => {
                    return Err(format!(
                        "no element of `{list}` is named \"{name}\"; names: {}",
                        names.join(", ")
                    ))
                }
            }
        }
    };
    assign(next, rest, value, path)
}

/// The job's problems (`validate::problems`), each said where its key was set: the file,
/// a --set or the environment. Every problem is reported at once.
pub fn validate(spec: &JobSpec, sources: &KeySources) -> Result<()> {
    let problems = super::validate::problems(spec);
    if problems.is_empty() {
        return Ok(());
    }
    let lines: Vec<String> = problems
        .iter()
        .map(|(key, message)| format!("{}: key `{key}`: {message}", sources.of(key)))
        .collect();
    Err(Error::Job(lines.join("\n")))
}

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
    fn of_path(&self, path: &[String]) -> String {
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

fn layered_error(
    file: &str,
    file_keys: &toml::Table,
    sets: &toml::Table,
    set_args: &[String],
    errors: figment::Error,
) -> Error {
    let sources = KeySources::of_tables(file.to_string(), set_args, file_keys.clone());
    let lines: Vec<String> = errors
        .into_iter()
        .map(|e| {
            let mut path = e.path.clone();
            // Figment's path may already end with the key's name (it does for an unknown key
            // from the environment or --set): name it once.
            let name_key = |path: &mut Vec<String>, name: &str| {
                if path.last().map(String::as_str) != Some(name) {
                    path.push(name.to_string());
                }
            };
            // A TOML date reaches serde as a table of one private key (which an enum reads
            // as its variant).
            if path.last().is_some_and(|p| p == "$__toml_private_datetime") {
                path.pop();
            }
            let expected = match &e.kind {
                figment::error::Kind::UnknownField(..) => "a table".to_string(),
                figment::error::Kind::UnknownVariant(_, allowed) => {
                    let allowed: Vec<String> = allowed.iter().map(|a| format!("\"{a}\"")).collect();
                    format!("one of {}", allowed.join(", "))
                }
                kind => kind
                    .to_string()
                    .split_once("expected ")
                    .unzip()
                    .1
                    .unwrap_or("")
                    .to_string(),
            };
            let given = lookup_table(sets, &path_steps(&path));
            let hint = date_given(given, &expected, true).or_else(|| {
                let plain = plain(&format!("expected {expected}"));
                read_as(
                    given,
                    plain.strip_prefix("expected ").unwrap_or(&plain),
                    &path,
                )
            });
            let message = match &e.kind {
                _ if hint.is_some() => hint.unwrap_or_default(),
                figment::error::Kind::UnknownField(name, expected) => {
                    name_key(&mut path, name);
                    let expected: Vec<String> = expected.iter().map(|s| format!("`{s}`")).collect();
                    let msg = match expected.len() {
                        0 => "unknown key: nothing may be set here".to_string(),
                        _ => format!("unknown key, expected one of {}", expected.join(", ")),
                    };
                    let hint = match belongs_elsewhere(&path, "unknown field") {
                        hint if hint.is_empty() => {
                            did_you_mean(&format!("unknown field `{name}`, {msg}"))
                        }
                        hint => hint,
                    };
                    format!("{msg}{hint}")
                }
                figment::error::Kind::UnknownVariant(given, allowed) => {
                    let allowed: Vec<String> = allowed.iter().map(|s| format!("\"{s}\"")).collect();
                    format!("\"{given}\" given; allowed: {}", allowed.join(", "))
                }
                figment::error::Kind::MissingField(name) => {
                    name_key(&mut path, name);
                    "missing key: it is required".to_string()
                }
                figment::error::Kind::Message(message) => {
                    let (below, message) = key_below(message);
                    path.extend(below.map(String::from));
                    // From ModelLayer, which reads a layer's keys as a value of its own.
                    let named = |prefix: &str| {
                        let rest = message.strip_prefix(prefix)?;
                        rest.split_once('`')
                    };
                    if let Some((name, _)) = named("missing field `") {
                        name_key(&mut path, name);
                        "missing key: it is required".to_string()
                    } else if let Some((name, rest)) = named("unknown field `") {
                        name_key(&mut path, name);
                        match rest.strip_prefix(", ") {
                            Some(rest) if rest.starts_with("expected") => {
                                format!("unknown key, {rest}{}", did_you_mean(message))
                            }
                            _ => match rest.strip_prefix(": ") {
                                Some(why) => format!("unknown key: {why}"),
                                None => "unknown key: nothing may be set here".to_string(),
                            },
                        }
                    } else if message.starts_with("expected ") {
                        let given = lookup_table(sets, &path_steps(&path));
                        match given {
                            Some(value) => format!("{value} given; {message}"),
                            None => message.to_string(),
                        }
                    } else {
                        format!("{}{}", plain(message), did_you_mean(message))
                    }
                }
                kind => plain(&with_enum_choices(&kind.to_string(), &path)),
            };
            // Figment names an array element by its index as a key; print it as the user
            // writes it: model.layers[1].out.
            let key = path
                .iter()
                .fold(String::new(), |key, part| match part.parse::<usize>() {
                    Ok(index) => format!("{key}[{index}]"),
                    Err(_) if key.is_empty() => part.clone(),
                    Err(_) => format!("{key}.{part}"),
                });
            format!("{}: key `{key}`: {message}", sources.of_path(&path))
        })
        .collect();
    Error::Job(lines.join("\n"))
}

/// A figment path (indices as keys) as key steps.
fn path_steps(path: &[String]) -> Vec<KeyStep> {
    let step = |part: &String| match part.parse() {
        Ok(index) => KeyStep::Index(index),
        Err(_) => KeyStep::Key(part.clone()),
    };
    path.iter().map(step).collect()
}

/// Whether `table` has the key at `path` (positions select list elements), or a value
/// that is not a table or list at the start of it.
fn holds(table: &toml::Table, path: &[String]) -> bool {
    let Some((first, rest)) = path.split_first() else {
        return true;
    };
    let mut at = match table.get(first) {
        Some(value) => value,
        None => return false,
    };
    for part in rest {
        let next = match at {
            toml::Value::Table(t) => t.get(part),
            toml::Value::Array(a) => part.parse::<usize>().ok().and_then(|i| a.get(i)),
            _ => return true,
        };
        match next {
            Some(value) => at = value,
            None => return false,
        }
    }
    true
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
        // An empty path stays empty, for validation to refuse.
        if p.is_relative() && !p.as_os_str().is_empty() {
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
        // A key that shares nothing with the closest one is not a typo of it.
        let m = "unknown field `p`, expected one of `out`, `in`, `bias`";
        assert_eq!(did_you_mean(m), "");
        let m = "unknown field `ot`, expected one of `out`, `in`, `bias`";
        assert_eq!(did_you_mean(m), " (did you mean `out`?)");
        // A word cut short.
        let m = "unknown field `input`, expected one of `out`, `in`, `bias`, `name`, `inputs`";
        assert_eq!(did_you_mean(m), " (did you mean `inputs`?)");
        let m = "unknown field `kernel`, expected one of `out`, `kernel_size`, `stride`";
        assert_eq!(did_you_mean(m), " (did you mean `kernel_size`?)");
    }

    #[test]
    fn set_values_are_read_as_toml() {
        let (k, v) = parse_set_arg("optimizer.lr=3e-4").unwrap();
        assert_eq!(k, [key("optimizer"), key("lr")]);
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
        // Digits TOML cannot hold are not quietly taken as text.
        let e = parse_set_arg("data.batch_size=99999999999999999999").unwrap_err();
        assert!(
            e.to_string().contains("is not a number TOML can hold"),
            "{e}"
        );
    }

    fn key(k: &str) -> KeyStep {
        KeyStep::Key(k.to_string())
    }

    #[test]
    fn set_keys_pick_list_elements_by_position_or_name() {
        let named = |n: &str| KeyStep::Named(n.to_string());
        let steps = |k: &str| parse_key(k);
        let layers = [key("model"), key("layers")];
        assert_eq!(
            steps("model.layers[2].out").unwrap(),
            [&layers[..], &[KeyStep::Index(2), key("out")]].concat()
        );
        assert_eq!(
            steps("model.layers[ \"block1.conv\" ].kernel_size").unwrap(),
            [&layers[..], &[named("block1.conv"), key("kernel_size")]].concat()
        );
        assert_eq!(
            steps("a[0][1]").unwrap(),
            [key("a"), KeyStep::Index(0), KeyStep::Index(1)]
        );
        assert_eq!(
            steps("model.layers[-1].out").unwrap(),
            [&layers[..], &[KeyStep::FromEnd(1), key("out")]].concat()
        );
        // All digits is a position, however large (not a name that no layer has).
        assert_eq!(
            steps("a[99999999999999999999]").unwrap(),
            [key("a"), KeyStep::Index(usize::MAX)]
        );
        for bad in [
            "model.layers[-0]",
            "model.layers[--1]",
            "model.layers[",
            "model.layers[]",
            "model.[0]",
            "[0].out",
            "a[0]b",
            "a]",
        ] {
            assert_eq!(steps(bad), None, "{bad}");
        }
    }

    fn job_file() -> toml::Table {
        toml::from_str(
            r#"
            [model]
            layers = [{ type = "linear", out = 32, name = "hidden" }, { type = "relu" }]
            [optimizer]
            lr = 0.1
            "#,
        )
        .unwrap()
    }

    fn sets(args: &[&str]) -> Result<toml::Table> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse_sets(&args, &job_file())
    }

    #[test]
    fn setting_a_list_element_copies_the_list_from_the_file_and_edits_it() {
        let table = sets(&["model.layers[0].out=64", "model.layers[1].inplace=true"]).unwrap();
        let expected: toml::Table = toml::from_str(
            r#"
            [model]
            layers = [{ type = "linear", out = 64, name = "hidden" },
                      { type = "relu", inplace = true }]
            "#,
        )
        .unwrap();
        assert_eq!(table, expected);
        let by_name = sets(&[
            "model.layers[hidden].out=64",
            "model.layers[1].inplace=true",
        ]);
        assert_eq!(by_name.unwrap(), expected);
        let from_end = sets(&["model.layers[-2].out=64", "model.layers[-1].inplace=true"]);
        assert_eq!(from_end.unwrap(), expected);
        // An element of a list an earlier --set gave, in order.
        let table = sets(&[
            "model.layers=[{type=\"tanh\"}]",
            "model.layers[0].type=\"relu\"",
        ]);
        assert_eq!(
            table.unwrap()["model"]["layers"][0]["type"].as_str(),
            Some("relu")
        );
    }

    #[test]
    fn a_missing_element_is_an_error_that_says_what_there_is() {
        let message = |args: &[&str]| sets(args).unwrap_err().to_string();
        let m = message(&["model.layers[2].out=64"]);
        assert!(
            m.contains("`model.layers[2]`: the list has 2 elements, [0] to [1] (or [-1] to [-2])"),
            "{m}"
        );
        let m = message(&["model.layers[-3].out=64"]);
        assert!(
            m.contains("`model.layers[-3]`: the list has 2 elements"),
            "{m}"
        );
        let m = message(&["model.layers[fc].out=64"]);
        assert!(
            m.contains("no element of `model.layers` is named \"fc\"; names: hidden"),
            "{m}"
        );
        let m = message(&["data.files[0]=1"]);
        assert!(m.contains("the job file has no list `data.files`"), "{m}");
        let m = message(&["optimizer.lr[0]=1"]);
        assert!(m.contains("`optimizer.lr` is not a list"), "{m}");
        assert!(m.starts_with("--set optimizer.lr[0]=1: "), "{m}");
    }
}
