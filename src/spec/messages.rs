//! What serde's, toml's and figment's messages become: the file, line and column, the key
//! as `--set` writes it, the value given and what is allowed, a did-you-mean, and a hint
//! when a key belongs to another section.

use super::keys::{lookup_table, parse_key, path_steps, KeyStep};
use super::sources::KeySources;
use super::{JobSpec, SECTIONS};
use crate::error::Error;

/// Formats a TOML error as `file:line:col: key `a.b`: message` plus a suggestion.
/// `key`: the key at fault, with the file's table to show its value where the message does
/// not.
pub(crate) fn toml_error(
    file: &str,
    text: &str,
    e: &toml::de::Error,
    key: Option<(&str, &toml::Table)>,
) -> String {
    let place = match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            format!("{file}:{line}:{col}")
        }
        None => file.to_string(),
    };
    let (below, message) = key_below(e.message().trim_end());
    let mut place = place;
    let (key, table) = match key {
        Some((k, table)) if !k.is_empty() && k != "." => (Some(k), Some(table)),
        _ => (None, None),
    };
    let key = match (key, below) {
        (Some(k), Some(below)) => format!("{k}.{below}"),
        (Some(k), None) => k.to_string(),
        (None, below) => below.unwrap_or_default().to_string(),
    };
    // An error inside a list element (a layer's key) spans the whole list: point at the
    // key instead.
    let at_key = parse_key(&key).and_then(|steps| key_offset(text, &steps));
    if let (Some(offset), Some(span)) = (at_key, e.span()) {
        if span.start < offset && offset < span.end {
            let (line, col) = line_col(text, offset);
            place = format!("{file}:{line}:{col}");
        }
    }
    let path: Vec<String> = key.split('.').map(String::from).collect();
    let message = &with_enum_choices(message, &path);
    let value = table.and_then(|table| lookup_table(table, &parse_key(&key)?));
    // A message that only says what is expected (an untagged enum's) shows the value.
    let given = value
        .filter(|_| message.starts_with("expected "))
        .map_or(String::new(), |value| format!("{value} given; "));
    let key = match key.is_empty() {
        true => String::new(),
        false => format!(" key `{key}`:"),
    };
    let expected = message.split_once("expected ").map_or("", |(_, e)| e);
    if let Some(message) = date_given(value, expected, false) {
        return format!("{place}:{key} {message}");
    }
    // Another tool's name for a key (`target`) before a near spelling (`targets`).
    let hint = match belongs_elsewhere(&path, message) {
        hint if hint.is_empty() => did_you_mean(message),
        hint => hint,
    };
    format!("{place}:{key} {given}{}{hint}", plain(message))
}

/// Keys other tools spell otherwise, and where trainer has them.
pub(super) const OTHER_NAMES: [(&str, &str); 22] = [
    ("learning_rate", "optimizer.lr"),
    ("lr", "optimizer.lr"),
    ("val_split", "data.val_fraction"),
    ("validation_split", "data.val_fraction"),
    ("val_ratio", "data.val_fraction"),
    ("target", "data.label"),
    ("target_column", "data.label"),
    ("label_column", "data.label"),
    ("epoch", "train.epochs"),
    ("num_epochs", "train.epochs"),
    ("max_epochs", "train.epochs"),
    ("max_iters", "train.max_steps"),
    ("grad_clip", "train.clip_grad_norm"),
    ("gradient_clip_val", "train.clip_grad_norm"),
    ("accumulate_grad_batches", "train.grad_accum_steps"),
    ("gradient_accumulation_steps", "train.grad_accum_steps"),
    ("batch", "data.batch_size"),
    (
        "dropout",
        "model.layers (a { type = \"dropout\", p = ... } layer)",
    ),
    ("scheduler", "optimizer.schedule"),
    ("lr_scheduler", "optimizer.schedule"),
    ("warmup_steps", "optimizer.schedule.warmup_steps"),
    ("resume", "checkpoint.resume"),
];

/// For an unknown key (`path`, its last step the key given), where it likely belongs when
/// that is in another section: `learning_rate` → `optimizer.lr`, `[data] epochs` →
/// `train.epochs`. Empty where nothing fits.
pub(super) fn belongs_elsewhere(path: &[String], message: &str) -> String {
    if !message.starts_with("unknown field") {
        return String::new();
    }
    let Some((name, within)) = path.split_last() else {
        return String::new();
    };
    let section = within.first().map_or("", String::as_str);
    let renamed = OTHER_NAMES
        .iter()
        .find(|(other, _)| other == name)
        .map(|(_, ours)| ours.to_string());
    // The same key in another section (`epochs` under [data]).
    let moved = || {
        let schema: serde_json::Value = serde_json::from_str(&super::json_schema()).ok()?;
        SECTIONS.iter().filter(|s| **s != section).find_map(|s| {
            let reference = schema.pointer(&format!("/properties/{s}/$ref"))?.as_str()?;
            let definition = reference.trim_start_matches("#/$defs/");
            schema
                .pointer(&format!("/$defs/{definition}/properties/{name}"))
                .map(|_| format!("{s}.{name}"))
        })
    };
    match renamed.or_else(moved) {
        Some(key) => format!(" (did you mean `{key}`?)"),
        None => String::new(),
    }
}

/// A TOML date or time (`2024-01-01`, `12:00:00`) where something else is `expected`
/// reaches serde as a table ("invalid type: map"): say what it was read as, and how to give
/// text.
pub(super) fn date_given(
    value: Option<&toml::Value>,
    expected: &str,
    from_shell: bool,
) -> Option<String> {
    let Some(toml::Value::Datetime(date)) = value else {
        return None;
    };
    let quote = match (expected.contains("string"), from_shell) {
        (true, true) => format!(": quote it to give text, '\"{date}\"'"),
        (true, false) => format!(": quote it to give text, \"{date}\""),
        (false, _) => String::new(),
    };
    Some(plain(&format!(
        "{date} given, which TOML reads as a date or time; expected {expected}{quote}"
    )))
}

/// A `--set` value that TOML reads as another type than the key's, said with how to write
/// what was meant: a number or `true` for a text key (quote it), `2.0` for a whole number.
pub(super) fn read_as(
    value: Option<&toml::Value>,
    expected: &str,
    path: &[String],
) -> Option<String> {
    let value = value?;
    let kind = match value {
        toml::Value::Integer(_) | toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "true or false",
        _ => return None,
    };
    if expected.contains("string") {
        // Quoting is the fix for a name or a path; a duration or a device has a form of its
        // own, which its key's check says once the value is text.
        let free_text = [
            "name",
            "path",
            "val_path",
            "test_path",
            "train_images",
            "train_labels",
            "test_images",
            "test_labels",
            "init_from",
        ];
        let quote = match path.last().is_some_and(|k| free_text.contains(&k.as_str())) {
            true => format!(": quote it to give text, '\"{value}\"'"),
            false => String::new(),
        };
        return Some(format!(
            "{value} given, which TOML reads as {kind}; expected {expected}{quote}"
        ));
    }
    let whole = |f: f64| {
        let least = match expected.contains("not negative") {
            true => 0.0,
            false => -(2f64.powi(53)),
        };
        f.fract() == 0.0 && (least..=2f64.powi(53)).contains(&f)
    };
    match value {
        toml::Value::Float(f) if expected.starts_with("a whole number") && whole(*f) => Some(
            format!("{value} given; expected {expected}: write {f:.0}, without a decimal point"),
        ),
        _ => None,
    }
}

/// A wrong type given to a key of fixed choices says which they are, not serde's "expected
/// enum Normalize" (or toml's "wanted string or table").
pub(super) fn with_enum_choices(message: &str, path: &[String]) -> String {
    let start = match message.find("expected enum ") {
        Some(at) => at,
        None if message == "wanted string or table" => 0,
        None => return message.to_string(),
    };
    match enum_choices(path) {
        Some(choices) => format!("{}expected {choices}", &message[..start]),
        None => message.to_string(),
    }
}

/// The values a key of fixed choices allows, as serde lists them (`one of "a", "b", "c"`,
/// `"a" or "b"`): read back from serde's error for a value that none of them is, at that key
/// in an otherwise empty job.
pub(super) fn enum_choices(path: &[String]) -> Option<String> {
    let (last, tables) = path.split_last()?;
    if path
        .iter()
        .any(|p| p.is_empty() || p.parse::<usize>().is_ok())
    {
        return None;
    }
    let header = match tables.is_empty() {
        true => String::new(),
        false => format!("[{}]\n", tables.join(".")),
    };
    let probe = format!("{header}{last} = \"\\u0001\"\n");
    let error = toml::from_str::<JobSpec>(&probe).err()?;
    let message = error.message();
    let choices = message.strip_prefix("unknown variant `\u{1}`, expected ")?;
    Some(choices.trim_end().replace('`', "\""))
}

/// serde's type names in the words of a job file.
pub(super) fn plain(message: &str) -> String {
    let message = [
        ("expected usize", "expected a whole number, not negative"),
        ("expected u64", "expected a whole number, not negative"),
        ("expected u32", "expected a whole number, not negative"),
        ("expected i64", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
        ("expected a sequence", "expected a list"),
    ]
    .iter()
    .fold(message.to_string(), |m, (rust, plain)| {
        m.replace(rust, plain)
    });
    // "expected struct OptimizerSpec": a table such as [optimizer].
    match message.split_once("expected struct ") {
        Some((before, after)) => {
            let rest = after.trim_start_matches(|c: char| c.is_alphanumeric());
            format!("{before}expected a table{rest}")
        }
        None => message,
    }
}

/// A message that names a key below the value it is about (`ModelLayer`'s "key `out`: ..."):
/// that key and the rest.
pub(super) fn key_below(message: &str) -> (Option<&str>, &str) {
    let below = message
        .strip_prefix("key `")
        .and_then(|rest| rest.split_once("`: "));
    match below {
        Some((key, rest)) => (Some(key), rest),
        None => (None, message),
    }
}

/// Where the key at `steps` is written in the TOML `text`: the start of its name (of the
/// element, for a position), or of the deepest part of the path that is there.
pub(super) fn key_offset(text: &str, steps: &[KeyStep]) -> Option<usize> {
    use toml_edit::{Item, Table, TableLike, Value};
    #[derive(Clone, Copy)]
    enum At<'a> {
        Item(&'a Item),
        Value(&'a Value),
        Table(&'a Table),
    }
    let doc = toml_edit::ImDocument::parse(text).ok()?;
    let (mut at, mut offset) = (At::Item(doc.as_item()), None);
    for step in steps {
        let next = match step {
            KeyStep::Key(name) => {
                let table: Option<&dyn TableLike> = match at {
                    At::Item(item) => item.as_table_like(),
                    At::Value(value) => value.as_inline_table().map(|t| t as &dyn TableLike),
                    At::Table(table) => Some(table),
                };
                table
                    .and_then(|t| t.get_key_value(name))
                    .map(|(key, item)| (At::Item(item), key.span()))
            }
            KeyStep::Index(i) => match at {
                At::Item(Item::ArrayOfTables(tables)) => {
                    tables.get(*i).map(|t| (At::Table(t), t.span()))
                }
                At::Item(Item::Value(Value::Array(list))) | At::Value(Value::Array(list)) => {
                    list.get(*i).map(|v| (At::Value(v), v.span()))
                }
                _ => None,
            },
            _ => None,
        };
        let Some((child, span)) = next else {
            break;
        };
        at = child;
        offset = span.map(|s| s.start).or(offset);
    }
    offset
}

pub(super) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.chars().rev().take_while(|&c| c != '\n').count() + 1;
    (line, col)
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
    let candidates = || allowed.split('`').skip(1).step_by(2);
    // A word cut short or run on (`kernel` for `kernel_size`) is far in edits but plain;
    // of several, the nearest in length (`input` is `inputs`, not `in`).
    let extends = candidates()
        .filter(|c| given.len() >= 3 && (c.starts_with(given) || given.starts_with(c)))
        .min_by_key(|c| c.len().abs_diff(given.len()));
    if let Some(candidate) = extends {
        return format!(" (did you mean `{candidate}`?)");
    }
    let best = candidates()
        .map(|candidate| (edit_distance(given, candidate), candidate))
        .min();
    match best {
        // Close, and not a rewrite of the whole word (`p` is not a typo of `in`).
        Some((d, candidate)) if d <= (given.len() / 3).max(2) && d < given.len() => {
            format!(" (did you mean `{candidate}`?)")
        }
        _ => String::new(),
    }
}

pub(super) fn edit_distance(a: &str, b: &str) -> usize {
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

pub(super) fn layered_error(
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
