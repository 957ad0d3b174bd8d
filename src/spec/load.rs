//! Loading a job: the file, then `TRAINER_*` environment variables, then `--set` (highest),
//! layered with figment. Errors name the file, the line and column where the file is at
//! fault, the key path, what was given and what is allowed (with a "did you mean").

use super::env::{check_env, env_var_giving, job_env_vars, EnvVars};
use super::keys::{dotted, lookup_table, parse_key, parse_set_arg, parse_sets, KeyStep};
use super::messages::{key_below, key_offset, layered_error, line_col, toml_error};
use super::sources::KeySources;
use super::JobSpec;
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
    super::blocks::expand(&mut spec.model)?;
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

/// The layers, lowest first: the file, the environment, `--set`. Figment tags every value
/// with the layer it came from (`trainer check --explain` reads those tags).
pub(super) fn layers(path: &Path, sets: &toml::Table) -> Figment {
    Figment::new()
        .merge(Toml::file_exact(path))
        .merge(EnvVars)
        .merge(SetArgs(sets.clone()))
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

fn resolve_paths(spec: &mut JobSpec, base: &Path) {
    let d = &mut spec.data;
    for p in [
        &mut d.path,
        &mut d.val_path,
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
    use super::super::messages::did_you_mean;
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
