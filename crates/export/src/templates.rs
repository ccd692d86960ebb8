//! Hand-written MLIR kept as files: `kernels/mlir/*.mlir`, beside the C kernels of
//! [`crate::kernels`] in `kernels/`. Each is a template whose `{{NAME}}` placeholders (upper case,
//! digits, `_`) are filled by name ([`Template::fill`]): the `linalg.generic` bodies of the fused
//! forms of [`crate::mlir::Body`], the argmax's reducer, the q4 kernel's executable and IREE's
//! SPIR-V configuration attribute. The typed builder keeps the SSA names and types; a template
//! holds only the ops' text, so a kernel reads as MLIR, not as Rust format strings.
//!
//! A template and its caller must agree exactly: a placeholder without a value or a value
//! without a placeholder is a bug of this crate, and panics the first time the template is used
//! (every template is used by `tests/golden.rs` and checked by the tests below). A run of three
//! braces around a name (`{{{NAME}}}`) is a literal brace around a placeholder.
//!
//! The emitted text is what the cache keys hash ([`crate::ExportPlan`]), so a template's change
//! moves the keys of the exports that use it, and the golden digests.

use std::fmt::Write as _;

/// One template file: its name (the file stem) and its text as written.
#[derive(Clone, Copy, Debug)]
pub struct Template {
    pub name: &'static str,
    pub text: &'static str,
}

macro_rules! template {
    ($name:literal) => {
        Template {
            name: $name,
            text: include_str!(concat!("../kernels/mlir/", $name, ".mlir")),
        }
    };
}

/// The argmax's two-operand (value, index) reduce: larger value, else lower index.
pub const ARGMAX_REDUCE: Template = template!("argmax_reduce");
/// A contraction body: multiply, accumulate (f32).
pub const F32_PRODUCT: Template = template!("f32_product");
/// One f32 multiplication.
pub const MULF: Template = template!("mulf");
/// bf16 bits held in `i16` widened to f32: sign-extend, shift into the high half, bitcast.
pub const WIDEN_I16: Template = template!("widen_i16");
/// A block-quantized value (`i8`, `i4`) dequantized by its block's scale, multiplied, accumulated.
pub const DEQUANT_PRODUCT: Template = template!("dequant_product");
/// Element `j` of a packed bf16 pair shifted into the high half, multiplied, accumulated.
pub const PAIR_PRODUCT: Template = template!("pair_product");
/// A packed word's two bf16 halves against the even and odd elements of `x` (two inputs), with
/// no loop index in the body.
pub const PAIR_HALVES_PRODUCT: Template = template!("pair_halves_product");
/// Element `j` of a word of packed quantized values (two shifts), dequantized, multiplied,
/// accumulated.
pub const WORD_DEQUANT_PRODUCT: Template = template!("word_dequant_product");
/// A residual stream's pending post-norm addition made inside a product's dispatch.
pub const SETTLE_STREAM: Template = template!("settle_stream");
/// A row maximum's body.
pub const ROW_MAX: Template = template!("row_max");
/// Attention's `exp(score - max)` against a value, with the exponentials' sum.
pub const EXP_PRODUCT: Template = template!("exp_product");
/// IREE's SPIR-V `compilation_info` of a SubgroupReduce dispatch.
pub const SUBGROUP_REDUCE_INFO: Template = template!("subgroup_reduce_info");
/// One architecture's object of the q4 kernel's executable.
pub const Q4_MATVEC_OBJECT: Template = template!("q4_matvec_object");
/// The executable calling the q4 kernel for one weight shape.
pub const Q4_MATVEC_EXECUTABLE: Template = template!("q4_matvec_executable");

/// Every template, for the tests.
#[cfg(test)]
pub const ALL: &[Template] = &[
    ARGMAX_REDUCE,
    F32_PRODUCT,
    MULF,
    WIDEN_I16,
    DEQUANT_PRODUCT,
    PAIR_PRODUCT,
    PAIR_HALVES_PRODUCT,
    WORD_DEQUANT_PRODUCT,
    SETTLE_STREAM,
    ROW_MAX,
    EXP_PRODUCT,
    SUBGROUP_REDUCE_INFO,
    Q4_MATVEC_OBJECT,
    Q4_MATVEC_EXECUTABLE,
];

/// One piece of a template: literal text, or a placeholder's name.
enum Piece<'t> {
    Text(&'t str),
    Hole(&'t str),
}

impl Template {
    /// The text with every placeholder replaced by its value in `values` (`(NAME, value)`), the
    /// file's final newline dropped (the callers join lines themselves). Values are inserted as
    /// they are, never scanned for placeholders.
    pub fn fill(&self, values: &[(&str, &str)]) -> String {
        let mut used = vec![false; values.len()];
        let mut out = String::with_capacity(self.text.len());
        for piece in self.pieces() {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Hole(name) => {
                    let Some(i) = values.iter().position(|(n, _)| *n == name) else {
                        self.misuse(&format!("no value for {{{{{name}}}}}"))
                    };
                    used[i] = true;
                    out.push_str(values[i].1);
                }
            }
        }
        if let Some(i) = used.iter().position(|u| !u) {
            self.misuse(&format!(
                "a value for `{}`, which it has no placeholder for",
                values[i].0
            ));
        }
        out.strip_suffix('\n').map(str::to_string).unwrap_or(out)
    }

    /// The placeholders' names, in order, with repeats.
    #[cfg(test)]
    pub fn placeholders(&self) -> Vec<&'static str> {
        self.pieces()
            .into_iter()
            .filter_map(|p| match p {
                Piece::Hole(name) => Some(name),
                Piece::Text(_) => None,
            })
            .collect()
    }

    fn pieces(&self) -> Vec<Piece<'static>> {
        let mut pieces = Vec::new();
        let mut rest = self.text;
        let mut literal = 0;
        while let Some(i) = rest[literal..].find("{{").map(|i| i + literal) {
            // `{{{NAME}}}`: the first brace is text.
            if rest[i + 2..].starts_with('{') {
                literal = i + 1;
                continue;
            }
            let after = &rest[i + 2..];
            let Some(end) = after.find("}}") else {
                self.misuse("an unclosed `{{`")
            };
            let name = &after[..end];
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            {
                self.misuse(&format!("a malformed placeholder `{{{{{name}}}}}`"));
            }
            pieces.push(Piece::Text(&rest[..i]));
            pieces.push(Piece::Hole(name));
            rest = &after[end + 2..];
            literal = 0;
        }
        pieces.push(Piece::Text(rest));
        pieces
    }

    #[cold]
    #[track_caller]
    fn misuse(&self, what: &str) -> ! {
        let mut message = String::new();
        let _ = write!(message, "template kernels/mlir/{}.mlir: {what}", self.name);
        kv_core::error::invariant(&message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(text: &'static str) -> Template {
        Template { name: "test", text }
    }

    #[test]
    fn placeholders_are_filled_by_name() {
        let t = template("{{A}} = arith.mulf {{B}}, {{A}} : f32\n");
        assert_eq!(t.fill(&[("A", "%v1"), ("B", "%v2")]), "%v1 = arith.mulf %v2, %v1 : f32");
        assert_eq!(t.placeholders(), ["A", "B", "A"]);
    }

    #[test]
    fn a_triple_brace_is_a_literal_brace_around_a_placeholder() {
        let t = template("<{{{OBJECTS}}}> {x}");
        assert_eq!(t.fill(&[("OBJECTS", "a = {b}")]), "<{a = {b}}> {x}");
    }

    #[test]
    fn values_are_not_scanned_for_placeholders() {
        assert_eq!(template("{{A}}").fill(&[("A", "{{B}}")]), "{{B}}");
    }

    #[test]
    #[should_panic(expected = "no value for {{B}}")]
    fn a_placeholder_without_a_value_panics() {
        template("{{A}} {{B}}").fill(&[("A", "x")]);
    }

    #[test]
    #[should_panic(expected = "a value for `C`, which it has no placeholder for")]
    fn a_value_without_a_placeholder_panics() {
        template("{{A}}").fill(&[("A", "x"), ("C", "y")]);
    }

    #[test]
    #[should_panic(expected = "a malformed placeholder `{{lower}}`")]
    fn a_malformed_placeholder_panics() {
        template("{{lower}}").fill(&[]);
    }

    /// Every file in `kernels/mlir/` is listed in [`ALL`] (one left out would be dead, or used
    /// through a path these tests do not see), and every listed one parses.
    #[test]
    fn every_template_file_is_listed_and_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/mlir");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "mlir"))
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        files.sort();
        let mut listed: Vec<String> = ALL.iter().map(|t| t.name.to_string()).collect();
        listed.sort();
        assert_eq!(files, listed);
        for t in ALL {
            let names = t.placeholders();
            let values: Vec<(&str, &str)> = names.iter().map(|n| (*n, "v")).collect();
            let mut unique = values.clone();
            unique.sort();
            unique.dedup();
            assert!(!t.fill(&unique).contains("{{"), "{}", t.name);
        }
    }
}
