//! Every command's `--help`: each flag says what it does, and the llama.cpp-style short flags
//! are where a llama.cpp user reaches for them.

use std::process::Command;

fn help(command: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(command)
        .arg("--help")
        .output()
        .expect("run skainet-kv --help");
    assert!(out.status.success(), "{command:?} --help failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The commands `skainet-kv --help` lists, with `snapshot`'s two.
fn commands() -> Vec<Vec<String>> {
    let top = help(&[]);
    let mut out: Vec<Vec<String>> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(|c| vec![c.to_string()])
        .collect();
    out.retain(|c| c[0] != "snapshot");
    out.push(vec!["snapshot".into(), "save".into()]);
    out.push(vec!["snapshot".into(), "info".into()]);
    assert!(out.len() > 10, "{top}");
    out
}

/// The flags of a long `--help` without a description: clap prints one on the flag's line or
/// on the deeper-indented lines below it; a flag followed by nothing but its possible values
/// (or the next flag) has none.
fn undocumented(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let flag = match trimmed.split_once("--") {
            Some((short, rest)) if indent <= 6 && (short.is_empty() || short.ends_with(", ")) => rest,
            _ => continue,
        };
        let name: String = flag
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if name.is_empty() || name == "help" || name == "version" {
            continue;
        }
        let after = flag[name.len()..].trim_start();
        let after = match after.strip_prefix('<') {
            Some(v) => v.split_once('>').map_or("", |(_, rest)| rest).trim(),
            None => after.trim(),
        };
        if !after.is_empty() {
            continue;
        }
        let next = lines[i + 1..]
            .iter()
            .find(|l| !l.trim().is_empty())
            .copied()
            .unwrap_or("");
        let deeper = next.len() - next.trim_start().len() >= 10;
        if !deeper || next.trim_start().starts_with("Possible values") {
            out.push(format!("--{name}"));
        }
    }
    out
}

#[test]
fn every_flag_of_every_command_has_help() {
    let mut missing = Vec::new();
    for command in commands() {
        let args: Vec<&str> = command.iter().map(String::as_str).collect();
        for flag in undocumented(&help(&args)) {
            missing.push(format!("{} {flag}", command.join(" ")));
        }
    }
    assert!(missing.is_empty(), "flags without help: {missing:?}");
    // The check itself finds a flag without help.
    assert_eq!(
        undocumented("Options:\n      --json\n\n  -m, --model <MODEL>\n          A model\n"),
        vec!["--json"]
    );
}

#[test]
fn llama_cpp_short_flags_are_there() {
    let generate = help(&["generate"]);
    for flag in ["-m, --model", "-p, --prompt", "-n, --max-new", "-s, --seed"] {
        assert!(generate.contains(flag), "generate lacks {flag}");
    }
    let chat = help(&["chat"]);
    for flag in ["-m, --model", "-n, --max-new", "-s, --seed"] {
        assert!(chat.contains(flag), "chat lacks {flag}");
    }
    for command in ["redecode", "diverge", "inspect", "bench", "tokenize", "demo", "export"] {
        assert!(help(&[command]).contains("-m, --model"), "{command} lacks -m");
    }
}
