//! Every command README.md and docs/ show runs as shown. A fenced block whose info string is
//! `sh` is run: a file's `sh` blocks, in order, as one bash script (`set -euo pipefail`), in
//! a scratch directory holding a copy of jobs/, with this build's `trainer` on PATH. Lines
//! starting with `cargo ` are left out: this test is cargo's. Blocks that need what CI lacks
//! (a GPU, several machines, Fashion-MNIST) use another info string, e.g. `console`.

use crate::common::{root, trainer_bin};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `sh` blocks of a markdown text, joined in order, without `cargo` lines.
fn sh_script(markdown: &str) -> String {
    let mut script = String::new();
    let mut in_sh = false;
    let mut in_other = false;
    for line in markdown.lines() {
        let fence = line.trim_start().strip_prefix("```");
        match fence {
            Some(info) if !in_sh && !in_other => {
                in_sh = info.trim() == "sh";
                in_other = !in_sh;
            }
            Some(_) => (in_sh, in_other) = (false, false),
            None if in_sh && !line.trim_start().starts_with("cargo ") => {
                script.push_str(line);
                script.push('\n');
            }
            None => {}
        }
    }
    script
}

/// README.md and every markdown file under docs/.
fn documents() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Runs a file's script; the failure's message when it fails.
fn run_commands_of(file: &Path) -> Option<String> {
    let script = sh_script(&std::fs::read_to_string(file).unwrap());
    if script.trim().is_empty() {
        return None;
    }
    let scratch = tempfile::tempdir().unwrap();
    copy_dir(&root().join("jobs"), &scratch.path().join("jobs"));
    let bin_dir = trainer_bin().parent().unwrap().to_path_buf();
    let path = std::env::join_paths(std::iter::once(bin_dir).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("set -euo pipefail\n{script}"))
        .current_dir(scratch.path())
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let tail = |bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes);
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    };
    (!out.status.success()).then(|| {
        format!(
            "{}: its sh blocks failed ({})\n--- stdout\n{}\n--- stderr\n{}",
            file.display(),
            out.status,
            tail(&out.stdout),
            tail(&out.stderr)
        )
    })
}

#[test]
fn the_readme_and_docs_commands_run_as_shown() {
    let files = documents();
    let failures: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = files
            .iter()
            .map(|file| s.spawn(move || run_commands_of(file)))
            .collect();
        runs.into_iter()
            .filter_map(|run| run.join().unwrap())
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The README runs something: its quick start is in `sh` blocks.
#[test]
fn the_readme_shows_runnable_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let script = sh_script(&readme);
    assert!(script.contains("trainer run jobs/mlp.toml"), "{script}");
}

#[test]
fn only_sh_blocks_are_taken_and_cargo_lines_are_left_out() {
    let text = "intro\n```sh\ncargo test\ntrainer run a.toml\n```\n```text\ntrainer no\n```\n\
                ```toml\n[x]\n```\n```sh\necho two\n```\n";
    assert_eq!(sh_script(text), "trainer run a.toml\necho two\n");
}
