//! `skainet-kv diverge` on a tiny fixture: two identical backends never part ways, and the IREE
//! CPU backend tracks the reference within the cross-backend tolerance.

use std::process::Command;

fn diverge(backends: &str) -> serde_json::Value {
    diverge_with("tiny-gemma3:7", backends, &[])
}

fn diverge_with(model: &str, backends: &str, extra: &[&str]) -> serde_json::Value {
    let (ok, v, stderr) = diverge_status(model, backends, extra);
    assert!(ok, "{backends}: {stderr}");
    v
}

/// Whether the command succeeded, its `--json` report (printed whatever the verdict), stderr.
fn diverge_status(model: &str, backends: &str, extra: &[&str]) -> (bool, serde_json::Value, String) {
    diverge_status_env(model, backends, extra, &[])
}

/// [`diverge_status`] with environment variables set for the command.
fn diverge_status_env(
    model: &str,
    backends: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (bool, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .envs(env.iter().copied())
        .args([
            "diverge",
            "--model",
            model,
            "--backends",
            backends,
            "--ids",
            "1,5,9,13,17,21,25,29,33,37,41,45,49,53",
            "--max-new",
            "12",
            "--json",
        ])
        .args(extra)
        .output()
        .expect("run skainet-kv");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.success(), v, stderr)
}

fn check_report(v: &serde_json::Value, exact: bool) {
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 12, "{v}");
    for s in steps {
        assert_eq!(s["token_a"], s["token_b"], "{s}");
        assert!(s["gap"].as_f64().unwrap() >= 0.0, "the reference has logits: {s}");
        let layers = s["layers"].as_array().unwrap();
        assert!(!layers.is_empty());
        for l in layers {
            assert!(l["within"].as_bool().unwrap(), "{l}");
            assert!(l["rows"].as_u64().unwrap() > 0);
            if exact {
                assert_eq!(l["k_abs"].as_f64().unwrap(), 0.0, "{l}");
                assert_eq!(l["v_abs"].as_f64().unwrap(), 0.0, "{l}");
            }
        }
    }
    assert!(v["first_divergent_step"].is_null(), "{v}");
    assert!(v["first_layer_out_of_tolerance"].is_null(), "{v}");
    assert!(v["divergence_at_near_tie"].is_null(), "{v}");
    assert_eq!(v["divergent_steps"], 0, "{v}");
    assert!(v["first_not_near_tie"].is_null(), "{v}");
    // Positions advance one per step after the prompt.
    assert_eq!(steps[0]["position"], 14);
    assert_eq!(steps[11]["position"], 25);
}

#[test]
fn two_identical_backends_never_diverge() {
    let v = diverge("reference,reference");
    check_report(&v, true);
    for s in v["steps"].as_array().unwrap() {
        assert_eq!((&s["below_top"], &s["rank"]), (&0.0.into(), &0.into()), "{s}");
    }
    // Bit-exact: within a bound of 0 too.
    check_report(
        &diverge_with("tiny-gemma3:7", "reference,reference", &["--tolerance", "0"]),
        true,
    );
}

/// The exit status is the verdict (`DivergeReport::failures`): K/V outside the bound fail the
/// command, after the report is printed, in both output forms; a negative bound is refused.
#[cfg(feature = "iree")]
#[test]
fn diverge_fails_where_kv_leave_the_tolerance() {
    let exact = ["--matmul-input", "f32", "--cache-type", "f32", "--tolerance", "1e-9"];
    let (ok, v, stderr) = diverge_status("tiny-gemma3:7", "reference,iree-cpu", &exact);
    assert!(!ok, "IREE's CPU matched the reference bit for bit: {v}");
    assert!(v["first_layer_out_of_tolerance"].is_array(), "{v}");
    assert!(stderr.contains("K/V outside the tolerance"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args([
            "diverge",
            "--model",
            "tiny-gemma3:7",
            "--backends",
            "reference,iree-cpu",
        ])
        .args(["--ids", "1,5,9,13", "--max-new", "2"])
        .args(exact)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("first layer out of tolerance"));
    let (ok, _, stderr) = diverge_status("tiny-gemma3:7", "reference,reference", &["--tolerance=-1"]);
    assert!(!ok && stderr.contains("--tolerance -1"), "{stderr}");
}

#[cfg(feature = "iree")]
#[test]
fn iree_cpu_tracks_the_reference() {
    let v = diverge_with(
        "tiny-gemma3:7",
        "reference,iree-cpu",
        &["--matmul-input", "f32", "--cache-type", "f32"],
    );
    check_report(&v, false);
    assert!(v["backend_b"].as_str().unwrap().contains("iree"), "{v}");
    assert_eq!(v["iree_matmul_input"], "f32", "{v}");
    assert_eq!(v["iree_cache_type"], "f32", "{v}");
}

/// The default export for this CPU: bf16 matmul inputs where it has bf16 dot products (else the
/// same as above), against the reference rounding what the artifacts round, at the tolerance of
/// two forwards that both round (`Tolerance::BF16_MATMUL_INPUTS`).
#[cfg(feature = "iree")]
#[test]
fn iree_cpu_on_its_default_matmul_inputs_tracks_a_reference_that_rounds_the_same() {
    let v = diverge_with(
        "tiny-gemma3:7",
        "reference,iree-cpu",
        &["--reference-input", "artifacts"],
    );
    let rounds = export::host_has_bf16_dot();
    assert_eq!(v["iree_matmul_input"], if rounds { "bf16" } else { "f32" }, "{v}");
    assert_eq!(v["reference_matmul_input"], v["iree_matmul_input"], "{v}");
    let f16 = export::host_converts_f16();
    assert_eq!(v["iree_cache_type"], if f16 { "f16" } else { "f32" }, "{v}");
    assert_eq!(v["reference_cache_type"], v["iree_cache_type"], "{v}");
    let tolerance = if rounds { 4e-2 } else { 2e-3 };
    assert_eq!(v["tolerance_abs"].as_f64().unwrap() as f32, tolerance, "{v}");
    check_report(&v, false);
}

#[test]
fn diverge_wants_two_backends() {
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args([
            "diverge",
            "--model",
            "tiny-gemma3:7",
            "--backends",
            "reference",
            "--ids",
            "1,2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exactly two"));
}

/// Block-quantized weights (`--weights q8|q4`, the fixture re-quantized once, f16 scales): the
/// IREE CPU graphs dequantize inside their matmuls exactly as the reference does on the host, so
/// the tokens agree and the caches stay within the cross-backend tolerance (q8 on Gemma's shape;
/// q4 on the CPU in the test below), against a reference that rounds the K/V rows as the CPU
/// artifacts' caches do (f16 where this CPU converts it). On Vulkan (lavapipe, f32 caches) the
/// export widens the scales to f32 in its archive; the same agreement says it did so exactly.
#[cfg(feature = "iree")]
#[test]
fn iree_cpu_tracks_the_reference_on_quantized_weights() {
    check_report(
        &diverge_with(
            "tiny-gemma3:7",
            "reference,iree-cpu",
            &["--weights", "q8", "--reference-input", "artifacts"],
        ),
        false,
    );
    check_report(
        &diverge_with("tiny-llama:3", "reference,iree-vulkan", &["--weights", "q4"]),
        false,
    );
}

/// `--vulkan-target portable-16bit` (IREE's portable profile with 16-bit storage, i16 weights
/// loaded as they are, no subgroup operations) on lavapipe, which reports 16-bit storage: the
/// reference's tokens and caches within tolerance under both contracts. (On the plain portable
/// profile the same i16 loads are emulated and read the wrong elements: the export refuses it.)
#[cfg(feature = "iree")]
#[test]
fn portable_16bit_i16_weights_track_the_reference_on_lavapipe() {
    for contract in ["1", "2"] {
        check_report(
            &diverge_with(
                "tiny-gemma3:7",
                "reference,iree-vulkan",
                &["--vulkan-target", "portable-16bit", "--contract", contract],
            ),
            false,
        );
    }
}

/// The commands that export on demand give this machine's Vulkan device the fastest portable
/// module it runs: on lavapipe (16-bit storage, subgroup reductions in subgroups of N lanes) the
/// `portable-sgN` module, with the reference's tokens and caches within tolerance; a module of
/// another subgroup size is refused at open, naming both sizes (it would load and compute
/// wrong); `--vulkan-target portable` keeps the packed module.
#[cfg(feature = "iree")]
#[test]
fn the_device_s_own_portable_module_tracks_the_reference_on_lavapipe() {
    let features = backend_iree::VulkanFeatures::of_default_device().expect("lavapipe");
    let target = features
        .portable_target()
        .expect("lavapipe has 16-bit storage and subgroup reductions");
    let modules = |v: &serde_json::Value| -> Vec<String> {
        let dir = std::path::Path::new(v["iree_artifacts"].as_str().expect("the report names its artifacts"));
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).expect("manifest")).expect("json");
        manifest["modules"]
            .as_object()
            .expect("modules")
            .keys()
            .cloned()
            .collect()
    };
    let v = diverge_with("tiny-gemma3:7", "reference,iree-vulkan", &[]);
    check_report(&v, false);
    assert_eq!(modules(&v), vec![format!("vulkan-{target}")]);
    let packed = diverge_with(
        "tiny-gemma3:7",
        "reference,iree-vulkan",
        &["--vulkan-target", "portable"],
    );
    assert_eq!(modules(&packed), vec!["vulkan".to_string()]);
    let other = if features.subgroup_size == 16 { 32 } else { 16 };
    let (ok, _, stderr) = diverge_status(
        "tiny-gemma3:7",
        "reference,iree-vulkan",
        &["--vulkan-target", &format!("portable-sg{other}")],
    );
    assert!(
        !ok,
        "a module of {other}-lane subgroups opened on a device of {}",
        features.subgroup_size
    );
    assert!(
        stderr.contains(&format!("subgroups of {other} lanes"))
            && stderr.contains(&format!("are {}", features.subgroup_size)),
        "{stderr}"
    );
    // One export for both sizes (one text, one archive): a session opens the device's module,
    // whichever the manifest lists first.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args([
            "export",
            "--model",
            "tiny-gemma3:7",
            "--targets",
            "vulkan",
            "--contract",
            "2",
        ])
        .args(["--vulkan-target", &format!("portable-sg{other},{target}")])
        .arg("--out")
        .arg(dir.path())
        .output()
        .expect("run skainet-kv");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let both = diverge_with(
        "tiny-gemma3:7",
        "reference,iree-vulkan",
        &["--artifacts", dir.path().to_str().unwrap()],
    );
    check_report(&both, false);
    let mut listed = modules(&both);
    listed.sort();
    let mut want = vec![format!("vulkan-portable-sg{other}"), format!("vulkan-{target}")];
    want.sort();
    assert_eq!(listed, want);
    // Several targets only of subgroup sizes: one text serves them.
    let out = Command::new(env!("CARGO_BIN_EXE_skainet-kv"))
        .args(["export", "--model", "tiny-gemma3:7", "--targets", "vulkan"])
        .args(["--vulkan-target", &format!("{target},ampere")])
        .arg("--out")
        .arg(dir.path().join("refused"))
        .output()
        .expect("run skainet-kv");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("only of portable-sgN"),
        "{stderr}"
    );
}

/// q4 on Llama's grouped heads under contract 2, on the CPU, against a reference that reads the
/// artifacts' inputs, with `SKAINET_KV_Q4_KERNEL=kernel` (`export::kernels::Q4_KERNEL_ENV`).
#[cfg(feature = "iree")]
fn q4_cpu_report(kernel: &str) -> serde_json::Value {
    let (ok, v, stderr) = diverge_status_env(
        "tiny-llama:3",
        "reference,iree-cpu",
        &["--weights", "q4", "--contract", "2", "--reference-input", "artifacts"],
        &[(export::kernels::Q4_KERNEL_ENV, kernel)],
    );
    assert!(
        ok,
        "q4 on the CPU, {}={kernel}: {stderr}",
        export::kernels::Q4_KERNEL_ENV
    );
    check_report(&v, false);
    v
}

/// Calls of our q4 kernel in the module text the report's IREE side was compiled from.
#[cfg(feature = "iree")]
fn kernel_calls(v: &serde_json::Value) -> usize {
    let dir = std::path::Path::new(v["iree_artifacts"].as_str().expect("the report names its artifacts"));
    let mlir = std::fs::read_to_string(dir.join("llama.mlir")).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    mlir.matches("flow.dispatch @q4_matvec_").count()
}

/// Both q4 paths of a `--cpu host` export against the reference: IREE's own product (forced with
/// `SKAINET_KV_Q4_KERNEL=off`, runs everywhere) and, on a CPU that has one, our kernel
/// (`export::kernels`: AVX-512 or Advanced SIMD), the default there. Each is checked to be the path it claims by the
/// kernel calls in its module, so neither passes having run the other.
#[cfg(feature = "iree")]
#[test]
fn q4_cpu_exports_run_the_kernel_and_the_plain_product() {
    let plain = q4_cpu_report("off");
    assert_eq!(kernel_calls(&plain), 0, "a q4 kernel call with the kernel off: {plain}");
    let default = q4_cpu_report("auto");
    // What `--cpu host` chooses here: AVX-512 on x86-64, Advanced SIMD on every aarch64.
    if export::kernels::KernelIsa::for_export(None, &["host"]).is_some() {
        assert!(
            kernel_calls(&default) > 0,
            "no q4 kernel call in the default q4 CPU export: {default}"
        );
        assert_ne!(
            plain["iree_artifacts"], default["iree_artifacts"],
            "one cache entry for both paths"
        );
    } else {
        println!(
            "SKIP: the q4 kernel path: no kernel for this CPU (x86-64 without AVX-512 F/BW/VL, FMA or F16C: \
             export::kernels::KernelIsa::for_export); the plain q4 product ran"
        );
        assert_eq!(
            kernel_calls(&default),
            0,
            "a q4 kernel call in an export for a CPU without a kernel"
        );
    }
    // A typo is refused, not read as the default (which would test the other path).
    let (ok, _, stderr) = diverge_status_env(
        "tiny-llama:3",
        "reference,iree-cpu",
        &["--weights", "q4", "--contract", "2"],
        &[(export::kernels::Q4_KERNEL_ENV, "of")],
    );
    assert!(!ok && stderr.contains("SKAINET_KV_Q4_KERNEL=\"of\""), "{stderr}");
}
