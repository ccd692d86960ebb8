//! The conformance binaries' report of a fatal signal (`conformance::crash`): a child process
//! (this binary, re-run on one test) faults, says where, and still dies of the signal.
#![cfg(target_os = "linux")]

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;

const CHILD: &str = "CONFORMANCE_CRASH_CHILD";

/// In the child: installs the report and reads address 8 (the parent's test runs it alone).
#[test]
fn child_faults() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    conformance::report_fatal_signals();
    // SAFETY: none, on purpose: the read faults and the process dies of SIGSEGV.
    let byte = unsafe { std::ptr::read_volatile(std::hint::black_box(8usize) as *const u8) };
    println!("read {byte} from address 8");
}

#[test]
fn a_fault_is_reported_and_still_kills_the_process() {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", "child_faults", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1");
    // No core file of the child where core dumps are on. SAFETY: `setrlimit` is
    // async-signal-safe, as `pre_exec` requires.
    let out = unsafe {
        command.pre_exec(|| {
            let none = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            match libc::setrlimit(libc::RLIMIT_CORE, &none) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        })
    }
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{:?}\n{stderr}", out.status);
    assert!(stderr.contains("=== fatal signal 11 (SIGSEGV) on thread"), "{stderr}");
    assert!(stderr.contains("faulting address 0x8: not mapped\n"), "{stderr}");
    let exe = std::env::current_exe().unwrap();
    let exe_name = exe.file_name().unwrap().to_string_lossy();
    let instruction = stderr.lines().find(|l| l.starts_with("instruction ")).unwrap_or("");
    assert!(
        instruction.ends_with(&*exe_name),
        "the faulting code is this binary's: {instruction}"
    );
    assert!(stderr.contains("backtrace of the faulting thread:"), "{stderr}");
    assert!(
        stderr.contains("child_faults"),
        "the backtrace names the faulting test: {stderr}"
    );
}
