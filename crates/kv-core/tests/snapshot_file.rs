//! The snapshot file format against a fake backend whose rows are a function of the tokens: what
//! is saved comes back bit for bit, continues like the original, and every kind of bad file is
//! refused without touching the session. The real backends run the same round trip in the
//! conformance suite.

use std::path::Path;

use kv_core::manifest::CacheType;
use kv_core::snapshot_file::{self, LayerRows, ModelFingerprint, PersistSnapshot};
use kv_core::{Error, KvBackend, KvSpec, LayerKv, Result, SessionId, WindowRule};

/// Rows derived from (token, position, layer, model seed); sliding layers keep `window` rows.
#[derive(Clone)]
struct Fake {
    spec: KvSpec,
    seed: u32,
    rule: WindowRule,
    /// Sliding layers keep every row, as the real backends do after a prefill.
    keep_all: bool,
    /// What its caches hold: every row value is rounded to it.
    cache: CacheType,
    id: SessionId,
    position: usize,
    layers: Vec<LayerKv>,
    last: i32,
}

#[derive(Clone, Debug)]
struct FakeSnapshot {
    session: SessionId,
    position: usize,
    layers: Vec<LayerKv>,
    last: i32,
}

fn spec() -> KvSpec {
    KvSpec {
        n_layers: 4,
        head_dim: 8,
        n_heads: 2,
        n_kv_heads: 2,
        hidden_size: 16,
        vocab_size: 50,
        sliding_window: 6,
        global_layer_period: 2,
        chunk: 4,
        seq: 8,
        max_positions: 40,
        ..KvSpec::default()
    }
}

impl Fake {
    fn new(seed: u32) -> Self {
        let spec = spec();
        let layers = (0..spec.n_layers).map(|_| empty(&spec, 0)).collect();
        Fake {
            spec,
            seed,
            rule: WindowRule::Exact,
            keep_all: false,
            cache: CacheType::F32,
            id: SessionId::fresh(),
            position: 0,
            layers,
            last: 0,
        }
    }

    fn value(&self, token: i32, p: usize, l: usize, h: usize, i: usize, which: u32) -> f32 {
        let x = (token as u32)
            .wrapping_mul(2654435761)
            .wrapping_add(p as u32 * 40503 + l as u32 * 977 + h as u32 * 131 + i as u32 * 7 + which * 3 + self.seed);
        self.cache.round((x % 1000) as f32 / 1000.0 - 0.5)
    }

    /// Appends one token's rows to every layer (sliding layers drop what left the window) and
    /// "predicts" the next token from everything held.
    fn feed(&mut self, token: i32) -> i32 {
        let spec = self.spec.clone();
        for l in 0..spec.n_layers {
            let old = &self.layers[l];
            let keep = match spec.window(spec.layer_kind(l)) {
                Some(w) if !self.keep_all => (old.rows + 1).min(w),
                _ => old.rows + 1,
            };
            let drop = old.rows + 1 - keep;
            let mut new = empty(&spec, self.position + 1 - keep);
            new.rows = keep;
            for h in 0..spec.n_kv_heads {
                for r in 0..keep {
                    let p = new.first_position + r;
                    for i in 0..spec.head_dim {
                        let (k, v) = if r + drop < old.rows {
                            (old.k_at(h, p).unwrap()[i], old.v_at(h, p).unwrap()[i])
                        } else {
                            (self.value(token, p, l, h, i, 0), self.value(token, p, l, h, i, 1))
                        };
                        new.k.push(k);
                        new.v.push(v);
                    }
                }
            }
            self.layers[l] = new;
        }
        self.position += 1;
        let sum: f32 = self.layers.iter().flat_map(|l| l.k.iter()).sum();
        self.last = (sum.abs() * 1000.0) as i32 % spec.vocab_size as i32;
        self.last
    }
}

fn empty(spec: &KvSpec, first: usize) -> LayerKv {
    LayerKv {
        first_position: first,
        rows: 0,
        n_kv_heads: spec.n_kv_heads,
        head_dim: spec.head_dim,
        k: vec![],
        v: vec![],
    }
}

impl KvBackend for Fake {
    type Snapshot = FakeSnapshot;
    fn spec(&self) -> &KvSpec {
        &self.spec
    }
    fn prefill(&mut self, tokens: &[i32]) -> Result<i32> {
        self.spec.check_tokens("prefill", tokens)?;
        self.layers = (0..self.spec.n_layers).map(|_| empty(&self.spec, 0)).collect();
        self.position = 0;
        Ok(tokens.iter().map(|&t| self.feed(t)).last().unwrap_or(0))
    }
    fn chunk(&mut self, tokens: &[i32]) -> Result<i32> {
        self.spec.check_tokens("chunk", tokens)?;
        Ok(tokens.iter().map(|&t| self.feed(t)).last().unwrap_or(0))
    }
    fn step(&mut self, token: i32) -> Result<i32> {
        self.chunk(&[token])
    }
    fn snapshot(&self) -> Result<FakeSnapshot> {
        Ok(FakeSnapshot {
            session: self.id,
            position: self.position,
            layers: self.layers.clone(),
            last: self.last,
        })
    }
    fn restore(&mut self, s: &FakeSnapshot) -> Result<()> {
        self.id.check_owner(s.session)?;
        self.position = s.position;
        self.layers = s.layers.clone();
        self.last = s.last;
        Ok(())
    }
    fn snapshot_position(&self, s: &FakeSnapshot) -> usize {
        s.position
    }
    fn position(&self) -> usize {
        self.position
    }
    fn read_layer(&self, layer: usize) -> Result<LayerKv> {
        Ok(self.layers[layer].clone())
    }
    fn name(&self) -> String {
        "fake".into()
    }
}

impl PersistSnapshot for Fake {
    fn model_fingerprint(&self) -> Result<ModelFingerprint> {
        let hidden = self.spec.hidden_size;
        ModelFingerprint::compute(&self.spec, |ids| {
            Ok(ids
                .iter()
                .flat_map(|&id| (0..hidden).map(move |i| (id as f32 + i as f32 * 0.5) * (self.seed + 1) as f32))
                .collect())
        })
    }
    fn window_rule(&self) -> WindowRule {
        self.rule
    }
    fn snapshot_layer(&self, s: &FakeSnapshot, layer: usize) -> Result<LayerKv> {
        Ok(s.layers[layer].clone())
    }
    fn cache_type(&self) -> CacheType {
        self.cache
    }
    fn snapshot_from_layers<'a>(
        &self,
        position: usize,
        layers: &mut dyn Iterator<Item = LayerRows<'a>>,
    ) -> Result<FakeSnapshot> {
        Ok(FakeSnapshot {
            session: self.id,
            position,
            layers: layers
                .map(|l| LayerKv {
                    first_position: l.first_position,
                    rows: l.rows,
                    n_kv_heads: self.spec.n_kv_heads,
                    head_dim: self.spec.head_dim,
                    k: self.cache.decode(&l.k.to_bytes_of(self.cache)),
                    v: self.cache.decode(&l.v.to_bytes_of(self.cache)),
                })
                .collect(),
            last: 0,
        })
    }
}

fn prefixed(seed: u32, prefix: &[i32]) -> (Fake, FakeSnapshot) {
    let mut fake = Fake::new(seed);
    fake.prefill(prefix).unwrap();
    let snap = fake.snapshot().unwrap();
    (fake, snap)
}

const PREFIX: [i32; 11] = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5];

fn saved(dir: &Path) -> std::path::PathBuf {
    let (fake, snap) = prefixed(0, &PREFIX);
    let path = dir.join("prefix.skvsnap");
    snapshot_file::save(&fake, &snap, &path).unwrap();
    path
}

#[test]
fn a_loaded_snapshot_continues_like_the_original_in_a_fresh_session() {
    let dir = tempfile::tempdir().unwrap();
    let (mut original, snap) = prefixed(0, &PREFIX);
    let path = dir.path().join("prefix.skvsnap");
    let bytes = snapshot_file::save(&original, &snap, &path).unwrap();
    assert_eq!(bytes, std::fs::metadata(&path).unwrap().len());

    let mut fresh = Fake::new(0);
    let loaded = snapshot_file::load(&fresh, &path).unwrap();
    assert_eq!(fresh.position(), 0, "loading must not restore");
    assert_eq!(loaded.position, PREFIX.len());
    assert_eq!(loaded.layers, snap.layers, "rows come back bit for bit");

    fresh.restore(&loaded).unwrap();
    let a: Vec<i32> = [7, 8, 9, 10, 11].iter().map(|&t| original.step(t).unwrap()).collect();
    let b: Vec<i32> = [7, 8, 9, 10, 11].iter().map(|&t| fresh.step(t).unwrap()).collect();
    assert_eq!(a, b);
    // The loaded snapshot branches like any other.
    fresh.restore(&loaded).unwrap();
    assert_eq!(fresh.step(7).unwrap(), a[0]);
    // No temporary file is left beside it.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn an_empty_session_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(0);
    let snap = fake.snapshot().unwrap();
    let path = dir.path().join("empty.skvsnap");
    snapshot_file::save(&fake, &snap, &path).unwrap();
    let loaded = snapshot_file::load(&Fake::new(0), &path).unwrap();
    assert_eq!(loaded.position, 0);
}

/// Loads `bytes` as a snapshot file into a session at some position; checks the error and that
/// the session did not move.
fn refused(bytes: &[u8], into: &mut Fake, expect: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.skvsnap");
    std::fs::write(&path, bytes).unwrap();
    into.prefill(&[1, 2, 3]).unwrap();
    let before = into.snapshot().unwrap();
    let err = snapshot_file::load(&*into, &path).unwrap_err();
    assert!(matches!(err, Error::SnapshotFile { .. }), "{err}");
    assert!(err.to_string().contains(expect), "`{err}` should say `{expect}`");
    assert_eq!(into.position(), 3);
    assert_eq!(into.snapshot().unwrap().layers, before.layers);
}

#[test]
fn bad_files_are_refused_and_the_session_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(saved(dir.path())).unwrap();
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;

    refused(b"hello", &mut Fake::new(0), "bad magic");
    refused(&good[..good.len() - 1], &mut Fake::new(0), "truncated");
    refused(&good[..100], &mut Fake::new(0), "truncated");
    refused(&[&good[..], &[0]].concat(), &mut Fake::new(0), "trailing bytes");

    let mut corrupt = good.clone();
    let last = corrupt.len() - 3;
    corrupt[last] ^= 0x40;
    refused(&corrupt, &mut Fake::new(0), "CRC-32");

    let mut version = good.clone();
    version[8] = 9;
    refused(&version, &mut Fake::new(0), "format version 9");

    let mut header = good.clone();
    header[16 + header_len / 2] = b'\x01';
    refused(&header, &mut Fake::new(0), "corrupt header");

    // Another model: same geometry, other weights.
    refused(&good, &mut Fake::new(1), "another model");

    // Another window rule.
    let mut seed_rule = Fake::new(0);
    seed_rule.rule = WindowRule::SeedStep;
    refused(&good, &mut seed_rule, "window rule");

    // A position this session cannot hold.
    let mut small = Fake::new(0);
    small.spec.max_positions = 10;
    refused(&good, &mut small, "maxPositions");
}

#[test]
fn headers_that_lie_about_the_rows_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(saved(dir.path())).unwrap();
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&good[16..16 + header_len]).unwrap();

    // Rewrites the header (keeping its length, so the data stays where it was).
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut h = header.clone();
        edit(&mut h);
        let mut text = serde_json::to_vec(&h).unwrap();
        assert!(text.len() <= header_len, "edited header grew");
        text.resize(header_len, b' ');
        let mut bytes = good.clone();
        bytes[16..16 + header_len].copy_from_slice(&text);
        bytes
    };
    refused(
        &with(&|h| h["position"] = 12.into()),
        &mut Fake::new(0),
        "not ending at the snapshot's position",
    );
    refused(
        &with(&|h| h["layers"][1]["rows"] = 2.into()),
        &mut Fake::new(0),
        "layer 1",
    );
    refused(
        &with(&|h| {
            h["layers"].as_array_mut().unwrap().pop();
        }),
        &mut Fake::new(0),
        "3 layers, the model has 4",
    );
    refused(
        &with(&|h| h["contractVersion"] = 7.into()),
        &mut Fake::new(0),
        "contract version 7",
    );
    refused(&with(&|h| h["dtype"] = "f64".into()), &mut Fake::new(0), "dtype `f64`");
    // An f32 file that claims f16: its blocks are twice what the layers need.
    refused(
        &with(&|h| h["dtype"] = "f16".into()),
        &mut Fake::new(0),
        "data bytes declared",
    );
    refused(
        &with(&|h| h["dataBytes"] = 64.into()),
        &mut Fake::new(0),
        "data bytes declared",
    );
}

#[test]
fn a_failed_write_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, snap) = prefixed(0, &PREFIX);
    let err = snapshot_file::save(&fake, &snap, &dir.path().join("missing/dir/x.skvsnap")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    // An existing file is replaced whole.
    let path = saved(dir.path());
    let (other, snap) = prefixed(0, &PREFIX[..5]);
    snapshot_file::save(&other, &snap, &path).unwrap();
    assert_eq!(snapshot_file::load(&Fake::new(0), &path).unwrap().position, 5);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn the_fingerprint_ignores_graph_shapes_but_not_geometry_or_weights() {
    let a = Fake::new(0);
    let mut b = Fake::new(0);
    b.spec.chunk = 8;
    b.spec.seq = 16;
    b.spec.max_positions = 80;
    assert_eq!(a.model_fingerprint().unwrap(), b.model_fingerprint().unwrap());
    b.spec.sliding_window = 5;
    assert_ne!(a.model_fingerprint().unwrap(), b.model_fingerprint().unwrap());
    assert_ne!(
        a.model_fingerprint().unwrap(),
        Fake::new(3).model_fingerprint().unwrap()
    );
}

#[test]
fn only_the_window_of_a_sliding_layer_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut original = Fake::new(0);
    original.keep_all = true;
    original.prefill(&PREFIX).unwrap();
    let snap = original.snapshot().unwrap();
    let spec = spec();
    assert_eq!(
        snap.layers[0].rows,
        PREFIX.len(),
        "layer 0 is sliding and holds every row"
    );
    let path = dir.path().join("p.skvsnap");
    snapshot_file::save(&original, &snap, &path).unwrap();
    let mut fresh = Fake::new(0);
    let loaded = snapshot_file::load(&fresh, &path).unwrap();
    for (l, layer) in loaded.layers.iter().enumerate() {
        let want = match spec.window(spec.layer_kind(l)) {
            Some(w) => w,
            None => PREFIX.len(),
        };
        assert_eq!(layer.rows, want, "layer {l}");
        assert_eq!(*layer, snap.layers[l].tail_from(PREFIX.len() - want), "layer {l}");
    }
    fresh.restore(&loaded).unwrap();
    // Both now keep windows only, so their next rows agree.
    original.keep_all = false;
    for t in [7, 8, 9] {
        assert_eq!(fresh.step(t).unwrap(), original.step(t).unwrap());
    }
}

/// A session whose caches hold f16 writes f16 blocks (its rows exactly, in half the data bytes
/// of an f32 file), a fresh f16 session gets them back bit for bit and continues alike; the same
/// file loads into an f32 session (widened exactly), and an f32 file loads into an f16 session
/// rounded as its caches round.
#[test]
fn f16_sessions_write_f16_and_either_type_loads() {
    let dir = tempfile::tempdir().unwrap();
    let half = |seed| Fake {
        cache: CacheType::F16,
        ..Fake::new(seed)
    };
    let mut original = half(0);
    original.prefill(&PREFIX).unwrap();
    let snap = original.snapshot().unwrap();
    let path = dir.path().join("f16.skvsnap");
    let f16_bytes = snapshot_file::save(&original, &snap, &path).unwrap();
    assert_eq!(snapshot_file::read_header(&path).unwrap().dtype, "f16");
    let f32_path = saved(dir.path());
    let f32_header = snapshot_file::read_header(&f32_path).unwrap();
    assert_eq!(f32_header.dtype, "f32");
    let f16_header = snapshot_file::read_header(&path).unwrap();
    // Half the bytes, up to each block's padding to 64 bytes.
    let (f16_data, f32_data) = (f16_header.data_bytes, f32_header.data_bytes);
    assert!(
        f16_data < f32_data && 2 * f16_data >= f32_data,
        "{f16_data} vs {f32_data}"
    );
    assert!(f16_bytes < std::fs::metadata(&f32_path).unwrap().len());

    let mut fresh = half(0);
    let loaded = snapshot_file::load(&fresh, &path).unwrap();
    assert_eq!(loaded.layers, snap.layers, "f16 rows come back bit for bit");
    fresh.restore(&loaded).unwrap();
    let a: Vec<i32> = [7, 8, 9].iter().map(|&t| original.step(t).unwrap()).collect();
    let b: Vec<i32> = [7, 8, 9].iter().map(|&t| fresh.step(t).unwrap()).collect();
    assert_eq!(a, b);

    let wide = snapshot_file::load(&Fake::new(0), &path).unwrap();
    assert_eq!(wide.layers, snap.layers, "f16 widens to f32 exactly");

    let (_, f32_snap) = prefixed(0, &PREFIX);
    let narrow = snapshot_file::load(&half(0), &f32_path).unwrap();
    for (got, want) in narrow.layers.iter().zip(&f32_snap.layers) {
        let rounded: Vec<f32> = want.k.iter().map(|&x| CacheType::F16.round(x)).collect();
        assert_eq!(got.k, rounded);
        assert_ne!(got.k, want.k, "the rows were rounded");
    }
}

/// `good` rebuilt with its header edited and its data edited, the CRC recomputed: an intact file
/// (length and CRC right) saying whatever the edits say.
fn rebuilt(good: &[u8], edit_header: &dyn Fn(&mut serde_json::Value), edit_data: &dyn Fn(&mut [u8])) -> Vec<u8> {
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&good[16..16 + header_len]).unwrap();
    let mut data = good[(16 + header_len).div_ceil(64) * 64..].to_vec();
    edit_data(&mut data);
    header["dataCrc32"] = crc32fast::hash(&data).into();
    edit_header(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    let mut bytes = good[..12].to_vec();
    bytes.extend((json.len() as u32).to_le_bytes());
    bytes.extend(&json);
    bytes.resize((16 + json.len()).div_ceil(64) * 64, 0);
    bytes.extend(data);
    bytes
}

/// Byte offset in the data of element (head, row, i) of layer `l`'s K or V block (f32).
fn element_offset(
    header: &snapshot_file::SnapshotHeader,
    l: usize,
    v: bool,
    head: usize,
    row: usize,
    i: usize,
) -> usize {
    let spec = &header.spec;
    let block = |rows: usize| (spec.n_kv_heads * rows * spec.head_dim * 4).div_ceil(64) * 64;
    let start: usize = header.layers[..l].iter().map(|h| 2 * block(h.rows)).sum();
    let rows = header.layers[l].rows;
    start + if v { block(rows) } else { 0 } + ((head * rows + row) * spec.head_dim + i) * 4
}

/// A file whose CRC matches but whose rows hold NaN or infinity is refused on load, naming the
/// layer, K or V, the position and the head; `verify` says the same. Before, it loaded and the
/// reference decoded token 0 forever.
#[test]
fn non_finite_rows_are_refused_with_their_layer_and_position() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path());
    let good = std::fs::read(&path).unwrap();
    let header = snapshot_file::read_header(&path).unwrap();
    for (value, l, v, head, row) in [
        (f32::NAN, 1, true, 1, 3),
        (f32::INFINITY, 0, false, 0, 0),
        (f32::NEG_INFINITY, 3, true, 1, 10),
    ] {
        let at = element_offset(&header, l, v, head, row, 5);
        let bytes = rebuilt(&good, &|_| {}, &|data| {
            data[at..at + 4].copy_from_slice(&value.to_le_bytes())
        });
        let bad = dir.path().join("nan.skvsnap");
        std::fs::write(&bad, &bytes).unwrap();
        let position = header.layers[l].first_position + row;
        let tensor = if v { "V" } else { "K" };
        for err in [
            snapshot_file::load(&Fake::new(0), &bad).unwrap_err(),
            snapshot_file::verify(&bad).unwrap_err(),
        ] {
            assert!(
                matches!(
                    err,
                    Error::NonFiniteSnapshot { layer, tensor: t, position: p, head: h, .. }
                        if layer == l && t == tensor && p == position && h == head
                ),
                "{value} at layer {l} {tensor} position {position} head {head}: {err}"
            );
            assert!(
                err.to_string()
                    .contains(&format!("layer {l} {tensor} at position {position}")),
                "{err}"
            );
        }
    }
    // The same rebuild without the edit loads: the test's file surgery is sound.
    let same = dir.path().join("same.skvsnap");
    std::fs::write(&same, rebuilt(&good, &|_| {}, &|_| {})).unwrap();
    snapshot_file::load(&Fake::new(0), &same).unwrap();
    snapshot_file::verify(&same).unwrap();
}

/// f16 files are checked too (an exponent of all ones is NaN or infinity there as well).
#[test]
fn non_finite_f16_rows_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut original = Fake {
        cache: CacheType::F16,
        ..Fake::new(0)
    };
    original.prefill(&PREFIX).unwrap();
    let snap = original.snapshot().unwrap();
    let path = dir.path().join("f16.skvsnap");
    snapshot_file::save(&original, &snap, &path).unwrap();
    let good = std::fs::read(&path).unwrap();
    // Layer 0's K, head 0, the first row's third value: f16 +infinity.
    let bytes = rebuilt(&good, &|_| {}, &|data| {
        data[4..6].copy_from_slice(&0x7c00u16.to_le_bytes())
    });
    std::fs::write(&path, bytes).unwrap();
    let err = snapshot_file::verify(&path).unwrap_err();
    assert!(
        matches!(err, Error::NonFiniteSnapshot { layer: 0, tensor: "K", head: 0, value, .. } if value == f32::INFINITY),
        "{err}"
    );
}

/// `verify` (what `snapshot info` runs) checks the whole file, as `load` does: a truncated file
/// or a broken CRC is an error, not a header printed as if all were well.
#[test]
fn verify_checks_the_length_and_the_crc() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path());
    let good = std::fs::read(&path).unwrap();
    let header = snapshot_file::verify(&path).unwrap();
    assert_eq!(header.position, PREFIX.len());
    let check = |bytes: &[u8], expect: &str| {
        let bad = dir.path().join("bad.skvsnap");
        std::fs::write(&bad, bytes).unwrap();
        // The header alone still reads: that is all `read_header` promises.
        let err = snapshot_file::verify(&bad).unwrap_err();
        assert!(matches!(err, Error::SnapshotFile { .. }), "{err}");
        assert!(err.to_string().contains(expect), "`{err}` should say `{expect}`");
    };
    check(&good[..good.len() - 100], "truncated");
    let mut corrupt = good.clone();
    let last = corrupt.len() - 3;
    corrupt[last] ^= 0x40;
    check(&corrupt, "CRC-32");
    // A header whose geometry is beyond the limits (the CRC is right).
    check(
        &rebuilt(&good, &|h| h["spec"]["vocabSize"] = 4_000_000_000u64.into(), &|_| {}),
        "vocabSize",
    );
}

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo").arg(path).status().unwrap();
    assert!(status.success());
}

/// Runs `f` on another thread and fails the test if it does not return within 10 s (opening a
/// FIFO for reading blocks until a writer comes: the bug this guards against is a hang).
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || send.send(f()));
    receive
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("blocked on a special file")
}

/// A FIFO, a device or a directory is neither read as a snapshot (a FIFO blocked the reader
/// for good) nor replaced by one (a save renamed its file over `/dev/null`-like nodes).
#[test]
fn special_files_are_refused_as_inputs_and_targets() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let kind = |err: &Error| match err {
        Error::NotRegularFile { kind, .. } => *kind,
        other => panic!("not NotRegularFile: {other}"),
    };
    for path in [fifo.clone(), "/dev/null".into(), dir.path().to_path_buf()] {
        let p = path.clone();
        let (load, verify, header) = within_10s(move || {
            (
                snapshot_file::load(&Fake::new(0), &p).map(|_| ()).unwrap_err(),
                snapshot_file::verify(&p).unwrap_err(),
                snapshot_file::read_header(&p).unwrap_err(),
            )
        });
        let want = if path == fifo {
            "FIFO"
        } else if path.is_dir() {
            "directory"
        } else {
            "character device"
        };
        for err in [load, verify, header] {
            assert_eq!(kind(&err), want, "{}: {err}", path.display());
        }
    }

    // Saving onto a FIFO only: were the check to regress, a test saving onto `/dev/null` would
    // replace it on a machine whose tests run as root. A device is checked without saving.
    let (fake, snap) = prefixed(0, &PREFIX);
    let err = snapshot_file::save(&fake, &snap, &fifo).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotRegularFile {
                what: "snapshot target",
                kind: "FIFO",
                ..
            }
        ),
        "{err}"
    );
    assert!(!fifo.is_file(), "the FIFO was replaced by a regular file");
    let err = snapshot_file::check_target(Path::new("/dev/null")).unwrap_err();
    assert_eq!(kind(&err), "character device");
    let err = snapshot_file::check_target(dir.path()).unwrap_err();
    assert_eq!(kind(&err), "directory");
    // Nothing but the FIFO is left in the directory: no temporary file.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    // A regular file is replaced, as before.
    let file = dir.path().join("x.skvsnap");
    std::fs::write(&file, b"old").unwrap();
    snapshot_file::save(&fake, &snap, &file).unwrap();
    snapshot_file::verify(&file).unwrap();
}

/// The fingerprint samples embedding rows spread evenly from the first id to the last (the doc's
/// promise): rows a model shares with another only at the ends, or in between, still tell the two
/// apart. Sampling up to `vocab + 1` in 258 steps (a cargo-mutants survivor) missed the last
/// row and changed every file's fingerprint.
#[test]
fn the_fingerprint_samples_rows_from_the_first_id_to_the_last() {
    for vocab in [50usize, 257, 1000, 262_144] {
        let spec = KvSpec {
            vocab_size: vocab,
            ..spec()
        };
        let mut seen = Vec::new();
        ModelFingerprint::compute(&spec, |ids| {
            seen = ids.to_vec();
            Ok(vec![0.0; ids.len() * spec.hidden_size])
        })
        .unwrap();
        let want: Vec<i32> = if vocab <= 257 {
            (0..vocab as i32).collect()
        } else {
            (0..257).map(|i| (i * (vocab - 1) / 256) as i32).collect()
        };
        assert_eq!(seen, want, "vocab {vocab}");
        assert_eq!(*seen.last().unwrap(), vocab as i32 - 1);
    }
}

/// A boxed session writes its files in its own cache type, not the default f32.
#[test]
fn a_boxed_session_keeps_its_cache_type() {
    let fake = Fake {
        cache: CacheType::F16,
        ..Fake::new(1)
    };
    let boxed = Box::new(fake);
    assert_eq!(PersistSnapshot::cache_type(&boxed), CacheType::F16);
}
