//! Key paths in TOML tables, as `--set` and the error messages write them:
//! `model.layers[2].out`, `model.layers[fc].out`, `model.layers[-1]`.

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
