//! Logging: logcat (tag `skainet_iree_kv`, as the seed) on Android, stderr elsewhere.

pub const TAG: &str = "skainet_iree_kv";

#[cfg(target_os = "android")]
mod sink {
    use std::ffi::{c_char, c_int, CString};

    // android/log.h priorities.
    pub const INFO: c_int = 4;
    pub const ERROR: c_int = 6;

    #[link(name = "log")]
    extern "C" {
        fn __android_log_write(prio: c_int, tag: *const c_char, text: *const c_char) -> c_int;
    }

    pub fn write(priority: c_int, message: &str) {
        let tag = CString::new(super::TAG).unwrap_or_default();
        let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
        // SAFETY: both pointers are NUL-terminated strings that outlive the call.
        unsafe { __android_log_write(priority, tag.as_ptr(), text.as_ptr()) };
    }
}

#[cfg(not(target_os = "android"))]
mod sink {
    pub const INFO: i32 = 4;
    pub const ERROR: i32 = 6;

    pub fn write(priority: i32, message: &str) {
        let level = if priority >= ERROR { "E" } else { "I" };
        eprintln!("{level}/{}: {message}", super::TAG);
    }
}

pub fn info(message: &str) {
    sink::write(sink::INFO, message);
}

pub fn error(message: &str) {
    sink::write(sink::ERROR, message);
}
