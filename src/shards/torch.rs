//! Python `torch.save({name: tensor, …})` shards, read with libtorch through `tch`.
//!
//! Only compiled with the `torch` cargo feature (see docs/torch.md). What is read: the zip format `torch.save` has written since PyTorch 1.6, a
//! dict whose keys are strings and whose values are all tensors, of any layout (views and
//! strided tensors are copied out row-major) and any device (loaded onto the CPU, like
//! `map_location="cpu"`). What is refused, as [`ShardError::Unreadable`] naming the file:
//! anything but a dict of tensors (a list, a non-tensor value, pickled Python objects), a
//! truncated or corrupt archive, the legacy non-zip format, and dtypes rl-node has no
//! [`DType`] for (complex, quantized, float8…, naming the key).

use super::{DType, ShardError, TensorData};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// True: this build can read `torch.save` shards (the `torch` feature is compiled in).
pub fn available() -> bool {
    true
}

/// Read a `torch.save` dict of tensors: every tensor as contiguous, little-endian,
/// row-major bytes, sorted by name.
pub fn read_torch_dict(path: &Path) -> Result<Vec<TensorData>, ShardError> {
    // A missing or unreadable file is an I/O error, not a format problem; libtorch would
    // only say "open file failed".
    std::fs::File::open(path).map_err(|source| ShardError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let unreadable = |reason: String| ShardError::Unreadable {
        path: path.to_path_buf(),
        reason,
    };

    let loaded = catch_unwind(AssertUnwindSafe(|| {
        Tensor::loadz_multi_with_device(path, Device::Cpu)
    }))
    .map_err(|panic| {
        unreadable(format!(
            "libtorch failed while loading it: {}",
            panic_message(&*panic)
        ))
    })?
    .map_err(|e| unreadable(load_error(path, &libtorch_message(&e.to_string()))))?;

    let mut tensors = Vec::with_capacity(loaded.len());
    for (name, tensor) in loaded {
        let converted = catch_unwind(AssertUnwindSafe(|| to_tensor_data(&name, &tensor)))
            .unwrap_or_else(|panic| {
                Err(format!(
                    "libtorch failed while copying it out: {}",
                    panic_message(&*panic)
                ))
            });
        tensors.push(converted.map_err(|reason| unreadable(format!("key {name:?}: {reason}")))?);
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(tensors)
}

fn to_tensor_data(name: &str, tensor: &Tensor) -> Result<TensorData, String> {
    let kind = tensor
        .f_kind()
        .map_err(|e| format!("unsupported dtype ({e})"))?;
    let dtype = dtype_of(kind).ok_or_else(|| {
        format!(
            "unsupported dtype {kind:?} (supported: f64, f32, f16, bf16, i64, i32, i16, i8, \
             u8, bool)"
        )
    })?;
    let shape = tensor
        .size()
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("negative dimension {d}")))
        .collect::<Result<Vec<usize>, String>>()?;
    let numel = shape.iter().product::<usize>();
    let mut data = vec![0u8; numel * dtype.size()];
    if numel > 0 {
        let contiguous = tensor
            .f_to_device(Device::Cpu)
            .and_then(|t| t.f_contiguous())
            .map_err(|e| {
                format!(
                    "cannot make it contiguous: {}",
                    libtorch_message(&e.to_string())
                )
            })?;
        contiguous
            .f_copy_data_u8(&mut data, numel)
            .map_err(|e| format!("cannot copy its data: {}", libtorch_message(&e.to_string())))?;
    }
    // libtorch hands over native-endian elements; TensorData is little-endian.
    if cfg!(target_endian = "big") && dtype.size() > 1 {
        for element in data.chunks_exact_mut(dtype.size()) {
            element.reverse();
        }
    }
    Ok(TensorData {
        name: name.to_string(),
        dtype,
        shape,
        data,
    })
}

fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::Double => DType::F64,
        Kind::Float => DType::F32,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Int64 => DType::I64,
        Kind::Int => DType::I32,
        Kind::Int16 => DType::I16,
        Kind::Int8 => DType::I8,
        Kind::Uint8 => DType::U8,
        Kind::Bool => DType::Bool,
        _ => return None,
    })
}

/// Why libtorch could not load the file, in the reader's words: what the file looks like
/// (when its first bytes tell) and libtorch's own message.
fn load_error(path: &Path, message: &str) -> String {
    const EXPECTED: &str = "not a torch.save file (zip format) holding a dict of tensors";
    let mut head = [0u8; 14];
    let n = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .unwrap_or(0);
    let head = &head[..n];
    // The legacy format opens with a protocol-2 pickle of torch's magic number
    // 0x1950a86a20f9469cfc6c (LONG1, 10 bytes, little-endian).
    const LEGACY: &[u8] = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";
    let found = if head.is_empty() {
        "the file is empty".to_string()
    } else if head == LEGACY {
        "it is in torch.save's legacy (pre-1.6, non-zip) format; load and save it again with \
         a current torch (zip is the default format)"
            .to_string()
    } else if head[0] == 0x80 {
        format!("it is a plain pickle, not a zip archive ({message})")
    } else if let Some(found) = message
        .split_once("Expected GenericDict but got ")
        .map(|(_, found)| found.trim())
    {
        format!("it holds {}, not a dict", python_kind(found))
    } else if let Some((_, found)) = message.split_once("Expected Tensor but got ") {
        format!(
            "a value of the dict is {}, not a tensor",
            python_kind(found.trim())
        )
    } else if let Some((_, found)) = message.split_once("Expected String but got ") {
        format!(
            "a key of the dict is {}, not a str",
            python_kind(found.trim())
        )
    } else if let Some((what, _)) = message.split_once(". This is an internal miniz error") {
        format!("{what} (the file is truncated or corrupt)")
    } else {
        message.to_string()
    };
    format!("{EXPECTED}: {found}")
}

/// libtorch's name for an unpickled value's kind, as a Python user knows it.
fn python_kind(ivalue_tag: &str) -> String {
    match ivalue_tag {
        "GenericList" | "IntList" | "DoubleList" | "BoolList" | "TensorList" => "a list",
        "GenericDict" => "a dict",
        "Tuple" => "a tuple",
        "Int" | "SymInt" => "an int",
        "Double" | "SymFloat" => "a float",
        "Bool" | "SymBool" => "a bool",
        "String" => "a str",
        "None" => "None",
        "Object" => "a Python object",
        other => return format!("a {other}"),
    }
    .to_string()
}

/// The useful part of a libtorch error: c10 errors carry a C++ backtrace after the
/// message ("Exception raised from …" and frame lists); keep the message.
fn libtorch_message(message: &str) -> String {
    let message = message
        .strip_prefix("Internal torch error: ")
        .unwrap_or(message);
    let end = message
        .find("\nException raised from")
        .or_else(|| message.find("Exception raised from "))
        .unwrap_or(message.len());
    let message = message[..end].trim();
    let message = message
        .split_once("(Could this error message be improved?")
        .map_or(message, |(m, _)| m.trim());
    let message: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    message.join(" ")
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        libtorch_message(s)
    } else {
        "(no message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_maps_to_its_namesake() {
        let pairs = [
            (Kind::Double, DType::F64),
            (Kind::Float, DType::F32),
            (Kind::Half, DType::F16),
            (Kind::BFloat16, DType::BF16),
            (Kind::Int64, DType::I64),
            (Kind::Int, DType::I32),
            (Kind::Int16, DType::I16),
            (Kind::Int8, DType::I8),
            (Kind::Uint8, DType::U8),
            (Kind::Bool, DType::Bool),
        ];
        for (kind, dtype) in pairs {
            assert_eq!(dtype_of(kind), Some(dtype));
            assert_eq!(kind.elt_size_in_bytes(), dtype.size(), "{kind:?}");
        }
        for kind in [Kind::ComplexFloat, Kind::QInt8, Kind::Float8e4m3fn] {
            assert_eq!(dtype_of(kind), None);
        }
    }

    #[test]
    fn libtorch_messages_lose_their_backtrace() {
        let raw = "Internal torch error: Expected Tensor but got Int\n\
                   Exception raised from reportToTensorTypeError at ivalue.cpp:1000 (most \
                   recent call first):\nframe #0: c10::Error::Error() + 0x1 (0x7f in libc10.so)";
        assert_eq!(libtorch_message(raw), "Expected Tensor but got Int");
        let raw = "Expected hasRecord(\"version\") to be true, but got false.  (Could this error \
                   message be improved?  If so, please report an enhancement request to \
                   PyTorch.)\nException raised from init at inline_container.cc:1 (most \
                   recent call first):\nframe #0: c10::Error::Error() + 0x1";
        assert_eq!(
            libtorch_message(raw),
            "Expected hasRecord(\"version\") to be true, but got false."
        );
    }

    #[test]
    fn tensors_made_in_rust_copy_out_row_major() {
        // A transposed (non-contiguous) view is copied in row-major order of the view.
        let t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6]).view([2, 3]).tr();
        let data = to_tensor_data("t", &t).unwrap();
        assert_eq!(data.shape, vec![3, 2]);
        let values: Vec<i32> = data
            .data
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(values, vec![1, 4, 2, 5, 3, 6]);
        assert!(available());
    }
}
