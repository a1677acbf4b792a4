//! `torch.save` shards read through libtorch (the `torch` feature).
//!
//! The files are made at test time by `tests/fixtures/make_torch_fixtures.py` (standard
//! library only: `import torch` does not work where this builds), which writes the exact
//! zip + pickle layout of Python's `torch.save` and an `expected.json` with, per file, the
//! tensors a reader must return (bytes as hex) or the words its error must contain. Run
//! with `eval "$(scripts/torch-env)"; cargo nextest run --features torch --test torch`.
#![cfg(feature = "torch")]

use rl_node::shards::torch::{available, read_torch_dict};
use rl_node::shards::{DType, ShardError, TensorData};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Fixtures {
    dir: tempfile::TempDir,
    expected: Value,
}

impl Fixtures {
    fn make() -> Fixtures {
        let dir = tempfile::tempdir().unwrap();
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/make_torch_fixtures.py");
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
        let out = Command::new(&python)
            .arg(&script)
            .arg(dir.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {python} {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let expected = std::fs::read_to_string(dir.path().join("expected.json")).unwrap();
        Fixtures {
            expected: serde_json::from_str(&expected).unwrap(),
            dir,
        }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// Read `file` and check every tensor against expected.json, byte for byte.
    fn read_and_check(&self, file: &str) -> Vec<TensorData> {
        let tensors =
            read_torch_dict(&self.path(file)).unwrap_or_else(|e| panic!("{file} should load: {e}"));
        let want = self.expected[file]["tensors"]
            .as_array()
            .unwrap_or_else(|| panic!("expected.json has no tensors for {file}"));
        let got_names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let want_names: Vec<&str> = want.iter().map(|t| t["name"].as_str().unwrap()).collect();
        assert_eq!(got_names, want_names, "{file}: keys (sorted by name)");
        for (got, want) in tensors.iter().zip(want) {
            let ctx = format!("{file}: {}", got.name);
            assert_eq!(got.dtype.safetensors_name(), want["dtype"], "{ctx}: dtype");
            let shape: Vec<usize> = want["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(got.shape, shape, "{ctx}: shape");
            assert_eq!(
                hex::encode(&got.data),
                want["data_hex"].as_str().unwrap(),
                "{ctx}: bytes"
            );
            assert_eq!(
                got.data.len(),
                shape.iter().product::<usize>() * got.dtype.size(),
                "{ctx}"
            );
        }
        tensors
    }

    /// Read `file`, which must be refused as Unreadable naming it and the expected words.
    fn read_and_refuse(&self, file: &str) -> String {
        let path = self.path(file);
        match read_torch_dict(&path) {
            Ok(tensors) => panic!(
                "{file} should be refused, got {:?}",
                tensors.iter().map(|t| &t.name).collect::<Vec<_>>()
            ),
            Err(ShardError::Unreadable { path: p, reason }) => {
                assert_eq!(p, path);
                let message = ShardError::Unreadable { path: p, reason }.to_string();
                eprintln!("{message}");
                for word in self.expected[file]["contains"].as_array().unwrap() {
                    let word = word.as_str().unwrap();
                    assert!(message.contains(word), "{file}: {message:?} lacks {word:?}");
                }
                assert!(
                    !message.contains("frame #"),
                    "{file}: the C++ backtrace should be cut: {message}"
                );
                message
            }
            Err(other) => panic!("{file}: expected Unreadable, got {other:?}"),
        }
    }
}

fn tensor<'a>(tensors: &'a [TensorData], name: &str) -> &'a TensorData {
    tensors.iter().find(|t| t.name == name).unwrap()
}

fn f32s(t: &TensorData) -> Vec<f32> {
    assert_eq!(t.dtype, DType::F32);
    t.data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn every_dtype_round_trips_exactly() {
    let fx = Fixtures::make();
    let tensors = fx.read_and_check("mixed.pt");
    let dtypes: Vec<DType> = tensors.iter().map(|t| t.dtype).collect();
    for dtype in [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
    ] {
        assert!(dtypes.contains(&dtype), "mixed.pt covers {dtype:?}");
    }
    // A few values decoded by hand, independently of the hex comparison.
    let tokens = tensor(&tensors, "tokens");
    assert_eq!(tokens.shape, vec![2, 4]);
    assert_eq!(&tokens.data[16..24], &(-1i64).to_le_bytes());
    assert_eq!(tensor(&tensors, "mask").data, vec![1, 0, 1, 1, 0, 0, 1, 0]);
    assert_eq!(
        tensor(&tensors, "values_bf16").data[..4],
        [0x80, 0x3f, 0x20, 0xc0]
    ); // 1.0, -2.5
    let scalar = tensor(&tensors, "scalar");
    assert_eq!((scalar.shape.clone(), f32s(scalar)), (vec![], vec![2.5]));
    let empty = tensor(&tensors, "empty");
    assert_eq!((empty.shape.clone(), empty.data.len()), (vec![0, 3], 0));
}

#[test]
fn strided_views_are_copied_out_row_major() {
    let fx = Fixtures::make();
    let tensors = fx.read_and_check("mixed.pt");
    let base = f32s(tensor(&tensors, "logprobs"));
    let transposed = tensor(&tensors, "transposed");
    assert_eq!(transposed.shape, vec![3, 2]);
    let want: Vec<f32> = (0..3).flat_map(|i| [base[i], base[3 + i]]).collect();
    assert_eq!(
        f32s(transposed)
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    // The column view starts at storage offset 1 with stride 3.
    let column = f32s(tensor(&tensors, "column"));
    assert_eq!(
        column.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        vec![base[1].to_bits(), base[4].to_bits()]
    );
}

#[test]
fn ranks_with_mismatched_trailing_shapes_are_read_as_they_are() {
    // Refusing to concatenate them is the aggregation's job; the reader reports the shapes.
    let fx = Fixtures::make();
    let r0 = fx.read_and_check("rank-0.pt");
    let r1 = fx.read_and_check("rank-1.pt");
    assert_eq!(tensor(&r0, "tokens").shape, vec![2, 3]);
    assert_eq!(tensor(&r1, "tokens").shape, vec![1, 4]);
}

#[test]
fn tensors_saved_on_a_gpu_load_onto_the_cpu() {
    let fx = Fixtures::make();
    let tensors = fx.read_and_check("cuda.pt");
    assert_eq!(f32s(tensor(&tensors, "logprobs")), vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn a_dict_holding_a_non_tensor_is_refused() {
    let message = Fixtures::make().read_and_refuse("non_tensor.pt");
    assert!(message.contains("dict of tensors"), "{message}");
}

#[test]
fn a_list_of_tensors_is_refused() {
    let message = Fixtures::make().read_and_refuse("not_a_dict.pt");
    assert!(message.contains("dict of tensors"), "{message}");
}

#[test]
fn a_dict_with_keys_other_than_strings_is_refused() {
    let message = Fixtures::make().read_and_refuse("int_keys.pt");
    assert!(message.contains("dict of tensors"), "{message}");
}

#[test]
fn an_unsupported_dtype_is_refused_naming_key_and_dtype() {
    Fixtures::make().read_and_refuse("complex.pt");
}

#[test]
fn a_truncated_file_is_refused() {
    Fixtures::make().read_and_refuse("truncated.pt");
}

#[test]
fn the_legacy_non_zip_format_is_refused() {
    Fixtures::make().read_and_refuse("legacy.pt");
}

#[test]
fn every_fixture_is_covered() {
    // A fixture the script makes but no test reads would be silently untested.
    let fx = Fixtures::make();
    let mut files: Vec<&str> = fx
        .expected
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "complex.pt",
            "cuda.pt",
            "int_keys.pt",
            "legacy.pt",
            "mixed.pt",
            "non_tensor.pt",
            "not_a_dict.pt",
            "rank-0.pt",
            "rank-1.pt",
            "truncated.pt"
        ]
    );
}

#[test]
fn a_missing_file_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rank-0.pt");
    match read_torch_dict(&path) {
        Err(ShardError::Io { path: p, source }) => {
            assert_eq!(p, path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Io(NotFound), got {other:?}"),
    }
}

#[test]
fn an_empty_or_garbage_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in [
        ("empty.pt", &b""[..]),
        ("garbage.pt", &b"not a zip at all\n"[..]),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        match read_torch_dict(&path) {
            Err(ShardError::Unreadable { path: p, reason }) => {
                assert_eq!(p, path);
                eprintln!("{name}: {reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{name}: expected Unreadable, got {other:?}"),
        }
    }
}

#[test]
fn the_feature_reports_itself_available() {
    assert!(available());
}
