//! `skainet-kv chat` as a person and as a script use it, on the fixture `tiny-gemma3:7` over the
//! FP32 reference (random weights: replies are noise, but greedy noise, so replays compare
//! exactly).
//!
//! The terminal test runs the binary in a tmux pane (a real pseudo-terminal: stdin, stdout and
//! stderr are terminals, Ctrl-C is the terminal's SIGINT) and types into it: a reply stopped by
//! Ctrl-C mid-stream, two answered turns, /save, /reset, /load, an unknown command, a missing
//! file, then Ctrl-C twice at the prompt to leave. tmux is installed by scripts/setup.sh.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_skainet-kv");
const MODEL: &str = "tiny-gemma3:7";
const TOOLS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/tools/fixture-tools.json");

/// Runs `chat` with `input` on stdin (not a terminal); (success, stdout, stderr).
fn piped(args: &[&str], input: &str) -> (bool, String, String) {
    use std::io::Write as _;
    let mut child = Command::new(BIN)
        .arg("chat")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run skainet-kv chat");
    // A run refused before it reads stdin has closed it: that write fails, the outcome is read.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_scripted_session_answers_saves_and_reloads_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("c.json");
    let input = format!("Good morning\n//slash is text\n/save {}\n", saved.display());
    let (ok, out, err) = piped(&["-m", MODEL, "-n", "24"], &input);
    assert!(ok, "{err}");
    // Not a terminal: no banner, no prompt, one line per reply.
    assert!(err.is_empty(), "{err}");
    assert_eq!(out.lines().count(), 2, "{out:?}");
    let messages: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let list = messages.as_array().unwrap();
    assert_eq!(list.len(), 4, "{messages}");
    assert_eq!(list[2]["content"], "/slash is text");
    let replies: Vec<&str> = out.lines().collect();
    assert!(!list[1]["content"].as_str().unwrap().is_empty() && !replies[0].is_empty());

    // The third turn after /load equals the third turn of one session that never stopped.
    let (ok, whole, err) = piped(&["-m", MODEL, "-n", "24"], "Good morning\n//slash is text\nAnd now?\n");
    assert!(ok, "{err}");
    let load = format!("/load {}\nAnd now?\n", saved.display());
    let (ok, resumed, err) = piped(&["-m", MODEL, "-n", "24"], &load);
    assert!(ok, "{err}");
    assert_eq!(resumed.lines().last(), whole.lines().last(), "{resumed:?} vs {whole:?}");
    let (ok, flag, err) = piped(
        &["-m", MODEL, "-n", "24", "--load", saved.to_str().unwrap()],
        "And now?\n",
    );
    assert!(ok, "{err}");
    assert_eq!(flag.lines().last(), whole.lines().last());
}

#[test]
fn tools_give_parsed_calls_and_bad_input_fails_a_script_in_one_line() {
    let (ok, out, err) = piped(
        &[
            "-m",
            MODEL,
            "-n",
            "96",
            "--tools",
            TOOLS,
            "--tool-choice",
            "required",
            "--system",
            "Home.",
        ],
        "Kitchen lights on\nA timer for ten minutes\n",
    );
    assert!(ok, "{err}");
    let calls: Vec<&str> = out.lines().filter(|l| l.starts_with("[tool call] ")).collect();
    assert_eq!(calls.len(), 2, "{out}");
    for call in calls {
        let json: serde_json::Value = serde_json::from_str(&call["[tool call] ".len()..]).unwrap();
        assert!(
            ["set_lights", "set_timer"].contains(&json["name"].as_str().unwrap()),
            "{json}"
        );
    }

    for (args, input, expect) in [
        (vec!["-m", MODEL], "/bogus\n", "unknown command /bogus"),
        (
            vec!["-m", MODEL],
            "/load /no/such/file.json\n",
            "/load /no/such/file.json",
        ),
        (
            vec!["-m", MODEL, "--load", "/no/such.json"],
            "hi\n",
            "--load /no/such.json",
        ),
        (
            vec!["-m", MODEL, "--tools", "/no/tools.json"],
            "hi\n",
            "--tools /no/tools.json",
        ),
        (
            vec!["-m", MODEL, "--tools", TOOLS, "--tool-choice", "nope"],
            "hi\n",
            "nope",
        ),
        (vec!["-m", MODEL, "-n", "0"], "hi\n", "max new tokens"),
    ] {
        let (ok, _, err) = piped(&args, input);
        assert!(!ok, "{args:?} {input:?} succeeded");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(expect), "{args:?}: {err}");
    }
    // A system message in a loaded file is the conversation's system text, not a turn.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sys.json");
    std::fs::write(
        &file,
        r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]"#,
    )
    .unwrap();
    let out_file = dir.path().join("out.json");
    let (ok, _, err) = piped(
        &["-m", MODEL, "-n", "4", "--load", file.to_str().unwrap()],
        &format!("/save {}\n", out_file.display()),
    );
    assert!(ok, "{err}");
    let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    assert_eq!(back[0]["role"], "system");
    assert_eq!(back[0]["content"], "Be brief.");
    assert_eq!(back.as_array().unwrap().len(), 3);
}

/// A tmux server of our own (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run tmux (scripts/setup.sh installs it)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        // Without the blank rows below the cursor, so that offsets into it stay put.
        let screen = self.run(&["capture-pane", "-p", "-J", "-S", "-2000", "-t", "chat"]);
        screen.trim_end().to_string()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "chat"];
        args.extend(keys);
        self.run(&args);
    }

    /// Waits until the screen, after its first `from` bytes, holds `what`; the screen then.
    fn wait_for(&self, from: usize, what: &str, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if screen.get(from..).is_some_and(|s| s.contains(what)) {
                return screen;
            }
            assert!(
                start.elapsed() < limit,
                "waited {limit:?} for {what:?}; the screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["-L", &self.socket, "kill-server"]).output();
    }
}

#[test]
fn a_terminal_session_stops_a_reply_on_ctrl_c_and_goes_on() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("t.json");
    let status = dir.path().join("status");
    let tmux = Tmux {
        socket: format!("skv-chat-test-{}", std::process::id()),
    };
    let cache = std::env::var("SKAINET_KV_CACHE").unwrap_or_default();
    // 400 ids a reply: long enough (about a second here) for a Ctrl-C to land mid-stream.
    let command = format!(
        "env SKAINET_KV_CACHE='{cache}' '{BIN}' chat -m {MODEL} -n 400; echo $? > '{}'",
        status.display()
    );
    tmux.run(&["new-session", "-d", "-s", "chat", "-x", "160", "-y", "50", &command]);
    let limit = Duration::from_secs(20);
    tmux.wait_for(0, "/help lists commands", limit);
    tmux.wait_for(0, "\n>", limit);

    // A reply stopped as soon as it streams.
    tmux.keys(&["Tell me a long story", "Enter"]);
    let screen = tmux.wait_for(0, "Tell me a long story\n", limit);
    let start = screen.find("Tell me a long story\n").unwrap() + 21;
    let streaming = Instant::now();
    loop {
        let screen = tmux.screen();
        if screen[start..].trim_end().chars().count() > 2 {
            break;
        }
        assert!(streaming.elapsed() < limit, "no reply streamed:\n{screen}");
        std::thread::sleep(Duration::from_millis(10));
    }
    tmux.keys(&["C-c"]);
    tmux.wait_for(start, "[stopped: this reply is not part of the conversation]", limit);
    // capture-pane drops the prompt's trailing space.
    let mark = tmux.wait_for(start, "tokens/s)\n>", limit).len();

    // Two turns answered in full, each with its rate line.
    tmux.keys(&["Hello", "Enter"]);
    tmux.wait_for(mark, "tokens/s)\n>", limit);
    tmux.keys(&["/save ", saved.to_str().unwrap(), "Enter"]);
    let at = tmux.wait_for(mark, "(saved 2 messages", limit).len();
    tmux.keys(&["/reset", "Enter"]);
    tmux.wait_for(at, "starts over", limit);
    tmux.keys(&["/load ", saved.to_str().unwrap(), "Enter"]);
    tmux.wait_for(at, "(loaded 2 turns", limit);
    tmux.keys(&["/nope", "Enter"]);
    tmux.wait_for(at, "error: unknown command /nope", limit);
    tmux.keys(&["/load /no/such/file.json", "Enter"]);
    let at = tmux.wait_for(at, "error: /load /no/such/file.json", limit).len();
    tmux.keys(&["And then?", "Enter"]);
    let at = tmux.wait_for(at, "tokens/s)\n>", limit).len();
    tmux.keys(&["/save ", saved.to_str().unwrap(), "Enter"]);
    tmux.wait_for(at, "(saved 4 messages", limit);

    // Ctrl-C at the prompt: a hint, then the second one ends the session with status 0.
    tmux.keys(&["C-c"]);
    tmux.wait_for(at, "Ctrl-C again to quit", limit);
    tmux.keys(&["C-c"]);
    let waited = Instant::now();
    while !status.exists() {
        assert!(waited.elapsed() < limit, "still running:\n{}", tmux.screen());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(std::fs::read_to_string(&status).unwrap().trim(), "0");

    // The terminal session's turns are a script's, id for id (greedy): the stopped reply left
    // nothing behind.
    let replay = dir.path().join("r.json");
    let (ok, _, err) = piped(
        &["-m", MODEL, "-n", "400"],
        &format!("Hello\nAnd then?\n/save {}\n", replay.display()),
    );
    assert!(ok, "{err}");
    assert_eq!(read(&saved), read(&replay));
    eprintln!("terminal session test: {:.1} s", started.elapsed().as_secs_f64());
}

fn read(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}
