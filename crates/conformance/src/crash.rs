//! Last words of a test process killed by a signal. A conformance binary on lavapipe once died by
//! `SIGSEGV` in CI with nothing else printed (stop 25: `iree_vulkan_v2`, after 11 of 13 tests;
//! not reproduced here in 5 full runs, cold caches included). With this installed, such a death
//! prints the signal, the faulting address, the thread, the instruction and the file it belongs
//! to (none: generated code, e.g. a lavapipe shader or an IREE kernel), the memory mappings of
//! both addresses and a backtrace, then dies of the same signal as before.
//!
//! `crash-handler` also gives every thread, C and C++ ones included (lavapipe's, IREE's workers),
//! an alternate signal stack, so a stack overflow on any of them is reported too.

use std::sync::OnceLock;

/// Installs the report for this process (once; later calls do nothing). A report is written
/// from the signal handler, allocating: good enough for last words, not for a process that lives
/// on.
pub fn report_fatal_signals() {
    static HANDLER: OnceLock<Option<crash_handler::CrashHandler>> = OnceLock::new();
    HANDLER.get_or_init(|| {
        // SAFETY: the closure reads the crash context and /proc and prints, then returns
        // `Handled(false)`: the previous handlers run, and the process dies of the signal.
        let event = unsafe {
            crash_handler::make_crash_event(|context: &crash_handler::CrashContext| {
                eprintln!("{}", report(context));
                // Captured here (the frames are this thread's) but symbolized on a thread with a
                // large stack: symbolizing on the small signal stack overflowed it.
                let frames = std::backtrace::Backtrace::force_capture();
                let print = move || eprintln!("backtrace of the faulting thread:\n{frames}");
                if let Ok(printer) = std::thread::Builder::new().stack_size(16 << 20).spawn(print) {
                    let _ = printer.join();
                }
                crash_handler::CrashEventResult::Handled(false)
            })
        };
        crash_handler::CrashHandler::attach(event)
            .inspect_err(|e| eprintln!("conformance: no crash report: {e}"))
            .ok()
    });
}

fn report(context: &crash_handler::CrashContext) -> String {
    let info = &context.siginfo;
    let fault = fault_address(info);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mapping = |addr: usize| mapping_of(&maps, addr).unwrap_or("not mapped").to_string();
    let instruction = match instruction_pointer(context) {
        Some(ip) => format!("{ip:#x}: {}", mapping(ip)),
        None => "not read on this architecture".to_string(),
    };
    format!(
        "\n=== fatal signal {} ({}) on thread {} (pid {}) ===\nfaulting address {fault:#x}: {}\n\
         instruction {instruction}",
        info.ssi_signo,
        signal_name(info.ssi_signo as i32),
        context.tid,
        context.pid,
        mapping(fault),
    )
}

/// `si_addr` of the kernel's `siginfo_t`, which `crash-handler` hands over reinterpreted as a
/// `signalfd_siginfo` (another layout): on 64-bit Linux `si_addr` is the 8 bytes at offset 16,
/// where `signalfd_siginfo` has `ssi_uid` and `ssi_fd`; on 32-bit Linux the 4 at offset 12,
/// its `ssi_pid`.
fn fault_address(info: &libc::signalfd_siginfo) -> usize {
    #[cfg(target_pointer_width = "64")]
    {
        (info.ssi_uid as usize) | ((info.ssi_fd as u32 as usize) << 32)
    }
    #[cfg(target_pointer_width = "32")]
    {
        info.ssi_pid as usize
    }
}

/// The `/proc/self/maps` line whose range holds `addr`.
fn mapping_of(maps: &str, addr: usize) -> Option<&str> {
    maps.lines().find(|line| {
        let range = line.split_whitespace().next().unwrap_or("");
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        match (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
            (Ok(lo), Ok(hi)) => (lo..hi).contains(&addr),
            _ => false,
        }
    })
}

fn instruction_pointer(context: &crash_handler::CrashContext) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        const REG_RIP: usize = 16;
        Some(context.context.uc_mcontext.gregs[REG_RIP] as usize)
    }
    #[cfg(target_arch = "aarch64")]
    {
        Some(context.context.uc_mcontext.pc as usize)
    }
    #[cfg(target_arch = "arm")]
    {
        Some(context.context.uc_mcontext.arm_pc as usize)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "arm")))]
    {
        let _ = context;
        None
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGABRT => "SIGABRT",
        libc::SIGTRAP => "SIGTRAP",
        _ => "another signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_mapping_holding_an_address() {
        let maps = "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/dbus-daemon\n\
                    7f000000-7f001000 rwxp 00000000 00:00 0 \n";
        assert!(mapping_of(maps, 0x400100).unwrap().ends_with("dbus-daemon"));
        assert!(mapping_of(maps, 0x7f000800).unwrap().starts_with("7f000000-"));
        assert_eq!(mapping_of(maps, 0x452000), None, "ranges end before their upper bound");
        assert_eq!(mapping_of(maps, 0x10), None);
    }
}
