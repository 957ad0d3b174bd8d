//! Key paths in TOML tables, as `--set` and the error messages write them:
//! `model.layers[2].out`, `model.layers[fc].out`, `model.layers[-1]`; `--set` arguments
//! parsed and set into a table.

use crate::error::Result;
use crate::job_err;
use std::path::Path;

/// One step of a `--set` key: a table key, or an element of an array picked by its index or,
/// in a list of tables such as `model.layers`, by its `name`. Errors print keys the same way
/// (`model.layers[2].out`), so what an error names can be set.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyStep {
    Key(String),
    Index(usize),
    /// `[-n]`: the n-th element from the end, as in Python (`[-1]` is the last).
    FromEnd(usize),
    Named(String),
}

/// `a.b[2].c[name]` into steps; None when a name or a selector is empty or a bracket is
/// unbalanced. Dots inside brackets belong to the selected name.
pub(super) fn parse_key(key: &str) -> Option<Vec<KeyStep>> {
    let mut steps = Vec::new();
    let mut rest = key;
    loop {
        let end = rest.find(['.', '[']).unwrap_or(rest.len());
        let name = rest[..end].trim();
        if name.is_empty() || name.contains(']') {
            return None;
        }
        steps.push(KeyStep::Key(name.to_string()));
        rest = &rest[end..];
        while let Some(inner) = rest.strip_prefix('[') {
            let close = inner.find(']')?;
            let selector = inner[..close].trim().trim_matches('"');
            if selector.is_empty() || selector.contains('[') {
                return None;
            }
            let position = |digits: &str| match digits.parse::<usize>() {
                Ok(n) => Some(n),
                // All digits but too large: a position, not a name.
                Err(_) if digits.bytes().all(|b| b.is_ascii_digit()) => Some(usize::MAX),
                Err(_) => None,
            };
            steps.push(match selector.strip_prefix('-') {
                Some(digits) => KeyStep::FromEnd(position(digits).filter(|&n| n > 0)?),
                None => match position(selector) {
                    Some(index) => KeyStep::Index(index),
                    None => KeyStep::Named(selector.to_string()),
                },
            });
            rest = &inner[close + 1..];
        }
        match rest.strip_prefix('.') {
            Some(next) => rest = next,
            None if rest.is_empty() => return Some(steps),
            None => return None,
        }
    }
}

pub(super) fn element_name(element: &toml::Value) -> Option<&str> {
    element.get("name").and_then(toml::Value::as_str)
}

/// `steps` as the user writes them: `model.layers[2].out`.
pub(super) fn dotted(steps: &[KeyStep]) -> String {
    let mut s = String::new();
    for step in steps {
        match step {
            KeyStep::Key(k) if s.is_empty() => s += k,
            KeyStep::Key(k) => s += &format!(".{k}"),
            KeyStep::Index(i) => s += &format!("[{i}]"),
            KeyStep::FromEnd(n) => s += &format!("[-{n}]"),
            KeyStep::Named(n) => s += &format!("[{n}]"),
        }
    }
    s
}

/// The value at `steps` in `table`, following keys and indices (not names).
pub(super) fn lookup_table<'a>(
    table: &'a toml::Table,
    steps: &[KeyStep],
) -> Option<&'a toml::Value> {
    let (KeyStep::Key(first), rest) = steps.split_first()? else {
        return None;
    };
    rest.iter()
        .try_fold(table.get(first)?, |at, step| match step {
            KeyStep::Key(k) => at.get(k.as_str()),
            KeyStep::Index(i) => at.get(*i),
            KeyStep::FromEnd(n) => at.get(at.as_array()?.len().checked_sub(*n)?),
            KeyStep::Named(_) => None,
        })
}

pub(super) fn lookup<'a>(root: &'a toml::Value, steps: &[KeyStep]) -> Option<&'a toml::Value> {
    lookup_table(root.as_table()?, steps)
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

pub(super) fn canonical_key(table: &toml::Table, key: &str) -> Vec<String> {
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
pub(super) fn assign(
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

/// A figment path (indices as keys) as key steps.
pub(super) fn path_steps(path: &[String]) -> Vec<KeyStep> {
    let step = |part: &String| match part.parse() {
        Ok(index) => KeyStep::Index(index),
        Err(_) => KeyStep::Key(part.clone()),
    };
    path.iter().map(step).collect()
}

/// Whether `table` has the key at `path` (positions select list elements), or a value
/// that is not a table or list at the start of it.
pub(super) fn holds(table: &toml::Table, path: &[String]) -> bool {
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
