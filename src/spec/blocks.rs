//! Writing out `repeat` layers: each becomes `times` copies of its block's layers, named by
//! copy, so that the graph, `trainer check` and the run's config.toml see a plain list.

use super::{LayerSpec, ModelLayer, ModelSpec};
use crate::error::{Error, Result};

/// What a block's layer writes in `inputs` for its copy's input.
pub const BLOCK_INPUT: &str = "block_input";

/// Replaces every repeat layer of `model` by its copies, and empties model.blocks.
pub fn expand(model: &mut ModelSpec) -> Result<()> {
    let blocks = std::mem::take(&mut model.blocks);
    let mut layers = Vec::with_capacity(model.layers.len());
    let mut keys = Vec::with_capacity(model.layers.len());
    for (i, entry) in model.layers.iter().cloned().enumerate() {
        let LayerSpec::Repeat(repeat) = &entry.layer else {
            layers.push(entry);
            keys.push(format!("model.layers[{i}]"));
            continue;
        };
        let key = format!("model.layers[{i}]");
        if entry.name.is_some() || entry.inputs.is_some() {
            let why = "a repeat layer takes no name or inputs: its block's layers have them";
            return Err(at(&key, why.into()));
        }
        let Some(block) = blocks.get(&repeat.block) else {
            let known: Vec<&str> = blocks.keys().map(String::as_str).collect();
            let why = format!(
                "block = \"{}\", but model.blocks has no such block (it has: {})",
                repeat.block,
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            );
            return Err(at(&format!("{key}.block"), why));
        };
        let block_key = format!("model.blocks.{}", repeat.block);
        if block.is_empty() {
            return Err(at(&block_key, "an empty block: give it layers".into()));
        }
        if block
            .iter()
            .any(|l| matches!(l.layer, LayerSpec::Repeat(_)))
        {
            return Err(at(&block_key, "a block cannot repeat another block".into()));
        }
        // Copy 0 reads the layer before the repeat (the data when there is none).
        let mut input = match layers.last() {
            None => Some("input".to_string()),
            Some(last) => last.name.clone(),
        };
        for copy in 0..repeat.times {
            let name_of = |local: &str| format!("{}{copy}_{local}", repeat.block);
            let local = |n: &str| block.iter().any(|l| l.name.as_deref() == Some(n));
            for (j, layer) in block.iter().enumerate() {
                let mut layer = layer.clone();
                let last = j + 1 == block.len();
                layer.name = match &layer.name {
                    Some(n) => Some(name_of(n)),
                    None if last => Some(format!("{}{copy}", repeat.block)),
                    None => None,
                };
                if let Some(inputs) = &mut layer.inputs {
                    for name in inputs.iter_mut() {
                        if name == BLOCK_INPUT {
                            *name = input.clone().ok_or_else(|| {
                                at(
                                    &key,
                                    "its block reads \"block_input\", the layer before the \
                                     repeat, which has no name: give it one"
                                        .into(),
                                )
                            })?;
                        } else if local(name) {
                            *name = name_of(name);
                        }
                    }
                }
                layers.push(layer);
                keys.push(format!("{block_key}[{j}]"));
            }
            input = layers.last().and_then(|l| l.name.clone());
        }
    }
    let uses = |name: &String| {
        let repeats = |l: &ModelLayer| matches!(&l.layer, LayerSpec::Repeat(r) if &r.block == name);
        model.layers.iter().any(repeats)
    };
    if let Some(unused) = blocks.keys().find(|name| !uses(name)) {
        let why = "no repeat layer uses this block".to_string();
        return Err(at(&format!("model.blocks.{unused}"), why));
    }
    model.layers = layers;
    model.layer_keys = keys;
    Ok(())
}

fn at(key: &str, why: String) -> Error {
    Error::AtKey {
        key: key.to_string(),
        message: format!("{key}: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::JobSpec;

    fn model(text: &str) -> ModelSpec {
        let job: JobSpec = toml::from_str(&format!(
            "[data]\nsource = \"synthetic\"\n[optimizer]\ntype = \"sgd\"\nlr = 0.1\n{text}"
        ))
        .unwrap();
        job.model
    }

    const GPT: &str = r#"
        [model]
        layers = [
          { type = "linear", out = 8, name = "wte" },
          { type = "repeat", block = "h", times = 2 },
          { type = "linear", out = 3 },
        ]
        [model.blocks]
        h = [
          { type = "layernorm", name = "ln" },
          { type = "linear", out = 8, name = "fc" },
          { type = "add", inputs = ["block_input", "fc"] },
        ]
    "#;

    #[test]
    fn a_repeat_writes_named_copies_that_read_their_own_input() {
        let mut m = model(GPT);
        expand(&mut m).unwrap();
        let names: Vec<Option<&str>> = m.layers.iter().map(|l| l.name.as_deref()).collect();
        let want = ["wte", "h0_ln", "h0_fc", "h0", "h1_ln", "h1_fc", "h1"];
        assert_eq!(names[..7], want.map(Some));
        assert_eq!(m.layers[3].inputs, Some(vec!["wte".into(), "h0_fc".into()]));
        assert_eq!(m.layers[6].inputs, Some(vec!["h0".into(), "h1_fc".into()]));
        assert!(m.blocks.is_empty() && m.layers.len() == 8);
    }

    #[test]
    fn bad_repeats_are_named() {
        let cases = [
            (GPT.replace("block = \"h\"", "block = \"g\""), "model.layers[1].block: block = \"g\", but model.blocks has no such block (it has: h)"),
            (GPT.replace("name = \"wte\"", "bias = true"), "the layer before the repeat, which has no name"),
            (GPT.replace("times = 2 }", "times = 2 }, { type = \"repeat\", block = \"h\", times = 1, name = \"x\" }"), "a repeat layer takes no name or inputs"),
            (GPT.replace("h = [", "unused = [{ type = \"relu\" }]\nh = ["), "model.blocks.unused: no repeat layer uses this block"),
        ];
        for (text, want) in cases {
            let e = expand(&mut model(&text)).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
