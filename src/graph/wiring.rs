//! Which node each layer reads: a layer's `inputs` name earlier layers (or "input", the
//! data); without `inputs` it reads the previous layer's output, so a plain list is a chain.
//! Node 0 is the data, node i+1 the output of layer i. Errors name the layers involved.

use crate::error::{Error, Result};
use crate::spec::ModelSpec;
use std::collections::HashMap;

/// The name `inputs` use for the data.
pub const INPUT: &str = "input";

/// Layer `i` as errors name it: its key in the job, its kind and its name.
fn label(model: &ModelSpec, i: usize) -> String {
    let (key, l) = (model.layer_key(i), &model.layers[i]);
    match &l.name {
        Some(name) => format!("{key} ({} \"{name}\")", l.layer.kind()),
        None => format!("{key} ({})", l.layer.kind()),
    }
}

/// Why a layer cannot have this name, if it cannot: the name is used in `model.layers[NAME]`
/// (`--set`) and, as PyTorch's module names are, in model.safetensors' tensor names
/// ("NAME.weight"), where an unnamed layer's is its position.
fn unusable(name: &str) -> Option<&'static str> {
    // model.layers[-1] is the last layer and [+1] the second, as `--set` reads them.
    let unsigned = name.strip_prefix(['-', '+']).unwrap_or(name);
    if !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit()) {
        Some(
            "is a number: it would be taken for a position (model.layers[N], or [-N] from \
             the end), and its tensors' names (\"N.weight\") for those of the unnamed layer \
             at that position",
        )
    } else if name.starts_with('-') {
        Some(
            "starts with `-`, which model.layers[-N] reads as a position from the end: the \
             layer could not be named there",
        )
    } else if name.trim().trim_matches('"') != name {
        Some(
            "starts or ends with a space or a quote, which model.layers[NAME] drops: the \
             layer could not be named there",
        )
    } else if name.contains(['.', '[', ']']) {
        Some(
            "holds `.`, `[` or `]`, which model.layers[NAME] and the tensor names in \
             model.safetensors (\"NAME.weight\", as PyTorch's modules) use as separators",
        )
    } else {
        None
    }
}

/// The input nodes of every layer.
pub fn resolve(model: &ModelSpec) -> Result<Vec<Vec<usize>>> {
    let layers = &model.layers;
    let label = |i: usize| label(model, i);
    let mut problems = Vec::new();
    // The first layer with a problem: the error is credited to where it was set.
    let mut first = None;
    let mut problem = |i: usize, text: String| {
        first.get_or_insert(i);
        problems.push(text);
    };
    let mut layer_of: HashMap<&str, usize> = HashMap::new();
    for (i, l) in layers.iter().enumerate() {
        if let Some(name) = l.name.as_deref() {
            if name == INPUT || name.is_empty() {
                problem(
                    i,
                    format!(
                        "{}: the name \"{name}\" is reserved; choose another",
                        label(i)
                    ),
                );
            } else if let Some(why) = unusable(name) {
                problem(i, format!("{}: the name \"{name}\" {why}", label(i)));
            } else if let Some(&first) = layer_of.get(name) {
                problem(
                    i,
                    format!(
                        "{}: the name \"{name}\" is already {}'s",
                        label(i),
                        model.layer_key(first)
                    ),
                );
            } else {
                layer_of.insert(name, i);
            }
        }
    }
    let mut wiring = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let inputs: Vec<usize> = match &l.inputs {
            None => vec![i],
            Some(names) => names
                .iter()
                .filter_map(|name| {
                    if name == INPUT {
                        return Some(0);
                    }
                    match layer_of.get(name.as_str()) {
                        Some(&j) if j < i => Some(j + 1),
                        Some(&j) => {
                            problem(
                                i,
                                format!(
                                    "{}: input \"{name}\" is {}, which does not come before it; a \
                                 layer can only take earlier layers' outputs (the graph must \
                                 have no cycles)",
                                    label(i),
                                    model.layer_key(j)
                                ),
                            );
                            None
                        }
                        None => {
                            let earlier = layers[..i].iter().enumerate().filter_map(|(j, l)| {
                                l.name.as_deref().filter(|n| layer_of.get(n) == Some(&j))
                            });
                            let known: Vec<&str> = std::iter::once(INPUT).chain(earlier).collect();
                            // `check` shows unnamed layers by their index; only a name wires.
                            let unnamed = name
                                .parse::<usize>()
                                .ok()
                                .filter(|&j| j < i && layers[j].name.is_none())
                                .map_or(String::new(), |j| {
                                    format!(
                                        " ({} has no name: give it one, e.g. name = \
                                         \"layer{j}\", and use that)",
                                        model.layer_key(j)
                                    )
                                });
                            problem(
                                i,
                                format!(
                                    "{}: input \"{name}\" is not the name of an earlier layer; \
                                 known: {}{unnamed}",
                                    label(i),
                                    known.join(", ")
                                ),
                            );
                            None
                        }
                    }
                })
                .collect(),
        };
        let taken = l.layer.inputs_taken();
        let given = l.inputs.as_ref().map_or(1, Vec::len);
        if !taken.contains(&given) {
            let (at, name) = (label(i), "name them with inputs = [\"a\", \"b\"]");
            let message = match (*taken.start(), *taken.end()) {
                (1, 1) => format!(
                    "{at}: takes one input, {given} given (add, concat and multiply combine several)"
                ),
                (2, 2) => format!("{at}: takes two inputs, {given} given; {name}"),
                _ => format!("{at}: takes two or more inputs, {given} given; {name}"),
            };
            problem(i, message);
        }
        wiring.push(inputs);
    }
    // Every layer's output but the last (the model's output) must feed some layer.
    let mut used = vec![false; layers.len() + 1];
    for inputs in &wiring {
        for &n in inputs {
            used[n] = true;
        }
    }
    for i in 0..layers.len().saturating_sub(1) {
        if !used[i + 1] {
            problem(
                i,
                format!(
                    "{}: its output is not used by any layer (only the last layer's output is the \
                 model's); name it in a later layer's inputs, or remove it",
                    label(i)
                ),
            );
        }
    }
    match first {
        None => Ok(wiring),
        Some(i) => Err(Error::AtKey {
            key: model.layer_key(i),
            message: problems.join("\n"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(toml_text: &str) -> ModelSpec {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn a_plain_list_is_a_chain_and_names_wire_a_residual_block() {
        let l = layers(
            r#"layers = [{ type = "linear", out = 4, name = "a" }, { type = "relu" },
               { type = "linear", out = 4, name = "b" }, { type = "add", inputs = ["b", "a"] },
               { type = "concat", inputs = ["input", "input"] }]"#,
        );
        let e = resolve(&l).unwrap_err().to_string();
        assert!(
            e.contains("model.layers[3] (add): its output is not used"),
            "{e}"
        );
        let l = layers(
            r#"layers = [{ type = "linear", out = 4, name = "a" }, { type = "relu" },
               { type = "linear", out = 4, name = "b" }, { type = "add", inputs = ["b", "a"] }]"#,
        );
        assert_eq!(
            resolve(&l).unwrap(),
            vec![vec![0], vec![1], vec![2], vec![3, 1]]
        );
    }

    #[test]
    fn names_that_read_as_positions_or_hold_separators_are_refused() {
        for (name, why) in [
            ("3", "is a number"),
            ("0", "is a number"),
            ("-1", "is a number"),
            ("+1", "is a number"),
            ("-0", "is a number"),
            ("-1a", "starts with `-`"),
            (" 1", "starts or ends with a space or a quote"),
            ("fc ", "starts or ends with a space or a quote"),
            ("fc.1", "holds `.`, `[` or `]`"),
            ("a[0]", "holds `.`, `[` or `]`"),
        ] {
            let text = format!(
                r#"layers = [{{ type = "linear", out = 4 }}, {{ type = "relu", name = "{name}" }}]"#
            );
            let e = resolve(&layers(&text)).unwrap_err().to_string();
            let want = format!("model.layers[1] (relu \"{name}\"): the name \"{name}\" {why}");
            assert!(e.contains(&want), "{want}\nnot in\n{e}");
        }
        for name in ["fc1", "block-2_out", "3a", "+1a", "a b"] {
            let text = format!(
                r#"layers = [{{ type = "linear", out = 4 }}, {{ type = "relu", name = "{name}" }}]"#
            );
            assert!(resolve(&layers(&text)).is_ok(), "{name}");
        }
    }

    #[test]
    fn unknown_later_duplicate_and_unused_names_are_errors_naming_the_layers() {
        let l = layers(
            r#"layers = [{ type = "linear", out = 4, name = "a" }, { type = "relu", name = "a" },
               { type = "add", inputs = ["a", "b"] }, { type = "relu", inputs = ["c"] },
               { type = "linear", out = 2, name = "c" }, { type = "relu", inputs = ["a", "c"] }]"#,
        );
        let e = resolve(&l).unwrap_err().to_string();
        for needle in [
            "model.layers[1] (relu \"a\"): the name \"a\" is already model.layers[0]'s",
            "model.layers[2] (add): input \"b\" is not the name of an earlier layer; known: input, a",
            "model.layers[3] (relu): input \"c\" is model.layers[4], which does not come before it",
            "model.layers[5] (relu): takes one input, 2 given",
            "model.layers[2] (add): its output is not used by any layer",
        ] {
            assert!(e.contains(needle), "{needle}\nnot in\n{e}");
        }
        // `check` shows an unnamed layer by its index, which does not wire it.
        let l =
            layers(r#"layers = [{ type = "linear", out = 4 }, { type = "relu", inputs = ["0"] }]"#);
        let e = resolve(&l).unwrap_err().to_string();
        let want = "input \"0\" is not the name of an earlier layer; known: input \
                    (model.layers[0] has no name: give it one, e.g. name = \"layer0\", and use that)";
        assert!(e.contains(want), "{e}");
    }
}
